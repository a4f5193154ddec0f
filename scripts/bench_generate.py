#!/usr/bin/env python3
"""Whole-model generation, end to end: what a user gets from each way of running a decoder.

    python scripts/bench_generate.py --model models/phi3-small-tiny --configs a b --prompts 64 256 --json out.json
    python scripts/bench_generate.py --model /tmp/phi3-small-32 --configs d e c --prompts 1024 4096 8192 --new-tokens 64

Configurations (each one session, loaded once; every prompt length runs through it):

  a  ONNX Runtime on its CPU EP alone (ORT's own SparseAttention kernel)
  b  this package (SparseAttention on WebGPU through wgpu) with ORT's CPU EP for the rest
  c  ORT's WebGPU plugin EP alone: what a user gets today (ORT places SparseAttention, which
     the EP lacks, on its CPU EP)
  d  this package with ORT's WebGPU plugin EP for the rest
  e  d through ORT GenAI (a folder prepared by prepare_genai_folder with sparse_caches="op",
     loaded with ep="webgpu")

Every case feeds one prompt of random ids (fixed seed per length), then greedy-decodes
``--new-tokens`` tokens with no stop token. Columns: the prompt's wall time and tokens/s
(the first new token included), the decode rate (new tokens after the first over the decode
steps' wall time), and the tokens against the first configuration that ran the same prompt
(identical, a float16 near-tie, or DIFFERENT: judged by sparse_attention_op.generation's
``divergences``). A warm-up generation of 64 prompt tokens compiles every kernel first;
``--warm-lengths`` also runs each prompt length once untimed before timing it, so that its
prompt time leaves out compiling the kernels for that length.

A failing configuration is a row that says how it failed; the others go on. ``--json`` is
rewritten after every row, so a run cut short keeps what it measured. ``--plot`` draws the
decode and prompt rates against the prompt length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import traceback
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from sparse_attention_op.benchmarking.whole_model import CONFIGS, Runner
from sparse_attention_op.generation.loop import cache_dims_of, divergences
from sparse_attention_op.generation.model_files import resolve


def compare(reference: dict, row: dict, prompt: list[int], judge, dims) -> str:
    """How ``row``'s tokens stand against ``reference``'s (judged by the ``judge`` session)."""
    if row["tokens"] == reference["tokens"]:
        return f"identical to {reference['config']}"
    if judge is None:  # a GenAI row against a reference from an earlier run: nothing to judge with
        step = next(i for i, (a, b) in enumerate(zip(row["tokens"], reference["tokens"])) if a != b)
        return f"differs from {reference['config']} at token {step} (not judged)"
    found = divergences(judge, [prompt], [row["tokens"]], [reference["tokens"]], dims)
    if found and all(d.near_tie for d in found):
        return f"near-tie with {reference['config']} at token {found[0].step}"
    return f"DIFFERENT from {reference['config']}: " + "; ".join(d.describe() for d in found)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, required=True, help="a GenAI model folder (scripts/build_models.py writes real-width ones)")
    parser.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=sorted(CONFIGS), help="which configurations, in this order")
    parser.add_argument("--prompts", type=int, nargs="+", default=[1024, 4096, 8192], help="prompt lengths (default %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=64, help="new tokens per prompt (default %(default)s)")
    parser.add_argument(
        "--cpu-max-prompt", type=int, default=1024, help="longest prompt a and b run (the CPU's prompts take minutes; default %(default)s)"
    )
    parser.add_argument("--ep-option", action="append", default=[], metavar="KEY=VALUE", help="a WebGPU EP provider option (repeatable)")
    parser.add_argument("--warm-lengths", action="store_true", help="run each prompt length once untimed first (no kernel compiles in its time)")
    parser.add_argument("--label", default="", help="what the rows are of (e.g. '32 layers'); default the folder's name")
    parser.add_argument("--json", type=Path, default=None, help="write (and extend, if it exists) the rows, the command and the machine")
    parser.add_argument("--plot", type=Path, default=None, help="decode and prompt rates against prompt length, from --json's rows")
    args = parser.parse_args()
    ep_options = dict(option.split("=", 1) for option in args.ep_option)
    label = args.label or args.model.name
    machine = f"{platform.node()} ({os.cpu_count()} CPUs), onnxruntime {ort.__version__}"
    command = "python " + " ".join(sys.argv)
    document = json.loads(args.json.read_text()) if args.json and args.json.is_file() else {"runs": [], "rows": []}
    document["runs"].append({"command": command, "machine": machine})
    print(f"Command: `{command}`\nMachine: {machine}\n", flush=True)
    header = ["model", "config", "prompt", "prompt s", "prompt tok/s", "decode tok/s", "tokens"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    model_proto = onnx.load(str(resolve(args.model).onnx_path), load_external_data=False)
    dims = cache_dims_of(model_proto)
    vocab = json.loads((args.model / "genai_config.json").read_text())["model"]["vocab_size"]
    # The first configuration that ran a prompt is the others' reference, across runs into one --json.
    references: dict[int, tuple[dict, object]] = {
        r["prompt"]: (r, None) for r in document["rows"] if r.get("model") == label and r.get("agreement") == "reference"
    }
    failed = False
    for config in args.configs:
        try:
            runner = Runner(config, args.model, ep_options)
            runner.generate(list(range(2, 66)), 4)  # warm-up: compiles the kernels
        except Exception as error:
            row = {"model": label, "config": config, "error": f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"}
            document["rows"].append(row)
            print(f"| {label} | {config} | - | - | - | - | fails to load or run: {row['error']} |", flush=True)
            traceback.print_exc(limit=3)
            continue
        for length in args.prompts:
            if config in "ab" and length > args.cpu_max_prompt:
                continue
            prompt = np.random.default_rng(length).integers(2, vocab, length).tolist()
            row = {"model": label, "config": config, "prompt": length}
            try:
                if args.warm_lengths:
                    runner.generate(prompt, 2)
                tokens, prompt_s, steps = runner.generate(prompt, args.new_tokens)
            except Exception as error:
                row["error"] = f"{type(error).__name__}: {' '.join(str(error).split())[:400]}"
                document["rows"].append(row)
                print(f"| {label} | {config} | {length} | - | - | - | fails: {row['error']} |", flush=True)
                continue
            row.update(
                tokens=tokens,
                prompt_seconds=prompt_s,
                prompt_tokens_per_second=length / prompt_s,
                decode_tokens_per_second=len(steps) / sum(steps) if steps else None,
            )
            if length in references:
                reference, judge = references[length]
                row["agreement"] = compare(reference, row, prompt, judge or runner.session, dims)
                failed |= row["agreement"].startswith("DIFFERENT")
            elif config != "c":
                references[length] = (row, runner.session)
                row["agreement"] = "reference"
            else:
                row["agreement"] = "not compared"
            document["rows"].append(row)
            decode = f"{row['decode_tokens_per_second']:.1f}" if steps else "-"
            print(
                f"| {label} | {config} | {length} | {prompt_s:.3f} | {row['prompt_tokens_per_second']:.0f} | {decode} | {row['agreement']} |",
                flush=True,
            )
            if args.json:
                args.json.write_text(json.dumps(document, indent=1) + "\n")
        del runner
    if args.json:
        args.json.write_text(json.dumps(document, indent=1) + "\n")
    if args.plot:
        plot(document["rows"], args.plot)
    return 1 if failed else 0


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for model, config in sorted({(r["model"], r["config"]) for r in rows if "error" not in r}):
        mine = sorted((r for r in rows if r["model"] == model and r["config"] == config and "error" not in r), key=lambda r: r["prompt"])
        name = f"{model}, {config}: {CONFIGS[config]}"
        axes[0].plot([r["prompt"] for r in mine], [r["decode_tokens_per_second"] or 0 for r in mine], marker="o", label=name)
        axes[1].plot([r["prompt"] for r in mine], [r["prompt_tokens_per_second"] for r in mine], marker="o", label=name)
    for axis, title in zip(axes, ("decode tokens/s (greedy, after the prompt)", "prompt tokens/s (the first new token included)")):
        axis.set_xscale("log", base=2)
        axis.set_yscale("log")
        axis.set_xlabel("prompt tokens")
        axis.set_title(title)
        axis.grid(True, which="both", alpha=0.3)
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
