"""What the benchmark scripts share: the Phi-3-small shape, a median timer, the Identity floor."""

from __future__ import annotations

import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from sparse_attention_op.op.reference import apply_rotary, attend, block_mask
from sparse_attention_op.testing.graphs import finish_model

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


def spot_check(inputs: dict, output: np.ndarray, block_size: int, samples: int, rng) -> float:
    """Largest error of sampled (batch 0, token, head) rows of ``output`` against a float64
    recomputation (separate query/key/value, non-interleaved rotary, the default scale):
    a check that every benchmarked call computed attention, not a test."""
    s = inputs["query"].shape[1]
    nkv, h = inputs["past_key"].shape[1], inputs["past_key"].shape[3]
    nh = inputs["query"].shape[2] // h
    total = int(inputs["total_sequence_length"][0])
    past = 0 if total == s else int(inputs["key_total_sequence_lengths"][0]) - s
    mask = block_mask(inputs["block_row_indices"], inputs["block_col_indices"])
    cos, sin = inputs["cos_cache"], inputs["sin_cache"]
    worst = 0.0
    for _ in range(samples):
        head, t = int(rng.integers(nh)), int(rng.integers(s))
        kv = head // (nh // nkv)
        keys = inputs["past_key"][0, kv, : past + s].astype(np.float64)
        values = inputs["past_value"][0, kv, : past + s].astype(np.float64)
        keys[past:] = apply_rotary(inputs["key"][0].reshape(s, nkv, h)[:, kv], past + np.arange(s), cos, sin, False)
        values[past:] = inputs["value"][0].reshape(s, nkv, h)[:, kv]
        query = apply_rotary(inputs["query"][0, t : t + 1, head * h : (head + 1) * h], np.array([past + t]), cos, sin, False)
        want = attend(query, keys, values, np.array([past + t]), mask[head % mask.shape[0]], block_size, 1.0 / np.sqrt(h))[0]
        worst = max(worst, float(np.abs(output[0, t, head * h : (head + 1) * h] - want).max()))
    return worst
