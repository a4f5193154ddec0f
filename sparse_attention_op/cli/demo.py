"""The demo (``make demo``) and the one-block demo model.

:func:`run_demo` runs the bundled multi-layer decoder (models/phi3-small-tiny): a padded
two-row prompt checked against the float64 reference, then greedy generation on shared KV
buffers checked token for token against ONNX Runtime's own CPU kernels.

:func:`build_demo_model` is the one-block model of ``export demo`` and the tests
(models/demo_decoder_attention.onnx): what a Phi-3-small export looks like around the op,
scaled down: a packed QKV projection, SparseAttention with rotary and a block-sparse layout
(local blocks plus vertical stripes), and an output projection; :func:`reference_step` is
its float64 reference.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from sparse_attention_op.op.layouts import mask_to_csr, phi3_small_mask
from sparse_attention_op.op.reference import sparse_attention_reference
from sparse_attention_op.op.spec import DOMAIN, INPUT_NAMES, OP_TYPE
from sparse_attention_op.ort.graph import node_attributes
from sparse_attention_op.testing.graphs import finish_model
from sparse_attention_op.testing.inputs import rotary_caches

DEFAULT_MODEL = Path("models") / "demo_decoder_attention.onnx"
#: What ``make demo`` runs: the bundled multi-layer decoder (scripts/build_models.py).
DEMO_FOLDER = Path("models") / "phi3-small-tiny"


@dataclass(frozen=True)
class DemoShape:
    hidden: int = 256
    num_heads: int = 8
    kv_num_heads: int = 2
    head_size: int = 32
    max_cache_len: int = 256
    sparse_block_size: int = 16
    num_layout: int = 4
    local_blocks: int = 4
    vert_stride: int = 4

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.kv_num_heads) * self.head_size


def build_demo_model(shape: DemoShape = DemoShape(), seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    s = shape
    # Weights scaled so the projected q/k/v are of unit scale for unit-scale hidden states.
    w_qkv = (rng.standard_normal((s.hidden, s.qkv_width)) / np.sqrt(s.hidden)).astype(np.float32)
    w_out = (rng.standard_normal((s.num_heads * s.head_size, s.hidden)) / np.sqrt(s.hidden)).astype(np.float32)
    rows, cols = mask_to_csr(phi3_small_mask(s.max_cache_len // s.sparse_block_size, s.num_layout, s.local_blocks, s.vert_stride))
    cos, sin = rotary_caches(s.max_cache_len, s.head_size)
    initializers = [
        numpy_helper.from_array(w_qkv, "w_qkv"),
        numpy_helper.from_array(w_out, "w_out"),
        numpy_helper.from_array(rows, "block_row_indices"),
        numpy_helper.from_array(cols, "block_col_indices"),
        numpy_helper.from_array(cos, "cos_cache"),
        numpy_helper.from_array(sin, "sin_cache"),
    ]
    nodes = [
        helper.make_node("MatMul", ["hidden_states", "w_qkv"], ["qkv"], name="qkv_proj"),
        helper.make_node(
            OP_TYPE,
            ["qkv", "", "", *INPUT_NAMES[3:]],  # packed QKV; every other input under its slot's name
            ["attention", "present_key", "present_value"],
            name="sparse_attention",
            domain=DOMAIN,
            num_heads=s.num_heads,
            kv_num_heads=s.kv_num_heads,
            sparse_block_size=s.sparse_block_size,
            do_rotary=1,
        ),
        helper.make_node("MatMul", ["attention", "w_out"], ["output"], name="out_proj"),
    ]
    cache = ["batch", s.kv_num_heads, s.max_cache_len, s.head_size]
    inputs = [
        helper.make_tensor_value_info("hidden_states", TensorProto.FLOAT, ["batch", "sequence", s.hidden]),
        helper.make_tensor_value_info("past_key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("past_value", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("key_total_sequence_lengths", TensorProto.INT32, ["batch"]),
    ]
    outputs = [
        helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", "sequence", s.hidden]),
        helper.make_tensor_value_info("present_key", TensorProto.FLOAT, cache),
        helper.make_tensor_value_info("present_value", TensorProto.FLOAT, cache),
    ]
    graph = helper.make_graph(nodes, "demo_decoder_attention", inputs, outputs, initializers)
    return finish_model(graph)


def reference_step(model: onnx.ModelProto, feeds: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The same graph in float64 numpy, with the op's reference in the middle."""
    weights = {init.name: numpy_helper.to_array(init) for init in model.graph.initializer}
    node = next(n for n in model.graph.node if n.op_type == OP_TYPE)
    attrs = node_attributes(node)
    qkv = feeds["hidden_states"].astype(np.float64) @ weights["w_qkv"]
    attention, present_key, present_value = sparse_attention_reference(
        qkv,
        None,
        None,
        feeds["past_key"],
        feeds["past_value"],
        weights["block_row_indices"],
        weights["block_col_indices"],
        feeds["total_sequence_length"],
        feeds["key_total_sequence_lengths"],
        weights["cos_cache"],
        weights["sin_cache"],
        **attrs,
    )
    return attention @ weights["w_out"], present_key, present_value


