#!/usr/bin/env python3
"""Where a whole model's time goes: one configuration's prompt and decode steps, split by node
kind (op type and EP) from ONNX Runtime's own profiler.

    python scripts/profile_generate.py --model /tmp/phi3-small-32 --configs d c --prompt 4096 --steps 16

For each configuration (a-d, as in scripts/bench_generate.py) the script compiles the kernels
(a short generation, then one of the prompt's length), then profiles one generation of
``--prompt`` tokens and ``--steps`` decode steps. It prints, for the prompt and for the median
decode step: the wall time of ``session.run``, each node kind's time and count, and the time
outside every node. ORT's WebGPU EP queues its kernels: their times are the host's time to
record them, and the GPU's time surfaces where the host waits for it, in the copies to the
host (``MemcpyToHost``) before each host-side node. This package's op (``SparseAttention``
on the CPU EP) counts its whole call, its own GPU wait included; for b and d the script also
prints the op's own phases (``CallStats.phases``: the bridge's inputs and outputs, the
executor's prepare, submit, wait and record), the mean over the nodes of one prompt and of the
last decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnxruntime as ort

from sparse_attention_op.benchmarking.whole_model import CONFIGS, Runner, RunProfile, median_profile, read_profile

SHOWN = 12  # node kinds listed per phase; the rest are summed into one line


def table(title: str, run: RunProfile) -> list[str]:
    lines = [f"{title}: {run.seconds * 1e3:.2f} ms", "", "| node kind | EP | nodes | ms | share |", "|---|---|---|---|---|"]
    ranked = sorted(run.kinds.items(), key=lambda item: -item[1][0])
    for (op, ep), (seconds, count) in ranked[:SHOWN]:
        lines.append(f"| {op} | {ep} | {count} | {seconds * 1e3:.2f} | {seconds / run.seconds:.0%} |")
    rest = ranked[SHOWN:]
    if rest:
        seconds = sum(s for _, (s, _) in rest)
        lines.append(f"| {len(rest)} other kinds | | {sum(c for _, (_, c) in rest)} | {seconds * 1e3:.2f} | {seconds / run.seconds:.0%} |")
    lines.append(f"| outside nodes | | | {run.between * 1e3:.2f} | {run.between / run.seconds:.0%} |")
    return lines


def profile(config: str, model: Path, prompt: list[int], steps: int, ep_options: dict, folder: Path) -> dict:
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(folder / f"profile-{config}")
    runner = Runner(config, model, ep_options, options)
    runner.generate(list(range(2, 66)), 4)  # compiles the kernels
    runner.generate(prompt, 2)  # and those for this prompt's length
    _, prompt_seconds, step_seconds = runner.generate(prompt, steps + 1)
    decode_phases = op_phases(runner.session)
    runner.generate(prompt, 1)  # the prompt alone, for its op phases
    prompt_phases = op_phases(runner.session)
    runs = read_profile(runner.session.end_profiling())[-(steps + 2) : -1]
    prompt_run, decode = runs[0], median_profile(runs[1:])
    return {
        "config": config,
        "prompt_tokens": len(prompt),
        "prompt_seconds": prompt_seconds,
        "decode_step_seconds": float(np.median(step_seconds)),
        "prompt": prompt_run,
        "decode": decode,
        "op_phases": {"prompt": prompt_phases, "decode": decode_phases},
    }


def op_phases(session) -> dict:
    """The mean over the SparseAttention nodes of each phase of their calls in the session's
    last run (seconds); empty for sessions that keep no stats (a and c)."""
    stats = session.last_stats() if hasattr(session, "last_stats") else {}
    if not stats:
        return {}
    totals: dict[str, float] = {}
    for call in stats.values():
        for phase, seconds in call.phases.items():
            totals[phase] = totals.get(phase, 0.0) + seconds
    return {phase: seconds / len(stats) for phase, seconds in totals.items()}


def phase_table(phases: dict) -> list[str]:
    ms = {phase: seconds * 1e3 for phase, seconds in phases.items()}
    return [
        "| op phase, mean per node | ms |",
        "|---|---|",
        *(f"| {phase} | {value:.3f} |" for phase, value in ms.items()),
        f"| sum | {sum(ms.values()):.3f} |",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a GenAI model folder (scripts/build_models.py writes real-width ones)")
    parser.add_argument("--configs", nargs="+", choices=sorted(set(CONFIGS) - {"e"}), default=["d"], help="which configurations (default d)")
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens (default %(default)s)")
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled (default %(default)s)")
    parser.add_argument("--ep-option", action="append", default=[], metavar="KEY=VALUE", help="a WebGPU EP provider option (repeatable)")
    parser.add_argument("--json", type=Path, default=None, help="write every kind's times here")
    parser.add_argument("--traces", type=Path, default=None, help="keep ORT's raw profiles (chrome://tracing JSON) in this folder")
    args = parser.parse_args()
    if args.prompt < 1 or args.steps < 1:
        parser.error("--prompt and --steps must be positive")
    ep_options = dict(option.split("=", 1) for option in args.ep_option)
    vocab = json.loads((args.model / "genai_config.json").read_text())["model"]["vocab_size"]
    prompt = np.random.default_rng(args.prompt).integers(2, vocab, args.prompt).tolist()
    print(f"Command: `python {' '.join(sys.argv)}`\nMachine: {platform.node()} ({os.cpu_count()} CPUs), onnxruntime {ort.__version__}\n")
    document = []
    if args.traces:
        args.traces.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="profile-") as scratch:
        folder = args.traces or Path(scratch)
        for config in args.configs:
            found = profile(config, args.model, prompt, args.steps, ep_options, folder)
            print(f"## ({config}) {CONFIGS[config]}, prompt {args.prompt}\n")
            print("\n".join(table(f"Prompt of {args.prompt} tokens (generate's wall: {found['prompt_seconds'] * 1e3:.1f} ms)", found["prompt"])))
            print()
            step = f"Median decode step at {args.prompt} (generate's wall: {found['decode_step_seconds'] * 1e3:.2f} ms)"
            print("\n".join(table(step, found["decode"])) + "\n", flush=True)
            for phase, phases in found["op_phases"].items():
                if phases:
                    print(f"The op's phases, {phase}:\n\n" + "\n".join(phase_table(phases)) + "\n", flush=True)
            for phase in ("prompt", "decode"):
                run = found[phase]
                found[phase] = {"seconds": run.seconds, "outside_nodes": run.between, "kinds": [[*kind, *value] for kind, value in run.kinds.items()]}
            document.append(found)
            if args.json:
                args.json.write_text(json.dumps({"command": " ".join(sys.argv), "profiles": document}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
