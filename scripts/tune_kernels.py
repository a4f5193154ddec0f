#!/usr/bin/env python3
"""Sweep the attention kernels' tunables at the Phi-3-small shape and print the best per case.

    python scripts/tune_kernels.py                     # H200: prefill 1024/4096/8192, decode at 8191 (f32 and f16 cache)
    python scripts/tune_kernels.py --quick             # lavapipe: the same sweep at small shapes
    python scripts/tune_kernels.py --lavapipe-check    # sparse prefill 2048 (~20% of causal pairs) vs numpy dense causal

Shape (sparse_attention_op/benchmarking/common.py PHI3_SMALL): 32 query heads over 8 kv heads, head size 128,
64-token blocks, 16 local blocks, vertical stride 8 over 32 layouts, rotary, batch 1, float32.

Every candidate is a :class:`~sparse_attention_op.webgpu.tuning.Tuning` (the adapter's own,
with some fields replaced) run by an executor of its own on the one device. Times are GPU
time per dispatch from timestamp queries, medians over --reps calls after one warm-up call
(which compiles); each timed call runs a warmer dispatch, then its dispatches back to back
(at least --repeats times, about 50 ms of GPU work) and only the later half counts
(RepeatedDispatches says why). "attention ms" is the call's GPU time without a KV-append pass
(decode candidates that fuse it into their merge pass have none); candidates are ranked by the
call's whole GPU time. Prefill reports TFLOP/s over the selected work ((query,
key) pairs the layout lets a query see, times 4 * head_size flops); decode reports GB/s over
the selected K/V bytes (each visible key's K and V rows, per query head). Each result is
spot-checked against a float64 recomputation of sampled rows (8 of them); a candidate over
the tolerance (2e-3, float16 caches 1e-2) is marked FAIL and never chosen as the best.
"SM MHz" is the GPU's SM clock read (NVML, NVIDIA only) as each timed call ends, the median
of the kept round: a candidate timed below the boost clock is not comparable with the others.
With --whole-pass, "one pass ms" is the time per call of the call's dispatches repeated back
to back in one timed compute pass, as untimed calls record them (each timed pass costs about
4 us even empty on the H200: the per-dispatch passes count it once per dispatch, the one pass
spreads it over the repetitions); the ranking stays on the per-dispatch total.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import jinja2
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sparse_attention_op.benchmarking.clocks import median_mhz, sm_clock  # noqa: E402
from sparse_attention_op.benchmarking.common import PHI3_SMALL, spot_check  # noqa: E402
from sparse_attention_op.cli.arguments import positive  # noqa: E402
from sparse_attention_op.op.reference import apply_rotary, block_mask  # noqa: E402
from sparse_attention_op.op.spec import OpAttributes, build_call  # noqa: E402
from sparse_attention_op.settings import SessionSettings  # noqa: E402
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs  # noqa: E402
from sparse_attention_op.webgpu import get_executor, kernels  # noqa: E402
from sparse_attention_op.webgpu.executor import WebGPUExecutor  # noqa: E402
from sparse_attention_op.webgpu.programs import Binding, Dispatch, Program, _environment  # noqa: E402

#: GPU work per timed call that the repetitions aim for, and their cap (decode is ~50 us).
SETTLE_SECONDS = 0.05
MAX_REPEATS = 400
#: The warmer: GPU seconds before each timed call, its grid, its calibration run's length.
#: H200, 2026-12-02: with 0.03 s nvidia-smi read 780-1035 MHz (not 1980) in the windows of
#: some candidates, whose merge pass, the same in all, then took 0.016-0.020 ms instead of
#: 0.008; with 0.3 s every candidate of a decode sweep timed its merge at 0.008-0.009 ms.
WARM_SECONDS = 0.3
WARMER_GROUPS = 4096
WARM_CALIBRATION = 20000

#: Forces the simple pass (attention.wgsl.jinja) for a call of any length: the baseline.
SIMPLE_PASS = dict(decode_max_queries=0, prefill_min_queries=1 << 30)


#: Prefill candidates: (name, Tuning fields replaced). The first real one is the default.
def tiled(**fields) -> dict:
    """A tiled-pass candidate (explicit, so that it means the same where rows is the default)."""
    return dict(prefill_pass="tiled", **fields)


PREFILL_CANDIDATES = [
    ("default", {}),
    ("simple pass", SIMPLE_PASS),
    ("tiled", tiled()),
    ("no prefetch", tiled(prefill_prefetch=False)),
    ("dot scores", tiled(prefill_fma_scores=False)),
    ("prepared query", tiled(prefill_resident_query=False)),
    ("depth 4", tiled(prefill_depth_chunk=4)),
    ("depth 16", tiled(prefill_depth_chunk=16, prefill_value_chunk=16)),
    ("vchunk 16", tiled(prefill_value_chunk=16)),
    ("vchunk 64", tiled(prefill_value_chunk=64, prefill_depth_chunk=4)),
    ("k32", tiled(prefill_key_tile=32)),
    ("regs 8x4", tiled(prefill_query_regs=8)),
    ("regs 4x8", tiled(prefill_key_regs=8)),
    ("q32 regs 2x4", tiled(prefill_query_tile=32, prefill_query_regs=2)),
    ("wg512 regs 2x4", tiled(prefill_query_regs=2)),
    ("wg512 regs 4x2", tiled(prefill_key_regs=2)),
    ("checked shaders", dict(shader_runtime_checks=True)),
]

#: The rows pass (CPU adapters): on a GPU it runs 100x slower than the tiled pass
#: (0.19 TFLOP/s on the H200), so the sweep tries these only where it is the default or
#: with --quick.
ROWS_CANDIDATES = [
    ("rows", dict(prefill_pass="rows")),
    ("rows q1", dict(prefill_pass="rows", rows_query_regs=1)),
    ("rows q2", dict(prefill_pass="rows", rows_query_regs=2)),
    ("rows q8", dict(prefill_pass="rows", rows_query_regs=8)),
    ("regs 8x8", tiled(prefill_query_regs=8, prefill_key_regs=8)),
    ("regs 8x8 no prefetch", tiled(prefill_query_regs=8, prefill_key_regs=8, prefill_prefetch=False)),
]

#: Decode candidates.
DECODE_CANDIDATES = [
    ("default", {}),
    ("simple pass", SIMPLE_PASS),
    ("checked shaders", dict(shader_runtime_checks=True)),
    ("target 64", dict(decode_target_workgroups=64)),
    ("target 256", dict(decode_target_workgroups=256)),
    ("target 512", dict(decode_target_workgroups=512)),
    ("target 1024", dict(decode_target_workgroups=1024)),
    ("wg 128 target 1024", dict(decode_workgroup=128, decode_target_workgroups=1024)),
    ("target 2048", dict(decode_target_workgroups=2048, decode_min_keys_per_split=32)),
    ("lanes 16", dict(decode_lanes_per_key=16)),
    ("lanes 4", dict(decode_lanes_per_key=4)),
    ("target 128", dict(decode_target_workgroups=128)),
    ("target 192", dict(decode_target_workgroups=192)),
    ("keys/group 4 target 128", dict(decode_keys_per_group=4, decode_target_workgroups=128)),
    ("keys/group 1", dict(decode_keys_per_group=1)),
    ("keys/group 2", dict(decode_keys_per_group=2)),
    ("per-lane query", dict(decode_shared_query=False)),
    ("keys/group 4", dict(decode_keys_per_group=4)),
    ("wg 128", dict(decode_workgroup=128)),
    ("wg 128 target 512", dict(decode_workgroup=128, decode_target_workgroups=512)),
    ("wg 64 target 256", dict(decode_workgroup=64, decode_target_workgroups=256)),
    ("merge wg 64", dict(merge_workgroup=64, decode_split_merges=False)),
    ("append pass", dict(decode_fused_append=False)),
    ("fused append", dict(decode_fused_append=True)),
    ("merge pass", dict(decode_split_merges=False)),
    ("split merges", dict(decode_split_merges=True)),
    ("wg 512", dict(decode_workgroup=512)),
    ("wg 512 keys/group 1", dict(decode_workgroup=512, decode_keys_per_group=1)),
    ("wg 1024 keys/group 1", dict(decode_workgroup=1024, decode_keys_per_group=1)),
    ("wg 512 target 128", dict(decode_workgroup=512, decode_target_workgroups=128)),
    ("keys/group 1 target 512", dict(decode_keys_per_group=1, decode_target_workgroups=512)),
    ("keys/group 1 target 1024", dict(decode_keys_per_group=1, decode_target_workgroups=1024, decode_min_keys_per_split=32)),
    (
        "wg 128 keys/group 1 target 1024",
        dict(decode_workgroup=128, decode_keys_per_group=1, decode_target_workgroups=1024, decode_min_keys_per_split=32),
    ),
    (
        "wg 128 keys/group 1 target 2048",
        dict(decode_workgroup=128, decode_keys_per_group=1, decode_target_workgroups=2048, decode_min_keys_per_split=16),
    ),
    (
        "lanes 16 keys/group 1 target 512",
        dict(decode_lanes_per_key=16, decode_keys_per_group=1, decode_target_workgroups=512, decode_min_keys_per_split=32),
    ),  # where the adapter's own tuning does not (CPU adapters)
]


@dataclasses.dataclass
class Case:
    kind: str  # "prefill" | "decode"
    seq_len: int
    past: int | None
    cache: str  # "f32" | "f16"

    @property
    def label(self) -> str:
        what = f"prefill {self.seq_len}" if self.kind == "prefill" else f"decode at {self.past}"
        return what + (" f16 cache" if self.cache == "f16" else "")

    def config(self, **layout) -> CaseConfig:
        capacity = self.seq_len if self.past is None else self.past + self.seq_len
        capacity = -(-capacity // PHI3_SMALL["sparse_block_size"]) * PHI3_SMALL["sparse_block_size"]
        past = None if self.past is None else (self.past,)
        return CaseConfig(seq_len=self.seq_len, max_cache_len=capacity, past_lengths=past, **{**PHI3_SMALL, **layout})


def make_inputs(case: Case, config: CaseConfig, rng) -> dict:
    inputs = random_inputs(config, rng)
    if case.cache == "f16":  # what a float16 graph hands over: float16 values
        inputs = {k: (v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v) for k, v in inputs.items()}
    return inputs


def visible_keys(inputs, attrs) -> np.ndarray:
    """Keys each (head, token) query sees, for batch row 0: the selected work."""
    s = inputs["query"].shape[1]
    blk, nh = attrs["sparse_block_size"], attrs["num_heads"]
    total = int(inputs["total_sequence_length"][0])
    past = 0 if total == s else int(inputs["key_total_sequence_lengths"][0]) - s
    mask = block_mask(inputs["block_row_indices"], inputs["block_col_indices"])  # (layout, rows, cols)
    positions = past + np.arange(s)
    rows = positions // blk
    counts = np.zeros((nh, s), np.int64)
    for head in range(nh):
        selected = mask[head % mask.shape[0]][rows]  # (s, cols)
        earlier = (selected & (np.arange(mask.shape[2])[None, :] < rows[:, None])).sum(axis=1) * blk
        diagonal = selected[np.arange(s), rows] * (positions - rows * blk + 1)
        counts[head] = earlier + diagonal
    return counts


#: A dispatch that only keeps the GPU busy (an FMA chain per invocation), run before the
#: timed dispatches of a call so that they start at the clock a sustained load gets.
WARMER_TEMPLATE = """{{ declarations }}
@compute @workgroup_size(256, 1, 1)
fn main(@builtin(global_invocation_id) id: vec3<u32>) {
  // FMA chains and cache reads: both the SM and the memory clocks see a load.
  let rows = arrayLength(&key_cache);
  var x = f32(id.x) * 1e-9;
  for (var i = 0u; i < params.iterations; i = i + 1u) {
    x = fma(x, 0.999999, 1e-7) + f32(key_cache[(id.x + i * 262147u) % rows].x) * 1e-30;
  }
  if (x == 12345.0) {  // never true; keeps the loop from being optimised away
    output[0] = vec4<f32>(x);
  }
}
"""


def warmer_program(cache_vec: str) -> Program:
    return Program(
        template="clock_warmer.wgsl.jinja",
        bindings=(Binding("key_cache", cache_vec), Binding("output", "vec4<f32>", writable=True)),
        uniforms=(("iterations", "u32"),),
        constants=(),
    )


WARMER = warmer_program("vec4<f32>")
_environment.loader = jinja2.ChoiceLoader([_environment.loader, jinja2.DictLoader({WARMER.template: WARMER_TEMPLATE})])


class RepeatedDispatches:
    """Within this context every call runs its dispatch list ``times`` times back to back
    in its one submission (each dispatch idempotent: the same inputs, the same outputs),
    after a warmer dispatch of about ``warm_seconds``.

    A single call keeps the GPU busy for a few milliseconds at most, between host work of
    tens of milliseconds: a GPU that lowers its clocks when idle (the H200 idles at 345 MHz
    against 1980 MHz under load) would be timed at whatever clock the last gap left it. After
    the warmer and back to back, the repetitions run at the clock a sustained load gets, and
    only the later half counts (:func:`settled_seconds`). The executor plans its dispatches
    through ``kernels.call_dispatches``, which this wraps: nothing else of the call changes.
    The node's launches are planned afresh on entry and exit (the executor reuses a node's
    launches while its shapes and buffers stay the same)."""

    def __init__(self, executor, node: str, times: int, warm_iterations: int = 0):
        self.executor, self.node = executor, node
        self.times = times
        self.warm_iterations = warm_iterations

    def _forget_launches(self):
        state = self.executor.node_state(self.node)
        if state is not None:
            state.step_plan = None

    def __enter__(self):
        self._forget_launches()
        self.original = kernels.call_dispatches
        original, times, warm = self.original, self.times, self.warm_iterations

        def call_dispatches(shape, tuning, cache, resources):
            once = original(shape, tuning, cache, resources)
            cache_vec = next(b.element for d in once for b in d.program.bindings if b.name == "key_cache")
            buffers = {"key_cache": resources["key_cache"], "output": resources["output"]}
            warmer = [Dispatch("warmer#0", warmer_program(cache_vec), buffers, {"iterations": warm}, (WARMER_GROUPS, 1, 1))] if warm else []
            return warmer + [dataclasses.replace(d, label=f"{d.label}#{i}") for i in range(times) for d in once]

        kernels.call_dispatches = call_dispatches
        return self

    def __exit__(self, *exc):
        kernels.call_dispatches = self.original
        self._forget_launches()


def settled_seconds(samples: list[dict]) -> dict:
    """Median GPU seconds per dispatch label over the later half of each call's repetitions."""
    times: dict[str, list[float]] = {}
    for sample in samples:
        repeats = 1 + max(int(label.rpartition("#")[2]) for label in sample)
        for label, seconds in sample.items():
            name, _, index = label.rpartition("#")
            if name != "warmer" and int(index) >= repeats // 2:
                times.setdefault(name, []).append(seconds)
    return {name: statistics.median(values) for name, values in times.items()}


