#!/usr/bin/env python3
"""Generation through whole decoders: this op against ONNX Runtime's own CPU kernels, same run.

    python scripts/bench_generate.py                  # bundled models, then the Phi-3-small attention shape
    python scripts/bench_generate.py --quick          # bundled models only (lavapipe: ~1 minute)

Every case runs ``sparse_attention_op.generate`` twice on the same prompts: once through
``create_session`` (SparseAttention on WebGPU, ``kv_check="fast"``) and once through a plain
``InferenceSession`` (ORT's own CPU kernels). Both bind each layer's past and present to one
buffer, as ORT GenAI does. Every other node (MatMuls, norms, GroupQueryAttention layers)
runs on ORT's CPU kernels in both. Columns: the prompt's wall time (the first new token),
the mean decode step (one new token for every row), and whether the greedy tokens agree
(float16: up to a near-tie, see docs/genai.md). A warm-up generation compiles the kernels.

Models: the two in models/ (4 layers, head size 16) and ``phi3-small-attention``: two
layers (one SparseAttention, one GroupQueryAttention) with Phi-3-small's attention shape
(32 heads over 8 kv heads, head size 128, 64-token blocks, 16 local blocks, vertical
stride 8, one layout per head, rotary) and a small hidden size (512), so attention, not the
CPU's MatMuls, dominates the step. Built in memory, deterministic.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

import sparse_attention_op as sao
from sparse_attention_op.testing.decoder_models import DecoderConfig, build_decoder
from sparse_attention_op.generation.loop import divergences, generate
from sparse_attention_op.webgpu import get_context

MODELS = Path(__file__).resolve().parent.parent / "models"
PHI3_SMALL_ATTENTION = DecoderConfig(
    vocab_size=1024, hidden=512, layers=2, num_heads=32, kv_num_heads=8, head_size=128, sparse_block_size=64,
    local_blocks=16, vert_stride=8, max_position=8192, dense_every=2, intermediate=1024, seed=0,
)
#: (model, prompt length, rows, new tokens)
CASES = [("phi3-small-tiny", 64, 1, 64), ("phi3-small-tiny", 64, 4, 64), ("phi3-small-tiny-f16", 64, 1, 64),
         ("phi3-small-tiny", 440, 1, 64)]
LONG_CASES = [("phi3-small-attention", 1000, 1, 32), ("phi3-small-attention", 4000, 1, 32), ("phi3-small-attention", 8000, 1, 32)]


def model_bytes(name: str) -> bytes:
    if name == "phi3-small-attention":
        return build_decoder(PHI3_SMALL_ATTENTION).SerializeToString()
    return (MODELS / name / "model.onnx").read_bytes()


def run_case(name: str, prompt_len: int, rows: int, new_tokens: int, sessions: dict) -> dict:
    if name not in sessions:
        data = model_bytes(name)
        sessions.clear()  # one model's sessions at a time: the long one is large
        sessions[name] = (sao.create_session(data, kv_check="fast"), ort.InferenceSession(data, providers=["CPUExecutionProvider"]))
    ours_session, plain = sessions[name]
    vocab = next(o.shape[-1] for o in plain.get_outputs() if o.name == "logits")
    prompts = np.random.default_rng(prompt_len * 7 + rows).integers(2, vocab, (rows, prompt_len)).tolist()
    generate(ours_session, prompts, 2)  # warm-up: compiles the kernels for these shapes
    generate(plain, prompts, 2)
    ours = generate(ours_session, prompts, new_tokens)
    theirs = generate(plain, prompts, new_tokens)
    found = divergences(plain, prompts, ours.tokens, theirs.tokens)
    if not found:
        agree = "identical"
    elif all(d.near_tie for d in found):
        agree = "near-tie at token " + ", ".join(str(d.step) for d in found)
    else:
        agree = "DIFFERENT"
    return {
        "model": name, "prompt": prompt_len, "rows": rows, "new_tokens": new_tokens,
        "ours_prompt_ms": 1e3 * ours.prompt_seconds, "ort_prompt_ms": 1e3 * theirs.prompt_seconds,
        "ours_ms_per_token": ours.ms_per_token, "ort_ms_per_token": theirs.ms_per_token,
        "ours_tokens_per_second": ours.tokens_per_second, "ort_tokens_per_second": theirs.tokens_per_second, "tokens": agree,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="only the bundled models")
    parser.add_argument("--json", type=Path, default=None, help="write the rows, the command and the machine")
    args = parser.parse_args()
    machine = (f"{platform.node()} ({os.cpu_count()} CPUs), adapter {get_context().description}, "
               f"onnxruntime {ort.__version__}")
    command = "python " + " ".join(sys.argv)
    print(f"Command: `{command}`\n\nMachine: {machine}\n")
    header = ["model", "prompt x rows", "new", "prompt ms (ours / ORT)", "ms per token (ours / ORT)", "speed-up", "tokens/s (ours)", "tokens"]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header), flush=True)
    rows, sessions, failed = [], {}, False
    for case in CASES + ([] if args.quick else LONG_CASES):
        row = run_case(*case, sessions)
        rows.append(row)
        failed |= row["tokens"] == "DIFFERENT"
        print(f"| {row['model']} | {row['prompt']} x {row['rows']} | {row['new_tokens']} | {row['ours_prompt_ms']:.1f} / "
              f"{row['ort_prompt_ms']:.1f} | {row['ours_ms_per_token']:.2f} / {row['ort_ms_per_token']:.2f} | "
              f"{row['ort_ms_per_token'] / row['ours_ms_per_token']:.2f}x | {row['ours_tokens_per_second']:.0f} | {row['tokens']} |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"command": command, "machine": machine, "rows": rows}, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
