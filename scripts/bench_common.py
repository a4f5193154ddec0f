"""What the benchmark scripts share: the Phi-3-small shape, a median timer, the Identity floor."""

from __future__ import annotations

import statistics
import time

import onnxruntime as ort
from onnx import TensorProto, helper

from sparse_attention_op.graphs import finish_model

#: docs/design.md section 7: 32 query heads over 8 kv heads, head size 128, 64-token blocks,
#: 16 local blocks and vertical stride 8 over 32 layouts, rotary.
PHI3_SMALL = dict(num_heads=32, kv_num_heads=8, head_size=128, sparse_block_size=64, num_layout=32, local_blocks=16, vert_stride=8, do_rotary=True)


def median_seconds(function, reps: int) -> float:
    """Median wall time of ``function`` over ``reps`` calls after one warm-up call."""
    function()  # warm-up: shader compilation, buffer allocation
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def identity_floor_session(cache_shape) -> ort.InferenceSession:
    """ORT passing past_key/past_value through Identity: the copy floor a decode step is held to."""
    shape = list(cache_shape)
    graph = helper.make_graph(
        [helper.make_node("Identity", ["past_key"], ["present_key"]), helper.make_node("Identity", ["past_value"], ["present_value"])],
        "copy_floor",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("past_key", "past_value")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, shape) for n in ("present_key", "present_value")],
    )
    return ort.InferenceSession(finish_model(graph).SerializeToString(), providers=["CPUExecutionProvider"])
