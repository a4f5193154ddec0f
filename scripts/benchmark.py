#!/usr/bin/env python3
"""Benchmark SparseAttention on WebGPU at the Phi-3-small shape, against ORT CPU and PyTorch.

    python scripts/benchmark.py --json out.json            # prefill 1024/4096/8192, decode at 8191
    python scripts/benchmark.py --ort --torch              # add ORT's CPU kernel and torch SDPA

Shape (DESIGN.md section 5): 32 query heads over 8 kv heads, head size 128, 64-token blocks,
16 local blocks and vertical stride 8 over 32 layouts, rotary on, batch 1, float32.

Per case it reports the wall time of one executor call (validated call to outputs in numpy,
uploads and read-back included), the GPU time of its compute pass (timestamp queries,
where the adapter has them), and, for decode, the copy floor: an ONNX Runtime graph that
passes the same cache tensors through Identity, which is what the PyOp bridge costs at
least. Every WebGPU result is spot-checked against the float64 reference on sampled rows.
Times are medians over --reps calls after one warm-up call (which compiles the shaders).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import numpy as np
import onnxruntime as ort
from bench_common import PHI3_SMALL, identity_floor_session, median_seconds

from sparse_attention_op.graphs import sparse_attention_model
from sparse_attention_op.inputs import CaseConfig, random_inputs
from sparse_attention_op.reference import apply_rotary, attend, block_mask
from sparse_attention_op.spec import OpAttributes, build_call
from sparse_attention_op.webgpu import get_executor

def spot_check(inputs, attrs, output, samples: int, rng) -> float:
    """Largest error of sampled (batch 0, token, head) rows against a float64 recomputation."""
    s = inputs["query"].shape[1]
    nh, nkv, h, blk = attrs["num_heads"], attrs["kv_num_heads"], inputs["past_key"].shape[3], attrs["sparse_block_size"]
    total = int(inputs["total_sequence_length"][0])
    past = 0 if total == s else int(inputs["key_total_sequence_lengths"][0]) - s
    mask = block_mask(inputs["block_row_indices"], inputs["block_col_indices"])
    scale = 1.0 / np.sqrt(h)
    cos, sin = inputs["cos_cache"], inputs["sin_cache"]
    worst = 0.0
    for _ in range(samples):
        head, t = int(rng.integers(nh)), int(rng.integers(s))
        kv = head // (nh // nkv)
        keys = inputs["past_key"][0, kv, : past + s].astype(np.float64)
        values = inputs["past_value"][0, kv, : past + s].astype(np.float64)
        new_k = inputs["key"][0].reshape(s, nkv, h)[:, kv]
        keys[past:] = apply_rotary(new_k, past + np.arange(s), cos, sin, False)
        values[past:] = inputs["value"][0].reshape(s, nkv, h)[:, kv]
        q = apply_rotary(inputs["query"][0, t : t + 1, head * h : (head + 1) * h], np.array([past + t]), cos, sin, False)
        want = attend(q, keys, values, np.array([past + t]), mask[head % mask.shape[0]], blk, scale)[0]
        worst = max(worst, float(np.abs(output[0, t, head * h : (head + 1) * h] - want).max()))
    return worst


def identity_floor(inputs, reps: int) -> float:
    session = identity_floor_session(inputs["past_key"].shape)
    feeds = {"past_key": inputs["past_key"], "past_value": inputs["past_value"]}
    return median_seconds(lambda: session.run(None, feeds), reps)


def ort_cpu_seconds(config, inputs, reps: int) -> float:
    model = sparse_attention_model(config.node_attributes(), inputs)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    past = {n: ort.OrtValue.ortvalue_from_numpy(np.array(inputs[n])) for n in ("past_key", "past_value")}
    keep_alive = past  # noqa: F841 - the OrtValues borrow the arrays
    binding = session.io_binding()
    for i in session.get_inputs():
        if i.name in past:
            binding.bind_ortvalue_input(i.name, past[i.name])
        else:
            binding.bind_cpu_input(i.name, inputs[i.name])
    binding.bind_output("output")
    binding.bind_ortvalue_output("present_key", past["past_key"])
    binding.bind_ortvalue_output("present_value", past["past_value"])
    return median_seconds(lambda: session.run_with_iobinding(binding), reps)


def torch_sdpa_seconds(config, reps: int) -> float | None:
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    s, n, h = config.seq_len, config.num_heads, config.head_size
    q = torch.randn(1, n, s, h, device="cuda")
    k = torch.randn(1, n, s, h, device="cuda")
    v = torch.randn(1, n, s, h, device="cuda")

    def run():
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.cuda.synchronize()

    return median_seconds(run, reps)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prefill", type=int, nargs="*", default=[1024, 4096, 8192], help="prompt lengths")
    parser.add_argument("--decode", type=int, nargs="*", default=[8191], help="history lengths for one decode step")
    parser.add_argument("--capacity", type=int, default=8192, help="max_cache_len of the decode cases")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--ort", action="store_true", help="also time ONNX Runtime's CPU kernel")
    parser.add_argument("--torch", action="store_true", help="also time torch dense causal SDPA (CUDA, fp32)")
    parser.add_argument("--query-rotary", choices=["fused", "pass", "both"], default="fused",
                        help="rotate queries inside the attention pass, in a pass of their own, or time both")
    parser.add_argument("--cache", choices=["f32", "f16", "both"], default="f32",
                        help="f16: a float16-storage node (inputs are float16 values) with its GPU cache in f16")
    parser.add_argument("--json", type=str, default=None)
    args = parser.parse_args()

    executor = get_executor()
    executor.profile = True
    rng = np.random.default_rng(0)
    machine = f"{platform.node()} ({os.cpu_count()} CPUs), adapter {executor.context.description}"
    print(f"# {' '.join(sys.argv)}\n# {machine}\n")
    print("| case | WebGPU call ms | GPU ms | copy floor ms | ORT CPU ms | torch SDPA ms | max err |")
    print("|---|---|---|---|---|---|---|")
    rows = []
    rotaries = ["fused", "pass"] if args.query_rotary == "both" else [args.query_rotary]
    caches = ["f32", "f16"] if args.cache == "both" else [args.cache]
    variants = [(r, c) for r in rotaries for c in caches]
    shapes = [("prefill", s, None) for s in args.prefill] + [("decode", 1, p) for p in args.decode]
    cases = [(kind, s, past, v) for v in variants for kind, s, past in shapes]
    for kind, seq_len, past, (rotary, cache) in cases:
        executor.fuse_query_rotary = rotary == "fused"
        capacity = seq_len if kind == "prefill" else args.capacity
        config = CaseConfig(seq_len=seq_len, max_cache_len=capacity, past_lengths=None if past is None else (past,), **PHI3_SMALL)
        inputs = random_inputs(config, rng)
        if cache == "f16":  # what a float16 graph hands over: float16 values
            inputs = {k: (v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v) for k, v in inputs.items()}
        attrs = config.node_attributes()
        call = build_call(inputs, OpAttributes.from_mapping(attrs), float16_storage=cache == "f16")
        result = {}

        def run_webgpu():
            result["outputs"] = executor.run(call, node_key=f"bench/{kind}/{cache}")
            result.setdefault("gpu", []).append(executor.last_stats.gpu_seconds)

        wall = median_seconds(run_webgpu, args.reps)
        gpu = statistics.median(result["gpu"][1:]) if result["gpu"][-1] is not None else None
        # f16 storage rounds rotated keys to float16 values: the float16 tolerance applies there.
        error = spot_check(inputs, attrs, result["outputs"][0], samples=8, rng=rng)
        floor = identity_floor(inputs, args.reps) if kind == "decode" else None
        ort_s = ort_cpu_seconds(config, inputs, max(1, args.reps // 2)) if args.ort else None
        torch_s = torch_sdpa_seconds(config, args.reps) if args.torch and kind == "prefill" else None
        label = f"{kind} {seq_len if kind == 'prefill' else f'at {past}'}"
        if len(variants) > 1:
            label += f" (q rotary {rotary}, cache {cache})"
        row = dict(case=label, webgpu_ms=wall * 1e3, gpu_ms=None if gpu is None else gpu * 1e3,
                   copy_floor_ms=None if floor is None else floor * 1e3, ort_cpu_ms=None if ort_s is None else ort_s * 1e3,
                   torch_sdpa_ms=None if torch_s is None else torch_s * 1e3, max_error=error, cache=cache)
        rows.append(row)
        cells = [f"{row[k]:.2f}" if row[k] is not None else "-" for k in ("webgpu_ms", "gpu_ms", "copy_floor_ms", "ort_cpu_ms", "torch_sdpa_ms")]
        print(f"| {row['case']} | " + " | ".join(cells) + f" | {error:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"command": " ".join(sys.argv), "machine": machine, "rows": rows}, handle, indent=2)
    return 0 if all(r["max_error"] < (1e-2 if r["cache"] == "f16" else 2e-3) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
