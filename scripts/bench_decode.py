#!/usr/bin/env python3
"""Decode steps through real ONNX Runtime sessions, against ORT's own CPU kernel and the copy floor.

    python scripts/bench_decode.py                      # the acceptance cases (H200: ~3 minutes)
    python scripts/bench_decode.py --quick              # small capacities (lavapipe)
    python scripts/bench_decode.py --soak 10000         # plus a soak: memory must stay flat
    python scripts/bench_decode.py --rounds 3           # every case three times, interleaved

One SparseAttention node at the Phi-3-small shape (32 heads over 8 kv heads, head size 128,
64-token blocks, 16 local blocks, vertical stride 8, 32 layouts, rotary), batch 1, float32.
Each case is (kv_check, way, capacity, history):

* ``shared``: past and present bound to one buffer through IO binding, as ORT GenAI runs it;
  the presents are written in place. ``plain``: numpy feeds, each present fed back.
* the history is unit-scale random rows; the first steps (warm-up, not timed) bring it to
  the GPU, later steps find it resident.

Per case, medians over --steps steps: the whole ``run``; inside the op, its host time (the
op's wall time minus its wait for the GPU; its phases are printed after the table); the GPU time of its dispatches (timestamps,
from a second session over the same past, medians over at most 10 steps: timestamps add a
pass per dispatch and host work, so the timed steps run without them, as a user's do);
ORT's CPU kernel on the same shapes and history with shared buffers (``--no-ort`` skips
it); the Identity floor (ORT passing the two cache tensors through Identity, plain run).
With ``--rounds N`` the cases run N times in turn (GPU times in the first round only) and a
last table gives per case the median over the rounds, each ratio taken within its round:
the host's speed drifts between processes and over minutes (BENCHMARKS.md), and a ratio to
ORT measured in the same round moves with it. A prefill case reports ``run`` minus the GPU
time. The node's host record is reported against the cache's bytes. Where NVML is found (NVIDIA GPUs), the GPU's SM clock is read
after each timed step and each timestamped one (medians: "SM MHz (run / GPU)"): GPU times
in a decode loop are taken at whatever clock the loop leaves the GPU in
(sparse_attention_op/benchmarking/clocks.py). After each timed step, outside its timing, a
fixed piece of host work is timed too ("host probe us", medians): the host's own speed
changes from second to second, and a row whose probe took longer ran on a slower host
(sparse_attention_op/benchmarking/host_speed.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import onnxruntime as ort

import sparse_attention_op as sao
from sparse_attention_op.benchmarking.clocks import SmClock, median_mhz, sm_clock
from sparse_attention_op.benchmarking.common import PHI3_SMALL, identity_floor_session, median_seconds
from sparse_attention_op.benchmarking.host_speed import HostProbe, median_us
from sparse_attention_op.cli.arguments import positive
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs
from sparse_attention_op.webgpu import get_executor

CONSTANTS = ("block_row_indices", "block_col_indices", "cos_cache", "sin_cache")
#: (kv_check, way, capacity, history): the acceptance table of "Generation at GPU speed".
ACCEPTANCE = [
    ("fast", "shared", 8192, 8152),
    ("fast", "shared", 131072, 131000),
    ("fast", "shared", 131072, 100),
    ("exact", "shared", 131072, 1000),
    ("exact", "shared", 8192, 8152),
    ("fast", "plain", 8192, 8152),
    ("exact", "plain", 8192, 8152),
]
QUICK = [
    ("fast", "shared", 1024, 960),
    ("fast", "shared", 4096, 100),
    ("exact", "shared", 4096, 1000),
    ("fast", "plain", 1024, 960),
    ("exact", "plain", 1024, 960),
]


@dataclass
class Row:
    kv_check: str
    way: str
    capacity: int
    history: int
    run_ms: float
    op_host_ms: float
    gpu_ms: float | None
    ort_cpu_ms: float | None
    identity_ms: float | None
    record_fraction: float
    sm_mhz_run: float | None = None  # the GPU's SM clock after the timed steps (median; NVML)
    sm_mhz_gpu: float | None = None  # and after the timestamped session's steps
    phases_us: dict | None = None  # the op's phases (CallStats.phases), medians in microseconds
    replayed_steps: int = 0  # timed steps that replayed the node's step plan (CallStats.replayed; webgpu/step_plan.py)
    host_probe_us: float | None = None  # the host probe after each timed step (median; benchmarking/host_speed.py)

    def cells(self) -> list[str]:
        def ms(value):
            return "-" if value is None else f"{value:.3f}"

        vs_ort = "-" if self.ort_cpu_ms is None else f"{self.run_ms / self.ort_cpu_ms:.2f}x"
        vs_identity = "-" if self.identity_ms is None else f"{self.run_ms / self.identity_ms:.2f}x"
        return [
            self.kv_check,
            self.way,
            str(self.capacity),
            str(self.history),
            ms(self.run_ms),
            ms(self.op_host_ms),
            ms(self.gpu_ms),
            ms(self.ort_cpu_ms),
            ms(self.identity_ms),
            vs_ort,
            vs_identity,
            f"{100 * self.record_fraction:.2f}%",
            f"{_mhz(self.sm_mhz_run)} / {_mhz(self.sm_mhz_gpu)}",
            _us(self.host_probe_us),
        ]


def _mhz(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _us(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


HEADER = [
    "kv_check",
    "way",
    "capacity",
    "history",
    "run ms",
    "op host ms",
    "GPU ms",
    "ORT CPU ms",
    "Identity ms",
    "run / ORT CPU",
    "run / Identity",
    "record / cache",
    "SM MHz (run / GPU)",
    "host probe us",
]


#: Untimed steps before a case's timed ones.
WARMUP_STEPS = 3


class Decoder:
    """One session decoding at a given capacity: the cache tensors, and one step at a time."""

    def __init__(self, session, capacity: int, history: int, way: str, rng, past=None):
        self.session, self.way, self.rng = session, way, rng
        self.config = CaseConfig(seq_len=1, max_cache_len=capacity, past_lengths=(history,), **PHI3_SMALL)
        shape = (1, self.config.kv_num_heads, capacity, self.config.head_size)
        self.past = list(past) if past is not None else [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]
        self.values = {n: ort.OrtValue.ortvalue_from_numpy(p) for n, p in zip(("past_key", "past_value"), self.past)} if way == "shared" else None
        self.history = history
        self.names = [i.name for i in session.get_inputs()]
        self.template = random_inputs(self.config, rng, past=self.past)

    def feeds(self) -> dict:
        """The next step's inputs: fresh query/key/value rows, lengths one past the history."""
        total = np.array([self.history + 1], np.int32)
        fresh = {name: self.rng.standard_normal(self.template[name].shape, dtype=np.float32) for name in ("query", "key", "value")}
        return {
            **self.template,
            **fresh,
            "past_key": self.past[0],
            "past_value": self.past[1],
            "total_sequence_length": total,
            "key_total_sequence_lengths": total.copy(),
        }

    def step(self) -> float:
        if self.history >= self.config.max_cache_len:
            raise RuntimeError(f"the history has reached the capacity ({self.config.max_cache_len} rows): start a new sequence")
        feeds = self.feeds()
        if self.way == "shared":
            binding = sao.bind_shared(self.session, feeds, self.values)
            start = time.perf_counter()
            self.session.run_with_iobinding(binding)
            seconds = time.perf_counter() - start
        else:
            start = time.perf_counter()
            _, present_key, present_value = self.session.run(None, {n: feeds[n] for n in self.names})
            seconds = time.perf_counter() - start
            self.past = [present_key, present_value]
        self.history += 1
        return seconds


