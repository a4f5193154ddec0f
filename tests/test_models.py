"""The bundled decoders (models/) and their builder: current, well-formed, and what the
float64 decoder reference says they compute (the oracle test_generation relies on)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import SMALL_DECODER

from sparse_attention_op.testing.decoder_models import BUNDLED_MODELS, DecoderConfig, build_decoder, decoder_reference, genai_config

REPO = Path(__file__).resolve().parent.parent


def test_committed_models_are_what_the_builder_writes():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "build_models.py"), "--check"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("name", sorted(BUNDLED_MODELS))
def test_bundled_folder_is_a_genai_folder(name):
    folder = REPO / "models" / name
    config = json.loads((folder / "genai_config.json").read_text())
    assert config == genai_config(BUNDLED_MODELS[name])
    model = onnx.load(str(folder / "model.onnx"))
    onnx.checker.check_model(model)
    ops = [n.op_type for n in model.graph.node if n.domain == "com.microsoft"]
    # Phi-3-small's mix: every second layer dense.
    assert ops == ["SparseAttention", "GroupQueryAttention"] * (BUNDLED_MODELS[name].layers // 2)
    assert (folder / "model.onnx").stat().st_size < 3e6


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_reference_matches_ort_cpu_on_uniform_rows(dtype, rng):
    """Where ORT's kernels are right (every row one length), they agree with the float64 reference."""
    config = dataclasses.replace(SMALL_DECODER, intermediate=0, dtype=dtype)
    model = build_decoder(config)
    ids = rng.integers(0, config.vocab_size, (2, 50))
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    np_dtype = np.float16 if dtype == "float16" else np.float32
    for layer in range(config.layers):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kind}"] = np.zeros((2, config.kv_num_heads, 50, config.head_size), np_dtype)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    binding = session.io_binding()
    binding.bind_output("logits")  # first bound: get_outputs()[0]
    values = {}
    for name, array in feeds.items():
        if name.startswith("past_"):  # ORT's kernels want past and present in one buffer
            values[name] = ort.OrtValue.ortvalue_from_numpy(array)
            binding.bind_ortvalue_input(name, values[name])
            binding.bind_ortvalue_output(name.replace("past_key_values", "present"), values[name])
        else:
            binding.bind_cpu_input(name, array)
    session.run_with_iobinding(binding)
    logits = binding.get_outputs()[0].numpy().astype(np.float64)
    expected = decoder_reference(model, ids, [50, 50])
    scale = float(np.abs(expected).max())
    assert scale > 2, "logits of unit-ish scale, or the comparison says little"
    tolerance = 3e-2 if dtype == "float16" else 1e-4
    assert float(np.abs(logits - expected).max()) <= tolerance * scale


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_heads", 6, "must be a multiple of kv_num_heads"),
        ("head_size", 24, "multiple of 16"),
        ("sparse_block_size", 12, "power of two"),
        ("max_position", 100, "multiple of sparse_block_size"),
        ("dtype", "bfloat16", "dtype must be one of"),
        ("layers", 0, "layers must be a positive int"),
        ("eos_token_id", 4096, "token id in [0, 512)"),
        ("static_cache", 1024, "static_cache (1024) must not exceed max_position (512)"),
        ("static_cache", -1, "static_cache must be a non-negative int"),
        ("weights", "int8", "weights must be one of"),
    ],
)
def test_config_errors_name_the_field(field, value, message):
    config = DecoderConfig(**{"kv_num_heads": 4, field: value}) if field == "num_heads" else DecoderConfig(**{field: value})
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        build_decoder(config)


def config_props(model: onnx.ModelProto) -> dict:
    return json.loads({p.key: p.value for p in model.metadata_props}["sparse_attention_op.decoder_config"])


def test_late_fields_reach_the_props_only_when_set():
    """Fields added after models/ was committed stay out of the props at their defaults, so the
    committed bytes hold; set, they travel with the model like the others."""
    small = DecoderConfig(vocab_size=96, hidden=64, layers=2, num_heads=4, kv_num_heads=2, head_size=16, max_position=128)
    assert not {"weights", "static_cache"} & set(config_props(build_decoder(small)))
    props = config_props(build_decoder(dataclasses.replace(small, static_cache=64, weights="int4")))
    assert (props["static_cache"], props["weights"]) == (64, "int4")


def test_static_cache_model_runs_with_pasts_of_exactly_that_length(rng):
    """Every past and present declares static_cache rows; ORT's CPU provider runs a prompt and
    a decode step on pasts of exactly that length, past and present bound to one buffer."""
    config = dataclasses.replace(SMALL_DECODER, intermediate=0, max_position=256, static_cache=256)
    model = build_decoder(config)
    caches = [*model.graph.input[2:], *model.graph.output[1:]]
    assert len(caches) == 4 * config.layers
    for value in caches:
        dims = value.type.tensor_type.shape.dim
        assert (dims[0].dim_param, dims[1].dim_value, dims[2].dim_value, dims[3].dim_value) == ("batch_size", 2, 256, 16), value.name
    assert genai_config(config)["search"]["max_length"] == 256

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    buffers = {}
    for layer in range(config.layers):
        for kind in ("key", "value"):
            buffers[layer, kind] = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, 2, 256, 16), np.float32))

    def run(ids: np.ndarray, total: int) -> np.ndarray:
        binding = session.io_binding()
        binding.bind_output("logits")
        binding.bind_cpu_input("input_ids", ids)
        binding.bind_cpu_input("attention_mask", np.ones((1, total), np.int64))
        for (layer, kind), buffer in buffers.items():
            binding.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", buffer)
            binding.bind_ortvalue_output(f"present.{layer}.{kind}", buffer)
        session.run_with_iobinding(binding)
        return binding.get_outputs()[0].numpy().astype(np.float64)

    ids = rng.integers(0, config.vocab_size, (1, 11))
    prompt = run(ids[:, :10], 10)
    step = run(ids[:, 10:], 11)
    expected = decoder_reference(model, ids, [11])
    assert float(np.abs(expected).max()) > 2
    np.testing.assert_allclose(prompt[0], expected[0, :10], atol=1e-4 * float(np.abs(expected).max()))
    np.testing.assert_allclose(step[0, 0], expected[0, 10], atol=1e-4 * float(np.abs(expected).max()))