def run_demo(folder: Path | None = None, prompt_len: int = 40, steps: int = 24, printer=print) -> bool:
    """``make demo``: the bundled multi-layer decoder (models/phi3-small-tiny) on WebGPU.

    A padded two-row prompt (the second row 13 tokens shorter), checked against the float64
    reference (prompt logits at every real token), then greedy generation on shared KV
    buffers, checked token for token against ONNX Runtime's own CPU kernels (row by row:
    they get rows of different lengths wrong, docs/design.md section 1). True when both agree.
    """
    import onnxruntime as ort

    from sparse_attention_op.generation.loop import generate, prompt_logits
    from sparse_attention_op.generation.model_files import load, resolve
    from sparse_attention_op.ort.session import create_session
    from sparse_attention_op.testing.decoder_models import BUNDLED_MODELS, decoder_reference, write_model_folder
    from sparse_attention_op.webgpu import get_context

    folder = Path(folder) if folder is not None else DEMO_FOLDER
    if not (folder / "genai_config.json").is_file() and folder == DEMO_FOLDER:
        folder = write_model_folder(BUNDLED_MODELS[DEMO_FOLDER.name], Path(tempfile.mkdtemp()) / DEMO_FOLDER.name).parent
    files = resolve(folder)
    model = load(files)
    config = files.genai_config["model"]
    vocab, context_length = config["vocab_size"], config["context_length"]
    if prompt_len < 14 or prompt_len + steps > context_length:
        raise ValueError(
            f"the prompt length (--prompt) must be >= 14, since the second row's prompt is 13 tokens shorter, and "
            f"it plus the steps (--steps) at most the model's context of {context_length}, got {prompt_len} and {steps}"
        )
    printer(f"adapter: {get_context().description}")
    decoder = files.decoder_config
    printer(
        f"model: {files.onnx_path} ({decoder['num_hidden_layers']} layers, {decoder['num_attention_heads']} heads over "
        f"{decoder['num_key_value_heads']}, head size {decoder['head_size']}, vocab {vocab}; SparseAttention with every "
        "second layer GroupQueryAttention, as in Phi-3-small)"
    )
    rng = np.random.default_rng(0)
    lengths = [prompt_len, prompt_len - 13]
    prompts = [[int(t) for t in rng.integers(2, vocab, n)] for n in lengths]
    printer(f"prompt: 2 rows of {lengths[0]} and {lengths[1]} tokens (the second right-padded), then {steps} new tokens per row")

    session = create_session(model, kv_check="fast")
    logits, ids, _ = prompt_logits(session, prompts)
    logits = logits.astype(np.float64)
    expected = decoder_reference(model, ids, lengths)
    error = max(float(np.abs(logits[b, :n] - expected[b, :n]).max()) for b, n in enumerate(lengths))
    bound = 5e-2 if _cache_dtype(model) == np.float16 else 2e-3
    scale = float(np.abs(expected).max())
    reference_ok = error <= bound * max(1.0, scale)
    printer(
        f"prompt logits against the float64 reference: max |error| {error:.2e} (logits up to {scale:.1f}; "
        f"{'OK' if reference_ok else 'TOO LARGE'}, bound {bound:g} x max(1, |logits|))"
    )

    result = generate(session, prompts, steps)
    for b, tokens in enumerate(result.tokens):
        printer(f"row {b}: {', '.join(map(str, tokens))}")
    printer(
        f"decode: {result.ms_per_token:.2f} ms per step for both rows, {result.tokens_per_second:.0f} tokens/s "
        f"(prompt {1e3 * result.prompt_seconds:.0f} ms)"
    )
    plain = ort.InferenceSession(str(files.onnx_path), providers=["CPUExecutionProvider"])
    theirs = [generate(plain, [prompt], steps).tokens[0] for prompt in prompts]
    same = theirs == result.tokens
    printer("ONNX Runtime's own CPU kernel, row by row: " + ("identical tokens" if same else f"DIFFERENT tokens: {theirs}"))
    return reference_ok and same


def _cache_dtype(model: onnx.ModelProto):
    past = next(i for i in model.graph.input if i.name.startswith("past_key_values."))
    return helper.tensor_dtype_to_np_dtype(past.type.tensor_type.elem_type)