def model_for(capacity: int, rng):
    config = CaseConfig(seq_len=1, max_cache_len=capacity, past_lengths=(1,), **PHI3_SMALL)
    return sparse_attention_model(config.node_attributes(), random_inputs(config, rng), constants=CONSTANTS)


def node_stats(session):
    return next(iter(session.last_stats().values()))


def ort_cpu_decode(model, capacity: int, history: int, steps: int, rng) -> float:
    """ORT's own kernel, past and present bound to one buffer (how ORT GenAI runs it)."""
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    decoder = Decoder(session, capacity, history, "shared", rng)
    decoder.step()
    times = [decoder.step() for _ in range(steps)]
    return statistics.median(times)


def gpu_seconds(model, kv_check: str, capacity: int, history: int, way: str, steps: int, rng, past, clock: SmClock) -> tuple[list[float], list]:
    """GPU time per decode step, from a session of its own with timestamps on (they add a
    pass per dispatch and host work, so the timed steps of run_case run without them), and
    the SM clock read after each step."""
    session = sao.create_session(model, kv_check=kv_check, profile=True)
    decoder = Decoder(session, capacity, history, way, rng, past=past)
    for _ in range(WARMUP_STEPS):
        decoder.step()
    times, clocks = [], []
    for _ in range(steps):
        decoder.step()
        clocks.append(clock.read())
        total = node_stats(session).gpu_total
        if total is not None:
            times.append(total)
    return times, clocks