def time_candidate(
    executor, call, case: Case, reps: int, repeats: int, warm_seconds: float, clock, whole_pass: bool = False
) -> tuple[dict, np.ndarray, float | None, float | None]:
    """Settled GPU seconds per dispatch over reps calls, the output of a plain call, the
    median SM clock (MHz, None without NVML) read as each timed call ended, and with
    ``whole_pass`` the median GPU seconds per call of the repetitions timed as one pass.

    A plain call first (it compiles and allocates, and its output is what gets checked);
    then the dispatch list repeats enough times for about SETTLE_SECONDS of GPU work per
    call (at least ``repeats``), after a warmer of ``warm_seconds`` (none on CPU adapters).
    The whole-pass timing runs the warmer as a call of its own (host work then separates it
    from the timed pass), then the repetitions as one timed pass: a timed pass costs about
    4 us even empty on the H200, which per-dispatch times count once per dispatch and the one
    pass spreads over the repetitions."""
    settings = SessionSettings(profile="dispatches")
    node = f"tune/{case.label}"
    result = executor.run(call, node, settings)
    output = result.output
    once = max(result.stats.gpu_total or 0.0, 1e-6)
    repeats = max(repeats, min(MAX_REPEATS, int(SETTLE_SECONDS / once) + 1))
    warm = 0
    if warm_seconds > 0:
        with RepeatedDispatches(executor, node, 1, WARM_CALIBRATION):  # how long the warmer's iterations take
            calibration = executor.run(call, node, settings).stats.gpu_seconds["warmer#0"]
        warm = max(1, min(2**31, int(WARM_CALIBRATION * warm_seconds / max(calibration, 1e-6))))
    samples, clocks = [], []
    with RepeatedDispatches(executor, node, repeats, warm):
        for _ in range(reps):
            samples.append(executor.run(call, node, settings).stats.gpu_seconds)
            clocks.append(clock.read())  # the SM clock as the call's repetitions end
    one_pass = None
    if whole_pass:
        whole = SessionSettings(profile="pass")
        passes = []
        for _ in range(reps):
            if warm:
                with RepeatedDispatches(executor, node, 0, warm):  # the warmer alone
                    executor.run(call, node, settings)
            with RepeatedDispatches(executor, node, repeats, 0):
                passes.append(executor.run(call, node, whole).stats.gpu_seconds["pass"] / repeats)
        one_pass = statistics.median(passes)
    return settled_seconds(samples), output, median_mhz(clocks), one_pass


