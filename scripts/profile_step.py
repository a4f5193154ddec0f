#!/usr/bin/env python3
"""Where one decode step's time goes: ONNX Runtime's per-node profile, and the op's own phases.

    python scripts/profile_step.py --kv-check fast --way shared --capacity 8192 --history 8152
    python scripts/profile_step.py --prefill 8192
    python scripts/profile_step.py --timeline            # no ORT profiler: spans around and inside the ops
    python scripts/profile_step.py --gpu-passes --capacity 131072 --history 100   # the GPU's part, in the loop

Runs decode steps of one SparseAttention node (Phi-3-small shape, batch 1, float32, as
scripts/bench_decode.py does) with ORT's profiler on, then prints per node type the median
time per step (ORT's own "Node" events: kernel time, the op's Python included), the rest
of ``run`` (ORT's overhead between nodes, binding), and the op's phases. Use it before
optimising: it says whether the time is in ORT, the bridge or the GPU call.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import onnxruntime as ort
from bench_decode import Decoder, model_for, node_stats

import sparse_attention_op as sao
from sparse_attention_op.benchmarking.common import PHI3_SMALL
from sparse_attention_op.benchmarking.host_speed import HostProbe
from sparse_attention_op.cli.arguments import non_negative, positive
from sparse_attention_op.ort.session import session_options
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs


class Prompter:
    """Prompts of ``length`` tokens into a cache of that capacity, past and present shared."""

    def __init__(self, session, length: int, rng):
        self.session = session
        config = CaseConfig(seq_len=length, max_cache_len=length, **PHI3_SMALL)
        self.inputs = random_inputs(config, rng)
        self.values = {n: ort.OrtValue.ortvalue_from_numpy(self.inputs[n]) for n in ("past_key", "past_value")}

    def step(self) -> float:
        binding = sao.bind_shared(self.session, self.inputs, self.values)
        start = time.perf_counter()
        self.session.run_with_iobinding(binding)
        return time.perf_counter() - start


#: Untimed steps before the timed ones (the first compiles kernels and uploads the history).
WARMUP_STEPS = 3


def profile(kv_check: str, way: str, capacity: int, history: int, steps: int, rng, prefill: int = 0) -> None:
    options = session_options()
    options.enable_profiling = True
    options.profile_file_prefix = f"/tmp/sao_profile_{os.getpid()}"
    session = sao.create_session(model_for(prefill or capacity, rng), sess_options=options, kv_check=kv_check, profile=bool(prefill))
    driver = Prompter(session, prefill, rng) if prefill else Decoder(session, capacity, history, way, rng)
    for _ in range(WARMUP_STEPS):
        driver.step()
    runs, phases, passes = [], collections.defaultdict(list), collections.defaultdict(list)
    for _ in range(steps):
        runs.append(driver.step())
        stats = node_stats(session)
        for name, seconds in stats.phases.items():
            phases[name].append(seconds)
        phases["(op wall)"].append(stats.seconds)
        if stats.gpu_total is not None:
            phases["(GPU)"].append(stats.gpu_total)
            for label, seconds in stats.gpu_seconds.items():
                passes[label].append(seconds)
    trace = session.end_profiling()
    with open(trace) as handle:
        events = json.load(handle)
    os.remove(trace)
    # Only the timed steps: the last `steps` runs (the first ones bring the history up).
    per_run = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"][-steps:]
    start = per_run[0]["ts"]
    per_node = collections.defaultdict(list)
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time") and event["ts"] >= start:
            per_node[event["args"].get("op_name", "?")].append(event["dur"])
    runs_profiled = len(per_run)
    case = f"prefill {prefill}, shared buffers" if prefill else f"{kv_check}, {way}, capacity {capacity}, history {history}"
    print(f"\n### {case}: run {statistics.median(runs) * 1e3:.3f} ms (median of {steps})\n")
    print("| node type | count per run | us per run |\n|---|---|---|")
    total = 0.0
    for op, durations in sorted(per_node.items(), key=lambda item: -sum(item[1])):
        us = sum(durations) / max(runs_profiled, 1)
        total += us
        print(f"| {op} | {len(durations) / max(runs_profiled, 1):.0f} | {us:.1f} |")
    model_run = statistics.median(e["dur"] for e in per_run) if per_run else 0
    print(f"| (model_run, median) | | {model_run:.1f} |\n| (between nodes) | | {model_run - total:.1f} |")
    print("\nthe op's phases (us, median): " + ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in phases.items()))
    if passes:
        print("GPU passes (us, median): " + ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in passes.items()))


def timeline(kv_check: str, way: str, capacity: int, history: int, steps: int, rng) -> None:
    """Decode steps without ORT's profiler: where ``run``'s time goes around and inside the
    bridge's op, from clock marks at the entry and exit of its Python body (bridge._compute,
    wrapped). Before it: ORT's run set-up and the custom op's call into Python; after it:
    the return into ORT and ORT's end of the run."""
    from sparse_attention_op.ort import bridge

    marks = []
    body = bridge._compute

    def marked(kernel, context):
        entered = time.perf_counter_ns()
        try:
            body(kernel, context)
        finally:
            marks.append((entered, time.perf_counter_ns()))

    session = sao.create_session(model_for(capacity, rng), kv_check=kv_check)
    bridge._compute = marked
    try:
        driver = Decoder(session, capacity, history, way, rng)
        for _ in range(WARMUP_STEPS):
            driver.step()
        rows, replayed, probe = collections.defaultdict(list), 0, HostProbe()
        for _ in range(steps):
            marks.clear()
            seconds = driver.step()  # run_with_iobinding (or run) alone
            end = time.perf_counter_ns()
            start = end - int(seconds * 1e9)  # run's start, up to the few steps after it returned
            ((k0, k1),) = marks
            for name, ns in (("run", end - start), ("run to op", k0 - start), ("op", k1 - k0), ("op to end", end - k1)):
                rows[name].append(ns / 1e3)
            stats = node_stats(session)
            replayed += stats.replayed
            for name, seconds in stats.phases.items():
                rows[f"op: {name}"].append(seconds * 1e6)
            rows["host probe (after the step)"].append(probe.seconds() * 1e6)  # the host's speed now (benchmarking/host_speed.py)
    finally:
        bridge._compute = body
    print(
        f"\n### timeline: {kv_check}, {way}, capacity {capacity}, history {history} (medians of {steps} steps; the "
        "step's run includes the marks' clock reads)\n"
    )
    print("| span | us |\n|---|---|")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values):.0f} |")
    print(f"\n{replayed} of {steps} steps replayed the node's step plan (webgpu/step_plan.py)")