def run_case(kv_check: str, way: str, capacity: int, history: int, args, rng, clock: SmClock, probe: HostProbe, profile: bool = True) -> Row:
    """One case's row; its GPU times too unless ``profile`` (or ``--no-profile``) says not."""
    model = model_for(capacity, rng)
    session = sao.create_session(model, kv_check=kv_check)
    decoder = Decoder(session, capacity, history, way, rng)
    for _ in range(WARMUP_STEPS):  # the first step brings the history to the GPU
        decoder.step()
    runs, hosts, clocks, phases, probes, replayed = [], [], [], [], [], 0
    for _ in range(args.steps):
        runs.append(decoder.step())
        clocks.append(clock.read())  # after the step's run: outside its timing
        probes.append(probe.seconds())  # likewise
        stats = node_stats(session)
        phases.append(stats.phases)
        replayed += stats.replayed
        # The op's host time: the bridge's reading and writing of tensors, the executor's call, less its wait.
        hosts.append(stats.seconds + stats.phases["inputs"] + stats.phases["outputs"] - stats.phases["wait_read"])
    executor = get_executor()
    key = next(k for k in executor.node_keys() if k.startswith(session.sparse_attention_token))
    record_bytes = executor.node_state(key).cache.record.nbytes
    cache_bytes = 2 * decoder.past[0].nbytes
    decoder.session = session = None  # one resident cache at a time (the timestamped session's next)
    gpus, gpu_clocks = (
        gpu_seconds(model, kv_check, capacity, history, way, min(args.steps, 10), rng, decoder.past, clock) if profile and args.profile else ([], [])
    )
    ort_ms = ort_cpu_decode(model, capacity, history, args.steps, rng) * 1e3 if args.ort else None
    identity_ms = None
    if way == "plain":
        floor = identity_floor_session(decoder.past[0].shape)
        pasts = {"past_key": decoder.past[0], "past_value": decoder.past[1]}
        identity_ms = median_seconds(lambda: floor.run(None, pasts), args.steps) * 1e3
    del decoder
    return Row(
        kv_check,
        way,
        capacity,
        history,
        statistics.median(runs) * 1e3,
        statistics.median(hosts) * 1e3,
        statistics.median(gpus) * 1e3 if gpus else None,
        ort_ms,
        identity_ms,
        record_bytes / cache_bytes,
        median_mhz(clocks),
        median_mhz(gpu_clocks),
        {name: round(statistics.median(p[name] for p in phases) * 1e6) for name in phases[0]},
        replayed,
        median_us(probes),
    )


