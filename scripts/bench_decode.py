#!/usr/bin/env python3
"""Decode-step cost through a real ONNX Runtime session, against the bridge's copy floor.

    python scripts/bench_decode.py                        # capacities 512..8192, short history
    python scripts/bench_decode.py --soak 10000           # plus a soak at the first capacity

One SparseAttention node at the Phi-3-small shape (32 heads over 8 kv heads, head size
128, 64-token blocks, 32 layouts, rotary), batch 1, float32. For each cache capacity it runs
a 64-token prompt, then --steps decode steps feeding each present back, and reports per
step (medians): the whole session.run, the time inside the op's executor, the GPU time of
its compute pass (timestamp queries), and two floors over the same cache tensors: ORT
passing them through Identity, and a PyOp that hands them straight back (what the PyOp
bridge's own copies cost: a fresh copy of each input into Python, a copy of each output
back). The soak runs N decode calls
(restarting the sequence whenever the cache fills) and checks that the process's resident
memory and the GPU memory held for the node stay flat.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from bench_common import PHI3_SMALL, identity_floor_session, median_seconds

import sparse_attention_op as sao
from sparse_attention_op.graphs import sparse_attention_model
from sparse_attention_op.inputs import CaseConfig, random_inputs
from sparse_attention_op.webgpu import get_executor

CONSTANTS = ("block_row_indices", "block_col_indices", "cos_cache", "sin_cache")


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bridge_floor_session(cache_shape):
    """A PyOp that hands past_key/past_value straight back: what the bridge alone costs."""
    from onnxruntime_extensions import PyCustomOpDef, get_library_path

    from sparse_attention_op.bridge import register_array_op

    if not getattr(bridge_floor_session, "registered", False):
        register_array_op(lambda k, v: (k, v), op_type="SaoBridgeFloor", inputs=[PyCustomOpDef.dt_float] * 2, outputs=[PyCustomOpDef.dt_float] * 2)
        bridge_floor_session.registered = True
    graph = helper.make_graph(
        [helper.make_node("SaoBridgeFloor", ["past_key", "past_value"], ["present_key", "present_value"], domain="ai.onnx.contrib")],
        "bridge_floor",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(cache_shape)) for n in ("past_key", "past_value")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(cache_shape)) for n in ("present_key", "present_value")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.contrib", 1)], ir_version=10)
    options = ort.SessionOptions()
    options.register_custom_ops_library(get_library_path())
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


class Generation:
    """A prompt then decode steps on one session, presents fed back."""

    def __init__(self, capacity: int, prompt: int, rng):
        self.config = CaseConfig(seq_len=prompt, max_cache_len=capacity, **PHI3_SMALL)
        self.rng = rng
        self.session = sao.create_session(sparse_attention_model(self.config.node_attributes(), random_inputs(self.config, rng), constants=CONSTANTS))
        self.names = [i.name for i in self.session.get_inputs()]
        self.restart(prompt)

    def restart(self, prompt: int):
        self.inputs = random_inputs(CaseConfig(**{**self.config.__dict__, "seq_len": prompt}), self.rng)
        self.length = None

    def step(self) -> float:
        feeds = {n: self.inputs[n] for n in self.names}
        start = time.perf_counter()
        _, present_key, present_value = self.session.run(None, feeds)
        seconds = time.perf_counter() - start
        self.length = feeds["query"].shape[1] if self.length is None else self.length + 1
        step = CaseConfig(**{**self.config.__dict__, "seq_len": 1, "past_lengths": (self.length,)})
        self.inputs = random_inputs(step, self.rng, past=(present_key, present_value))
        return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--capacities", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192])
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--soak", type=int, default=0, help="decode calls of the soak (0: none)")
    args = parser.parse_args()

    executor = get_executor()
    executor.profile = True
    rng = np.random.default_rng(0)
    print(f"# {' '.join(sys.argv)}\n# {platform.node()} ({os.cpu_count()} CPUs), adapter {executor.context.description}\n")
    print("| capacity | session.run ms | op ms | GPU ms | Identity floor ms | bridge floor ms | run / Identity | run / bridge |")
    print("|---|---|---|---|---|---|---|---|")
    for capacity in args.capacities:
        generation = Generation(capacity, args.prompt, rng)
        generation.step()  # prompt (compiles shaders)
        totals, ops, gpus = [], [], []
        for _ in range(args.steps):
            totals.append(generation.step())
            ops.append(executor.last_stats.seconds)
            gpus.append(executor.last_stats.gpu_seconds)
        shape = generation.inputs["past_key"].shape
        floor_feeds = {n: generation.inputs[n] for n in ("past_key", "past_value")}
        floor_ms, bridge_ms = (
            median_seconds(lambda session=session: session.run(None, floor_feeds), args.steps) * 1e3
            for session in (identity_floor_session(shape), bridge_floor_session(shape))
        )
        run_ms, op_ms = (statistics.median(v) * 1e3 for v in (totals, ops))
        gpu_ms = "-" if gpus[0] is None else f"{statistics.median(gpus) * 1e3:.3f}"
        print(f"| {capacity} | {run_ms:.2f} | {op_ms:.2f} | {gpu_ms} | {floor_ms:.2f} | {bridge_ms:.2f} | {run_ms / floor_ms:.2f}x | {run_ms / bridge_ms:.2f}x |", flush=True)

    if args.soak:
        capacity = args.capacities[0]
        generation = Generation(capacity, args.prompt, rng)
        executor.profile = False
        rss, gpu = [], []
        start = time.perf_counter()
        for call in range(args.soak):
            if generation.length is not None and generation.length >= capacity - 1:
                generation.restart(args.prompt)
            generation.step()
            if call == 100 or call == args.soak - 1:  # after warm-up, and at the end
                rss.append(rss_bytes())
                gpu.append(executor.gpu_bytes())
            if (call + 1) % 1000 == 0:
                print(f"soak: {call + 1}/{args.soak} calls, {time.perf_counter() - start:.0f} s, rss {rss_bytes() / 2**20:.1f} MiB", file=sys.stderr, flush=True)
        print(f"\nsoak: {args.soak} decode calls at capacity {capacity}: rss {rss[0] / 2**20:.1f} -> {rss[-1] / 2**20:.1f} MiB, "
              f"GPU buffers {gpu[0] / 2**20:.1f} -> {gpu[-1] / 2**20:.1f} MiB, {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