def _rate(per_second: float, unit: str) -> str:
    scale, prefix = (1e12, "T") if per_second >= 1e12 else (1e9, "G")
    return f"{per_second / scale:.{2 if prefix == 'T' else 1}f} {prefix}{unit}"


def run_sweep(args) -> int:
    base_executor = get_executor()
    context = base_executor.context
    if "timestamp-query" not in context.features:
        print("this adapter has no timestamp queries: GPU times cannot be measured", file=sys.stderr)
        return 2
    base = base_executor.tuning
    print(
        f"# {' '.join(sys.argv)}\n# adapter {context.description}, workgroup memory {context.workgroup_storage_bytes} B, "
        f"binding {context.max_binding_bytes} B\n# base tuning: {base}\n"
    )
    cases = [Case("prefill", s, None, "f32") for s in args.prefill]
    cases += [Case("decode", 1, p, cache) for p in args.decode for cache in ("f32", "f16")]
    wanted = set(args.only or [])
    rng = np.random.default_rng(0)
    # A CPU adapter has no clocks to bring up, and the warmer would take minutes there.
    warm_seconds = 0.0 if args.quick or context.adapter_type == "CPU" else args.warm_seconds
    clock = sm_clock()
    whole = " one pass ms |" if args.whole_pass else ""
    print(f"| case | candidate | passes (GPU ms) | attention ms | total ms |{whole} rate | max err | SM MHz |")
    print("|---|---|---|---|---|---|---|---|" + ("---|" if args.whole_pass else ""))
    best: dict[str, tuple[float, str]] = {}
    started = time.perf_counter()
    for case in cases:
        config = case.config()
        inputs = make_inputs(case, config, rng)
        attrs = config.node_attributes()
        call = build_call(inputs, OpAttributes.from_mapping(attrs), float16_storage=case.cache == "f16")
        counts = visible_keys(inputs, attrs)
        h = config.head_size
        work = float(counts.sum()) * 4 * h if case.kind == "prefill" else float(counts.sum()) * 2 * h * (2 if case.cache == "f16" else 4)
        cpu = base.prefill_pass == "rows" or args.quick
        pool = (PREFILL_CANDIDATES + (ROWS_CANDIDATES if cpu else [])) if case.kind == "prefill" else DECODE_CANDIDATES
        candidates = [(n, f) for n, f in pool if not wanted or n in wanted or n == "default"]
        # Clocks drift between candidates (on the H200 the same configuration measured 10.6
        # and 12.5 ms at prefill 8192 in one sweep, the first of a case being slow): every
        # candidate is timed in each of `rounds` round-robin passes, and the least counts.
        rounds = args.rounds
        results: dict[str, tuple[dict, float, float | None, float | None]] = {}  # seconds, error, SM MHz, one pass: the kept round
        for _ in range(rounds):
            for name, fields in candidates:
                executor = WebGPUExecutor(context, dataclasses.replace(base, **fields))
                try:
                    seconds, output, mhz, one_pass = time_candidate(
                        executor, call, case, args.reps, args.repeats, warm_seconds, clock, args.whole_pass
                    )
                finally:
                    executor.release("")
                error = spot_check(inputs, output, attrs["sparse_block_size"], 8, rng)
                kept_seconds, kept_error, kept_mhz, kept_pass = results.get(name, (None, 0.0, None, None))
                if kept_seconds is None or sum(seconds.values()) < sum(kept_seconds.values()):
                    kept_seconds, kept_mhz, kept_pass = seconds, mhz, one_pass
                results[name] = (kept_seconds, max(error, kept_error), kept_mhz, kept_pass)  # the worst error of every round
        for name, (seconds, error, mhz, one_pass) in results.items():
            tolerance = 1e-2 if case.cache == "f16" else 2e-3
            attention = sum(v for k, v in seconds.items() if k != "kv_append")
            total = sum(seconds.values())
            rate = _rate(work / attention, "FLOP/s" if case.kind == "prefill" else "B/s")
            passes = ", ".join(f"{k} {v * 1e3:.3f}" for k, v in seconds.items())
            ok = error <= tolerance
            whole = f" {one_pass * 1e3:.3f} |" if args.whole_pass else ""
            print(
                f"| {case.label} | {name} | {passes} | {attention * 1e3:.3f} | {total * 1e3:.3f} |{whole} {rate} | "
                f"{error:.1e}{'' if ok else ' FAIL'} | {'-' if mhz is None else f'{mhz:.0f}'} |",
                flush=True,
            )
            if ok and (case.label not in best or total < best[case.label][0]):
                best[case.label] = (total, name)
    print(f"\nSweep took {time.perf_counter() - started:.0f} s.\n\nBest per case (whole call, GPU ms):")
    for label, (seconds, name) in best.items():
        fields = dict(PREFILL_CANDIDATES + ROWS_CANDIDATES + DECODE_CANDIDATES)[name]
        print(f"- {label}: {name} {fields or ''} {seconds * 1e3:.3f} ms")
    return 0