def gpu_passes(kv_check: str, way: str, capacity: int, history: int, steps: int, rng) -> None:
    """A decode step's GPU time inside the decode loop, at the SM clock the loop runs at
    (a loop of short steps leaves the GPU idle most of the time, so it may never clock up):
    first every dispatch in a timed pass of its own, then the call's dispatches timed as
    the one pass untimed steps record. The two say what each dispatch adds to the pass."""
    from sparse_attention_op.benchmarking.clocks import sm_clock

    clock = sm_clock()
    model = model_for(capacity, rng)
    print(f"\n### GPU passes: {kv_check}, {way}, capacity {capacity}, history {history} (medians of {steps} steps)\n")
    print("| timed as | dispatch | GPU us | run us | SM MHz |\n|---|---|---|---|---|")
    for profile in ("dispatches", "pass"):
        session = sao.create_session(model, kv_check=kv_check, profile=profile)
        driver = Decoder(session, capacity, history, way, rng)
        for _ in range(WARMUP_STEPS):
            driver.step()
        per_label, runs, clocks = collections.defaultdict(list), [], []
        for _ in range(steps):
            runs.append(driver.step())
            for label, seconds in node_stats(session).gpu_seconds.items():
                per_label[label].append(seconds)
            mhz = clock.read()
            if mhz:
                clocks.append(mhz)
        mhz = f"{statistics.median(clocks):.0f}" if clocks else "-"
        run = statistics.median(runs) * 1e6
        for label, values in per_label.items():
            print(f"| {profile} | {label} | {statistics.median(values) * 1e6:.1f} | {run:.0f} | {mhz} |")


def main() -> int:
    import numpy as np

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-check", choices=["exact", "fast"], default="fast")
    parser.add_argument("--way", choices=["shared", "plain"], default="shared")
    parser.add_argument("--capacity", type=positive, default=8192)
    parser.add_argument("--history", type=non_negative, default=8152)
    parser.add_argument("--steps", type=positive, default=20)
    parser.add_argument("--prefill", type=non_negative, default=0, help="profile prompts of this length instead of decode steps")
    parser.add_argument("--timeline", action="store_true", help="decode steps without ORT's profiler: time around and inside the bridge's op")
    parser.add_argument(
        "--gpu-passes",
        action="store_true",
        help="decode steps' GPU time in the loop: each dispatch in a timed pass of its own, then the call's one pass",
    )
    args = parser.parse_args()
    if not args.prefill and args.history + WARMUP_STEPS + args.steps > args.capacity:
        parser.error(
            f"--history {args.history}, {WARMUP_STEPS} warm-up steps and --steps {args.steps} must fit --capacity "
            f"{args.capacity}: each step adds a row"
        )
    print(f"# {' '.join(sys.argv)}, onnxruntime {ort.__version__}")
    if args.gpu_passes:
        gpu_passes(args.kv_check, args.way, args.capacity, args.history, args.steps, np.random.default_rng(0))
    elif args.timeline:
        timeline(args.kv_check, args.way, args.capacity, args.history, args.steps, np.random.default_rng(0))
    else:
        profile(args.kv_check, args.way, args.capacity, args.history, args.steps, np.random.default_rng(0), args.prefill)
    return 0


if __name__ == "__main__":
    sys.exit(main())