def prefill_case(kv_check: str, length: int, args, rng, clock: SmClock) -> dict:
    """A prompt of ``length`` tokens with shared buffers: run minus GPU time (host overhead).
    The runs are timed without timestamps; a session of its own, with them, gives the GPU time.
    Its runs give the difference within each run too ("same run"): the GPU's clock (the
    host's transfers too) can sit at another state in the two sessions, and a lone prompt
    often runs at the idle 345 MHz (H100 host, 2026-12-05: runs at 345 MHz against GPU times
    at 600 MHz made 46.8 ms of 'host' time where prompts whose clocks agreed made 25-26)."""
    config = CaseConfig(seq_len=length, max_cache_len=length, **PHI3_SMALL)
    inputs = random_inputs(config, rng)
    model = sparse_attention_model(config.node_attributes(), inputs, constants=CONSTANTS)
    values = {n: ort.OrtValue.ortvalue_from_numpy(inputs[n]) for n in ("past_key", "past_value")}
    runs, gpus, same_run, phases, clocks = [], [], [], [], {False: [], True: []}
    for profile in (False, True):
        session = sao.create_session(model, kv_check=kv_check, profile=profile)
        for _ in range(max(3, args.steps // 5)):
            binding = sao.bind_shared(session, inputs, values)
            start = time.perf_counter()
            session.run_with_iobinding(binding)
            seconds = time.perf_counter() - start
            clocks[profile].append(clock.read())
            stats = node_stats(session)
            if profile:
                gpus.append(stats.gpu_total or 0.0)
                same_run.append(seconds - gpus[-1])
            else:
                runs.append(seconds)
                phases.append(stats.phases)
        del session
    run, gpu = statistics.median(runs[1:]), statistics.median(gpus[1:])
    phase = {k: round(statistics.median(p[k] for p in phases[1:]) * 1e3, 2) for k in phases[0]}
    return dict(
        kv_check=kv_check,
        prompt=length,
        run_ms=run * 1e3,
        gpu_ms=gpu * 1e3,
        run_minus_gpu_ms=(run - gpu) * 1e3,
        run_minus_gpu_same_run_ms=statistics.median(same_run[1:]) * 1e3,
        op_phases_ms=phase,
        sm_mhz_run=median_mhz(clocks[False][1:]),
        sm_mhz_gpu=median_mhz(clocks[True][1:]),
    )


def print_round_medians(rounds: list[list[Row]]) -> None:
    """Per case, the median over the rounds of each time and of each ratio (a round's ratio
    compares figures of that round), with the least and most ``run`` over the rounds."""

    def ms(values):
        present = [v for v in values if v is not None]
        return f"{statistics.median(present):.3f}" if present else "-"

    def ratio(rows, anchor):
        present = [row.run_ms / getattr(row, anchor) for row in rows if getattr(row, anchor) is not None]
        return f"{statistics.median(present):.2f}x" if present else "-"

    print(f"\nmedians over {len(rounds)} rounds\n")
    header = [
        "kv_check",
        "way",
        "capacity",
        "history",
        "run ms",
        "run ms (least - most)",
        "op host ms",
        "GPU ms",
        "ORT CPU ms",
        "Identity ms",
        "run / ORT CPU",
        "run / Identity",
        "host probe us (least - most)",
    ]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for rows in zip(*rounds):
        first = rows[0]
        runs = [row.run_ms for row in rows]
        print(
            "| "
            + " | ".join(
                [
                    first.kv_check,
                    first.way,
                    str(first.capacity),
                    str(first.history),
                    ms(runs),
                    f"{min(runs):.3f} - {max(runs):.3f}",
                    ms(row.op_host_ms for row in rows),
                    ms(row.gpu_ms for row in rows),
                    ms(row.ort_cpu_ms for row in rows),
                    ms(row.identity_ms for row in rows),
                    ratio(rows, "ort_cpu_ms"),
                    ratio(rows, "identity_ms"),
                    _probe_span(rows),
                ]
            )
            + " |",
            flush=True,
        )


def _probe_span(rows: list[Row]) -> str:
    probes = [row.host_probe_us for row in rows if row.host_probe_us is not None]
    return f"{min(probes):.0f} - {max(probes):.0f}" if probes else "-"


def rss_bytes() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def soak(calls: int, capacity: int, rng) -> str:
    session = sao.create_session(model_for(capacity, rng), kv_check="fast")
    decoder = Decoder(session, capacity, 64, "shared", rng)
    executor = get_executor()
    marks = []
    start = time.perf_counter()
    for call in range(calls):
        if decoder.history >= capacity - 2:
            decoder.history = 64  # a new sequence over the same buffers
        decoder.step()
        if call in (100, calls - 1):
            marks.append((rss_bytes(), executor.gpu_bytes()))
    (rss0, gpu0), (rss1, gpu1) = marks[0], marks[-1]
    return (
        f"soak: {calls} decode calls at capacity {capacity}: rss {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB, "
        f"GPU buffers {gpu0 / 2**20:.1f} -> {gpu1 / 2**20:.1f} MiB, {time.perf_counter() - start:.0f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small capacities (lavapipe's 128 MiB binding limit)")
    parser.add_argument("--steps", type=positive, default=30, help="timed decode steps per case (medians)")
    parser.add_argument("--no-ort", dest="ort", action="store_false", help="skip ORT's CPU kernel")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the GPU times (the timestamped second session of each case)")
    parser.add_argument(
        "--prefill", type=int, nargs="*", default=None, help="prompt lengths for the prefill overhead case (default 8192; --quick 1024)"
    )
    parser.add_argument("--only", type=str, default=None, help="run only cases whose 'kv_check/way/capacity/history' contains this text")
    parser.add_argument("--soak", type=int, default=0, help="decode calls of the soak (0: none)")
    parser.add_argument("--rounds", type=positive, default=1, help="run every case this many times in turn, then print medians over the rounds")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()
    cases = [case for case in (QUICK if args.quick else ACCEPTANCE) if not args.only or args.only in "/".join(map(str, case))]
    if args.only and not cases:
        parser.error(
            f"--only {args.only!r} matches no case (cases: "
            + ", ".join("/".join(map(str, case)) for case in (QUICK if args.quick else ACCEPTANCE))
            + ")"
        )
    for _, _, capacity, history in cases:
        # Warm-up and timed steps each add a row, and a step needs a free row: a history
        # that reached the capacity would end the case in an error.
        if history + WARMUP_STEPS + args.steps > capacity:
            parser.error(
                f"--steps {args.steps}: history {history} would reach capacity {capacity} "
                f"(at most {capacity - history - WARMUP_STEPS} steps for this case)"
            )

    executor = get_executor()
    clock = sm_clock()
    probe = HostProbe()
    rng = np.random.default_rng(0)
    machine = f"{platform.node()} ({os.cpu_count()} CPUs), adapter {executor.context.description}, onnxruntime {ort.__version__}"
    if not clock.available:
        machine += " (no NVML: SM clocks not read)"
    print(f"# {' '.join(sys.argv)}\n# {machine}\n")
    rounds = []
    for round_index in range(args.rounds):
        if args.rounds > 1:
            print(f"\nround {round_index + 1} of {args.rounds}\n")
        print("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER), flush=True)
        measured = []
        for case in cases:
            # The GPU's times do not drift with the host's: the first round's serve.
            row = run_case(*case, args, rng, clock, probe, profile=round_index == 0)
            measured.append(row)
            print("| " + " | ".join(row.cells()) + " |", flush=True)
        rounds.append(measured)
        print(
            "\nthe op's phases per step (us, medians): "
            + "; ".join(
                f"{row.kv_check}/{row.way}/{row.capacity}/{row.history} ({row.replayed_steps} of {args.steps} steps replayed): "
                + ", ".join(f"{k} {v}" for k, v in row.phases_us.items())
                for row in measured
            )
        )
    if args.rounds > 1:
        print_round_medians(rounds)
    prefills = []
    for length in args.prefill if args.prefill is not None else ([1024] if args.quick else [8192]):
        prefills.append(prefill_case("fast", length, args, rng, clock))
        p = prefills[-1]
        print(
            f"\nprefill {p['prompt']}, shared buffers: run {p['run_ms']:.1f} ms, GPU {p['gpu_ms']:.1f} ms, "
            f"run minus GPU {p['run_minus_gpu_ms']:.1f} ms (in the timestamped runs themselves: {p['run_minus_gpu_same_run_ms']:.1f} ms); "
            f"op phases (ms): {p['op_phases_ms']}; "
            f"SM MHz (run / GPU): {_mhz(p['sm_mhz_run'])} / {_mhz(p['sm_mhz_gpu'])}",
            flush=True,
        )
    if args.soak:
        print("\n" + soak(args.soak, 1024 if args.quick else 8192, rng), flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            decode = [dict(asdict(row), round=index + 1) for index, measured in enumerate(rounds) for row in measured]
            json.dump({"command": " ".join(sys.argv), "machine": machine, "decode": decode, "prefill": prefills}, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
