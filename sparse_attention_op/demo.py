"""The demo: a small decoder attention block with SparseAttention, run through ONNX Runtime.

The graph is what a Phi-3-small export looks like around the op, scaled down: a packed QKV
projection, SparseAttention with rotary and a block-sparse layout (local blocks plus
vertical stripes), and an output projection. The demo runs a padded two-row prompt and
then decode steps that feed each present back as the next past, and checks every step
against the float64 reference.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .graphs import finish_model
from .inputs import rotary_caches
from .layouts import mask_to_csr, phi3_small_mask
from .reference import sparse_attention_reference
from .spec import DOMAIN, OP_TYPE

DEFAULT_MODEL = Path("models") / "demo_decoder_attention.onnx"


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
            ["qkv", "", "", "past_key", "past_value", "block_row_indices", "block_col_indices",
             "total_sequence_length", "key_total_sequence_lengths", "cos_cache", "sin_cache"],
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
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    qkv = feeds["hidden_states"].astype(np.float64) @ weights["w_qkv"]
    attention, present_key, present_value = sparse_attention_reference(
        qkv, None, None, feeds["past_key"], feeds["past_value"], weights["block_row_indices"], weights["block_col_indices"],
        feeds["total_sequence_length"], feeds["key_total_sequence_lengths"], weights["cos_cache"], weights["sin_cache"], **attrs,
    )
    return attention @ weights["w_out"], present_key, present_value


@dataclass
class StepReport:
    name: str
    seconds: float
    max_error: float


def run_demo(model_path: Path | None = None, prompt_len: int = 48, decode_steps: int = 16, printer=print) -> list[StepReport]:
    import sparse_attention_op as sao
    from .webgpu import get_context

    model = onnx.load(str(model_path)) if model_path and Path(model_path).is_file() else build_demo_model()
    hidden = model.graph.input[0].type.tensor_type.shape.dim[2].dim_value
    cache_dims = [d.dim_value for d in model.graph.input[1].type.tensor_type.shape.dim]
    context = get_context()
    printer(f"adapter: {context.description}")
    session = sao.create_session(model)
    rng = np.random.default_rng(0)
    batch, lengths = 2, np.array([prompt_len, prompt_len - 11], dtype=np.int32)  # row 1 is padded
    cache_shape = (batch, cache_dims[1], cache_dims[2], cache_dims[3])
    feeds = {
        "hidden_states": rng.standard_normal((batch, prompt_len, hidden), dtype=np.float32),
        "past_key": np.zeros(cache_shape, np.float32),
        "past_value": np.zeros(cache_shape, np.float32),
        "total_sequence_length": np.array([prompt_len], np.int32),
        "key_total_sequence_lengths": lengths,
    }
    printer(f"model: {model.graph.name}, hidden {hidden}, cache {cache_shape}, prompt {prompt_len} tokens (row 1 padded to it), {decode_steps} decode steps")
    reports = []
    for step in range(decode_steps + 1):
        start = time.perf_counter()
        output, present_key, present_value = session.run(None, feeds)
        seconds = time.perf_counter() - start
        expected = reference_step(model, feeds)
        # Padding rows of the prompt are not compared: their output is never used.
        valid = [slice(None)] * batch if step else [slice(0, int(n)) for n in lengths]
        error = max(float(np.abs(output[b, valid[b]] - expected[0][b, valid[b]]).max()) for b in range(batch))
        for got, want in ((present_key, expected[1]), (present_value, expected[2])):
            for b in range(batch):
                live = int(feeds["key_total_sequence_lengths"][b])
                error = max(error, float(np.abs(got[b, :, :live] - want[b, :, :live]).max()))
        reports.append(StepReport("prompt" if step == 0 else f"decode {step}", seconds, error))
        # Next step: one new token per row, after everything the row holds now.
        key_totals = (feeds["key_total_sequence_lengths"] + 1).astype(np.int32)
        feeds = {
            "hidden_states": rng.standard_normal((batch, 1, hidden), dtype=np.float32),
            "past_key": present_key,
            "past_value": present_value,
            "total_sequence_length": np.array([key_totals.max()], np.int32),
            "key_total_sequence_lengths": key_totals,
        }
    prompt, decodes = reports[0], reports[1:]
    worst = max(r.max_error for r in reports)
    printer(f"prompt: {prompt.seconds * 1e3:.1f} ms (first call includes shader compilation), max |error| {prompt.max_error:.2e}")
    if decodes:
        steady = sorted(r.seconds for r in decodes[1:]) or [decodes[0].seconds]
        printer(f"decode: {len(decodes)} steps, median {steady[len(steady) // 2] * 1e3:.2f} ms/step, max |error| {max(r.max_error for r in decodes):.2e}")
    printer(f"largest error against the float64 reference: {worst:.2e} ({'OK' if worst < 2e-3 else 'TOO LARGE'}, bound 2e-3)")
    return reports