def lavapipe_check(args) -> int:
    """Sparse prefill of 2048 tokens with ~20% of the causal pairs against numpy dense causal."""
    executor = get_executor()
    seq_len = args.check_len
    case = Case("prefill", seq_len, None, "f32")
    # 2 local blocks plus every 8th column: about a fifth of the causal pairs at 2048 tokens.
    config = case.config(local_blocks=args.check_local_blocks, vert_stride=8)
    rng = np.random.default_rng(1)
    inputs = make_inputs(case, config, rng)
    attrs = config.node_attributes()
    counts = visible_keys(inputs, attrs)
    causal = config.num_heads * seq_len * (seq_len + 1) / 2
    call = build_call(inputs, OpAttributes.from_mapping(attrs))
    settings = SessionSettings(profile="dispatches")
    timings = []  # (candidate, wall, gpu, error)
    for name, fields in [c for c in PREFILL_CANDIDATES + ROWS_CANDIDATES if c[0] == "default" or c[0] in (args.only or [])]:
        candidate = WebGPUExecutor(executor.context, dataclasses.replace(executor.tuning, **fields))
        candidate.run(call, "check", settings)
        walls, gpus = [], []
        for _ in range(args.reps):
            start = time.perf_counter()
            result = candidate.run(call, "check", settings)
            walls.append(time.perf_counter() - start)
            gpus.append(result.stats.gpu_total)
        candidate.release("")
        timings.append(
            (name, statistics.median(walls), statistics.median(gpus), spot_check(inputs, result.output, attrs["sparse_block_size"], 8, rng))
        )

    # numpy: dense causal attention of the same shape (rotated q and k, every causal pair).
    h, nh, nkv = config.head_size, config.num_heads, config.kv_num_heads
    positions = np.arange(seq_len)
    q = apply_rotary(inputs["query"][0].reshape(seq_len, nh, h).transpose(1, 0, 2), positions, inputs["cos_cache"], inputs["sin_cache"], False)
    k = apply_rotary(inputs["key"][0].reshape(seq_len, nkv, h).transpose(1, 0, 2), positions, inputs["cos_cache"], inputs["sin_cache"], False)
    q, k = q.astype(np.float32), k.astype(np.float32)
    v = inputs["value"][0].reshape(seq_len, nkv, h).transpose(1, 0, 2)
    future = np.triu(np.ones((seq_len, seq_len), bool), 1)

    def dense():
        out = np.empty((nh, seq_len, h), np.float32)
        for head in range(nh):
            kv = head // (nh // nkv)
            scores = (q[head] @ k[kv].T) * np.float32(1 / np.sqrt(h))
            scores[future] = -np.inf
            scores -= scores.max(axis=1, keepdims=True)
            np.exp(scores, out=scores)
            scores /= scores.sum(axis=1, keepdims=True)
            out[head] = scores @ v[kv]
        return out

    dense()
    dense_times = []
    for _ in range(args.reps):
        start = time.perf_counter()
        dense()
        dense_times.append(time.perf_counter() - start)
    numpy_s = statistics.median(dense_times)
    flops = float(counts.sum()) * 4 * h
    print(f"# {' '.join(sys.argv)}\n# adapter {executor.context.description}, {os.cpu_count()} CPUs")
    print(
        f"prefill {seq_len}, {nh}/{nkv} heads, head {h}, block {config.sparse_block_size}, {config.local_blocks} local blocks, "
        f"vertical stride 8: {counts.sum() / causal:.1%} of the causal pairs selected ({flops / 1e9:.2f} GFLOP)"
    )
    print("| what | call ms (wall) | GPU ms (all passes) | GPU / numpy | GFLOP/s | max err |")
    print("|---|---|---|---|---|---|")
    print(f"| numpy dense causal (float32, OpenBLAS) | {numpy_s * 1e3:.1f} | - | 1.00x | - | - |")
    for name, wall, gpu, error in timings:
        print(f"| WebGPU, {name} | {wall * 1e3:.1f} | {gpu * 1e3:.1f} | {gpu / numpy_s:.2f}x | {flops / gpu / 1e9:.1f} | {error:.1e} |")
    return 0 if all(error <= 2e-3 for *_, error in timings) else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small shapes for lavapipe: prefill 256/512, decode at 1023")
    parser.add_argument("--prefill", type=int, nargs="*", default=None, help="prompt lengths (default 1024 4096 8192)")
    parser.add_argument("--decode", type=int, nargs="*", default=None, help="histories of a decode step (default 8191)")
    parser.add_argument("--reps", type=positive, default=None, help="timed calls per candidate and round (default 3)")
    parser.add_argument("--repeats", type=positive, default=None, help="dispatch list repetitions per call (default 10, --quick 2)")
    parser.add_argument(
        "--rounds", type=positive, default=None, help="round-robin passes over each case's candidates, the least time counts (default 2, --quick 1)"
    )
    parser.add_argument("--only", nargs="*", help="candidate names to run besides 'default'")
    parser.add_argument(
        "--warm-seconds",
        type=float,
        default=WARM_SECONDS,
        help="GPU seconds of the warmer before each timed call (default %(default)s; see WARM_SECONDS; none with --quick or on CPU adapters)",
    )
    parser.add_argument(
        "--whole-pass", action="store_true", help="also time the call's dispatches repeated in one pass ('one pass ms'; see time_candidate)"
    )
    parser.add_argument("--lavapipe-check", action="store_true", help="sparse prefill vs numpy dense causal attention")
    parser.add_argument("--check-len", type=int, default=2048)
    parser.add_argument("--check-local-blocks", type=int, default=2, help="2: about 20%% of the causal pairs at 2048")
    args = parser.parse_args()
    known = {name for name, _ in PREFILL_CANDIDATES + ROWS_CANDIDATES + DECODE_CANDIDATES}
    unknown = sorted(set(args.only or ()) - known)
    if unknown:
        parser.error(f"--only {unknown[0]!r}: no candidate has that name (candidates: {', '.join(sorted(known))})")
    if args.reps is None:
        args.reps = 3
    if args.rounds is None:
        args.rounds = 1 if args.quick else 2
    if args.repeats is None:
        args.repeats = 2 if args.quick else 10
    if args.lavapipe_check:
        return lavapipe_check(args)
    if args.prefill is None:
        args.prefill = [256, 512] if args.quick else [1024, 4096, 8192]
    if args.decode is None:
        args.decode = [1023] if args.quick else [8191]
    return run_sweep(args)


if __name__ == "__main__":
    sys.exit(main())
