"""int4 decoders (DecoderConfig.weights): laid out exactly as ONNX Runtime's own quantizer
writes them, drawn codes that mean what the builder says, end-to-end runs on ORT's CPU
provider, and the streamed external-data writer that real-width models go through."""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import SMALL_DECODER
from onnx import helper, numpy_helper

from sparse_attention_op.testing import decoder_models
from sparse_attention_op.testing.decoder_models import (
    build_decoder,
    decoder_reference,
    dequantize_int4,
    initializer_bytes,
    phi3_small_config,
    write_model_folder,
)
from sparse_attention_op.testing.graphs import finish_model

REPO = Path(__file__).resolve().parent.parent
SMALL = SMALL_DECODER
NP_DTYPES = {"float32": np.float32, "float16": np.float16}


def ort_quantized(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` through ORT's MatMulNBitsQuantizer: 4 bits, blocks of 32, symmetric, QOperator."""
    pytest.importorskip("onnx_ir", reason="onnxruntime's matmul_nbits_quantizer imports onnx_ir (pip install onnx-ir)")
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # one line per node
    quantizer = MatMulNBitsQuantizer(onnx.ModelProto.FromString(model.SerializeToString()), bits=4, block_size=32, is_symmetric=True)
    quantizer.process()
    return quantizer.model.model


def run_prompt(model: onnx.ModelProto, ids: np.ndarray, capacity: int) -> np.ndarray:
    """Logits of a whole prompt on ORT's CPU provider, past and present bound to one buffer of
    ``capacity`` rows per layer, as GenAI binds them (ORT's kernels want that)."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    cache = session.get_inputs()[2]  # past_key_values.0.key: [batch, kv heads, rows, head size]
    dtype = np.float16 if cache.type == "tensor(float16)" else np.float32
    binding = session.io_binding()
    binding.bind_output("logits")
    binding.bind_cpu_input("input_ids", ids)
    binding.bind_cpu_input("attention_mask", np.ones_like(ids))
    buffers = []
    for graph_input in session.get_inputs()[2:]:
        buffers.append(ort.OrtValue.ortvalue_from_numpy(np.zeros((ids.shape[0], cache.shape[1], capacity, cache.shape[3]), dtype)))
        binding.bind_ortvalue_input(graph_input.name, buffers[-1])
        binding.bind_ortvalue_output(graph_input.name.replace("past_key_values", "present"), buffers[-1])
    session.run_with_iobinding(binding)
    return binding.get_outputs()[0].numpy().astype(np.float64)


def unpack_by_hand(packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """[K, N] from MatMulNBits' B [N, K/32, 16] element by element: byte j of a block holds
    element 2j in its low nibble and 2j + 1 in its high one; an element is (code - 8) * scale."""
    cols, blocks, _ = packed.shape
    matrix = np.empty((blocks * 32, cols))
    for n in range(cols):
        for b in range(blocks):
            for j in range(16):
                byte = int(packed[n, b, j])
                matrix[b * 32 + 2 * j, n] = ((byte & 0xF) - 8) * float(scales[n, b])
                matrix[b * 32 + 2 * j + 1, n] = ((byte >> 4) - 8) * float(scales[n, b])
    return matrix


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_int4_build_is_what_orts_quantizer_writes(dtype):
    config = dataclasses.replace(SMALL, dtype=dtype)
    expected = ort_quantized(build_decoder(config))
    built = build_decoder(dataclasses.replace(config, weights="int4"))
    assert dataclasses.replace(config, weights="int4").weight_source == "quantized"
    ours = {t.name: t for t in built.graph.initializer}
    theirs = {t.name: t for t in expected.graph.initializer}
    assert list(ours) == list(theirs)
    packed = [name for name in ours if name.endswith(("_Q4", "_scales"))]
    assert len(packed) == 2 * (4 * config.layers + 1)  # qkv, o_proj, up, down per layer, and lm_head
    for name in packed:
        assert ours[name].SerializeToString() == theirs[name].SerializeToString(), name
    for ours_node, their_node in zip(built.graph.node, expected.graph.node, strict=True):
        assert ours_node == their_node, their_node.name
    # Everything else too: the same graph, byte for byte, and the same opsets.
    assert built.graph.SerializeToString() == expected.graph.SerializeToString()
    assert list(built.opset_import) == list(expected.opset_import)
    matmuls = [node for node in built.graph.node if node.op_type == "MatMulNBits"]
    assert [(a.name, a.i) for a in matmuls[0].attribute] == [("K", 64), ("N", 128), ("bits", 4), ("block_size", 32)]


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_drawn_bytes_mean_code_minus_8_times_scale(dtype, rng):
    """ORT's MatMulNBits on a drawn weight equals numpy's matmul with the weight dequantized by hand."""
    model = build_decoder(dataclasses.replace(SMALL, dtype=dtype, weights="int4-drawn"))
    node = next(n for n in model.graph.node if n.name == "/model/layers.0/mlp/down_proj/MatMul_Q4")
    weights = {t.name: t for t in model.graph.initializer if t.name in node.input}
    packed, scales = (numpy_helper.to_array(weights[name]) for name in node.input[1:])
    assert packed.dtype == np.uint8 and packed.shape == (64, 3, 16) and scales.shape == (64, 3)
    assert scales.dtype == NP_DTYPES[dtype]
    matrix = unpack_by_hand(packed, scales)
    np.testing.assert_array_equal(dequantize_int4(packed, scales), matrix)  # what decoder_reference uses

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(NP_DTYPES[dtype]))
    single = helper.make_node("MatMulNBits", ["a", *node.input[1:]], ["y"], domain=node.domain, **{a.name: a.i for a in node.attribute})
    graph = helper.make_graph(
        [single],
        "one_matmul",
        [helper.make_tensor_value_info("a", elem, [5, 96])],
        [helper.make_tensor_value_info("y", elem, [5, 64])],
        list(weights.values()),
    )
    a = rng.standard_normal((5, 96)).astype(NP_DTYPES[dtype])
    session = ort.InferenceSession(finish_model(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    got = session.run(None, {"a": a})[0].astype(np.float64)
    expected = a.astype(np.float64) @ matrix
    tolerance = 2e-3 if dtype == "float16" else 1e-5
    assert float(np.abs(got - expected).max()) <= tolerance * float(np.abs(expected).max())


def test_drawn_weights_have_the_float_draws_scale():
    """Uniform codes, and scales that give each dequantized matrix RMS scale / sqrt(fan in)."""
    config = dataclasses.replace(SMALL, weights="int4-drawn", hidden=256, intermediate=512)
    model = build_decoder(config)
    arrays = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    name = "model.layers.1.mlp.up_proj.weight"
    packed, scales = arrays[name + "_Q4"], arrays[name + "_scales"]
    codes = np.concatenate([packed & 0xF, packed >> 4]).ravel()
    assert np.bincount(codes, minlength=16).min() > 0.9 * codes.size / 16
    rms = float(np.sqrt(np.mean(dequantize_int4(packed, scales) ** 2)))
    assert rms == pytest.approx(2.0 / np.sqrt(256), rel=0.03)  # up_proj's factor 2, as the float draws
    assert scales.std() > 0.2 * scales.mean()  # per-block scales differ, so a misplaced scale shows


@pytest.mark.parametrize("weights", ["int4-quantized", "int4-drawn"])
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_int4_decoder_runs_end_to_end_on_ort_cpu(weights, dtype, rng):
    model = build_decoder(dataclasses.replace(SMALL, dtype=dtype, weights=weights))
    ids = rng.integers(0, SMALL.vocab_size, (2, 40))
    logits = run_prompt(model, ids, capacity=40)
    assert np.isfinite(logits).all()
    assert 2 < logits.std() < 8, "logits of unit-ish scale (logit_scale 4)"
    expected = decoder_reference(model, ids, [40, 40])  # the int4 weights dequantized
    tolerance = 3e-2 if dtype == "float16" else 1e-4
    assert float(np.abs(logits - expected).max()) <= tolerance * float(np.abs(expected).max())


def test_weights_int4_quantizes_small_models_and_draws_large_ones():
    assert dataclasses.replace(SMALL, weights="int4").weight_source == "quantized"
    assert dataclasses.replace(SMALL, weights="int4-drawn").weight_source == "drawn"
    assert SMALL.weight_source == "float"
    assert phi3_small_config(layers=1).weight_source == "drawn"  # 0.6 G float parameters


def test_phi3_small_preset_is_the_real_shape():
    config = phi3_small_config(layers=2)
    config.validate()
    assert (config.hidden, config.num_heads, config.kv_num_heads, config.head_size) == (4096, 32, 8, 128)
    assert (config.sparse_block_size, config.local_blocks, config.vert_stride, config.layouts) == (64, 16, 8, 32)
    assert (config.mlp_width, config.vocab_size, config.max_position, config.dtype) == (14336, 100352, 8192, "float16")
    assert [config.is_dense(i) for i in range(2)] == [False, True]
    # The float16 embedding (822 MB) and int4 matrices with float16 scales (9/16 byte a weight).
    assert initializer_bytes(config) == pytest.approx(1.235e9, rel=0.01)
    assert phi3_small_config(layers=32, max_position=4096).max_position == 4096


def test_int4_widths_must_be_whole_blocks():
    with pytest.raises(ValueError, match=r"DecoderConfig.hidden \(48\) must be a multiple of 32 \(the int4 block size\)"):
        build_decoder(dataclasses.replace(SMALL, hidden=48, weights="int4"))
    with pytest.raises(ValueError, match=r"DecoderConfig.weights must be one of"):
        build_decoder(dataclasses.replace(SMALL, weights="int8"))


def test_external_data_folder_holds_the_same_model(tmp_path, monkeypatch):
    """The streamed writer: one data file, large tensors aligned, and loaded back the very model
    build_decoder makes in memory."""
    monkeypatch.setattr(decoder_models, "ALIGN_MIN_BYTES", 4096)  # small tensors, so alignment is exercised
    config = dataclasses.replace(SMALL, weights="int4-drawn", dtype="float16")
    written = []
    path = write_model_folder(config, tmp_path, external_data=True, progress=lambda name, size: written.append(size))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["genai_config.json", "model.onnx", "model.onnx.data"]
    assert sum(written) == initializer_bytes(config)
    bare = onnx.load(str(path), load_external_data=False)
    external = [t for t in bare.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert {entry.value for t in external for entry in t.external_data if entry.key == "location"} == {"model.onnx.data"}
    offsets = {t.name: dict((e.key, int(e.value)) for e in t.external_data if e.key != "location") for t in external}
    assert all(o["offset"] % 65536 == 0 for o in offsets.values() if o["length"] >= 4096)
    loaded = onnx.load(str(path))
    for tensor in loaded.graph.initializer:
        tensor.ClearField("data_location")  # onnx.load leaves it set to DEFAULT where build_decoder leaves it unset
    assert loaded.graph.SerializeToString() == build_decoder(config).graph.SerializeToString()
    ids = np.arange(1, 21).reshape(1, 20)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].name == "input_ids"
    np.testing.assert_array_equal(run_prompt(loaded, ids, 20), run_prompt(build_decoder(config), ids, 20))


def load_build_script():
    spec = importlib.util.spec_from_file_location("build_models", REPO / "scripts" / "build_models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--real-width", "--out", "/tmp/x"], "needs --layers N and --out FOLDER"),
        (["--real-width", "--layers", "2"], "needs --layers N and --out FOLDER"),
        (["--real-width", "--layers", "2", "--out", str(REPO / "models" / "big")], "must not be committed"),
        (["--real-width", "--layers", "2", "--out", "/tmp/x", "--check"], "takes neither --check nor model names"),
        (["--layers", "2"], "--layers only apply with --real-width"),
    ],
)
def test_build_script_refuses_bad_real_width_requests(argv, message, capsys):
    script = load_build_script()
    with pytest.raises(SystemExit):
        script.parse_args(argv)
    assert message in capsys.readouterr().err
