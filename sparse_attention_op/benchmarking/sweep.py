"""Sweep SparseAttention on WebGPU over context lengths and sparsities, against torch and ORT.

    sparse-attention-op bench --torch --ort --json bench.json --plot bench.png   # the H200 sweep
    sparse-attention-op bench --quick --ort --plot quick.png                       # lavapipe (~20 s)
    sparse-attention-op bench --prefill 2048 --decode --layouts 16/8 --cache both  # one prefill length, f32 and f16

(``python scripts/benchmark.py ...`` is the same program.)

Shape: Phi-3-small (32 query heads over 8 kv heads, head size 128, 64-token blocks, 32
layouts, rotary), batch 1. One case is a prefill (a prompt of N tokens into a cache of N
rows) or a decode step (one token after N history rows, cache of --capacity rows), under
one block layout:

* ``L/S``: Phi-3-small's layout with L local blocks and vertical stride S (the model's own
  is 16/8); ``dense``: every causal block. A case's density is the selected causal
  (query, key) pairs over all causal pairs of its queries, summed over heads.

Columns, per case (medians over --reps calls after warm-up, which compiles the shaders):

* GPU ms: the sum of the call's dispatches, from GPU timestamp queries, each dispatch timed
  in a compute pass of its own.
* one pass ms: the same calls run again with their dispatches timed as the one compute pass
  an untimed call records (each timed pass costs the GPU a few microseconds even empty: a
  two-dispatch decode step pays it once here, twice in GPU ms).
* call ms: one ``executor.run``: uploads, dispatches, read-back of the output to numpy.
  A decode step in steady state: the first call of a case uploads the history, later ones
  find it resident (``build_call(with_history=False)``), so decode calls advance one token
  each and the last timed one is at the named history.
* roofline ms (achieved): the least time the work can take. Prefill is compute-bound:
  4 * head_size flops per selected (query, key) pair, at --fp32-tflops. Decode is
  memory-bound: the K and V rows that some query head of a kv head selects, read once, at
  --bandwidth-gbs (the GPU cache's dtype: f16 for a float16 model on an adapter with
  shader-f16). Achieved = roofline / GPU time.
* torch SDPA ms (--torch, CUDA only): ``scaled_dot_product_attention`` fp32, dense causal
  (decode: one query over all keys), the faster of kv heads expanded to the query heads and
  enable_gqa; CUDA-event time, so comparable with GPU ms. It does not depend on the layout.
* ORT CPU ms (--ort): ONNX Runtime's own CPU kernel on the same inputs, past and present
  bound to one buffer (as ORT GenAI runs it); wall time of ``run_with_iobinding``.
  Prompts longer than --ort-max-len are skipped (it is quadratic and slow).
* max err: every WebGPU result is checked on sampled (token, head) rows against a float64
  recomputation; the script exits 1 if any exceeds 2e-3 (1e-2 for f16).

``--cache f16`` runs a float16-storage call (what a float16 model's node does) on inputs
that are float16 values. The progress bar needs tqdm and --plot needs matplotlib, the
``bench`` extra: ``pip install sparse-attention-op[bench]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field

import numpy as np
import onnxruntime as ort
import wgpu

from sparse_attention_op.benchmarking.common import PHI3_SMALL, median_seconds, spot_check
from sparse_attention_op.op.layouts import causal_mask, mask_to_csr, phi3_small_mask
from sparse_attention_op.op.reference import block_mask
from sparse_attention_op.op.spec import OpAttributes, SparseAttentionError, build_call
from sparse_attention_op.ort.io_binding import bind_shared
from sparse_attention_op.ort.providers import EPS, add_ep
from sparse_attention_op.settings import SessionSettings
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs
from sparse_attention_op.webgpu import get_executor

EXTRA = "pip install 'sparse-attention-op[bench]'"
TOLERANCE = {"f32": 2e-3, "f16": 1e-2}
SWEEPS = {  # (prefill lengths, decode histories, decode capacity, layouts, reps)
    "default": ([1024, 2048, 4096, 8192], [1023, 4095, 8191], 8192, ["4/16", "16/8", "dense"], 5),
    "quick": ([256, 512, 1024], [511, 1023], 1024, ["4/16", "16/8", "dense"], 1),
}


# -- cases ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A block layout: Phi-3-small's with other local/stride values, or dense causal."""

    name: str  # "L/S" or "dense"

    @property
    def dense(self) -> bool:
        return self.name == "dense"

    @property
    def local_and_stride(self) -> tuple[int, int]:
        local, stride = self.name.split("/")
        return int(local), int(stride)

    @property
    def label(self) -> str:
        if self.dense:
            return "dense causal"
        local, stride = self.local_and_stride
        return f"local {local}, stride {stride}" + (" (Phi-3-small)" if (local, stride) == (16, 8) else "")

    def csr(self, max_blocks: int, num_layout: int) -> tuple[np.ndarray, np.ndarray]:
        if self.dense:
            return mask_to_csr(causal_mask(max_blocks, 1))
        local, stride = self.local_and_stride
        return mask_to_csr(phi3_small_mask(max_blocks, num_layout, local, stride))

    @staticmethod
    def parse(text: str) -> Layout:
        layout = Layout(text)
        if not layout.dense:
            try:
                local, stride = layout.local_and_stride
            except ValueError:
                raise argparse.ArgumentTypeError(f"layout must be LOCAL/STRIDE (e.g. 16/8) or 'dense', got {text!r}") from None
            if local < 1 or stride < 1:
                raise argparse.ArgumentTypeError(f"local blocks and stride must be positive, got {text!r}")
        return layout


@dataclass(frozen=True)
class Case:
    kind: str  # "prefill" or "decode"
    length: int  # prompt tokens, or history rows before the decode step
    capacity: int  # the cache's rows (max_cache_len)
    layout: Layout
    cache: str  # "f32" or "f16"

    @property
    def label(self) -> str:
        return f"prefill {self.length}" if self.kind == "prefill" else f"decode at {self.length}"

    @property
    def shape_key(self) -> str:
        """Same for the f32 and f16 variants of a case: they share data and baselines."""
        return f"{self.kind}/{self.length}/{self.capacity}/{self.layout.name}"

    def config(self) -> CaseConfig:
        prefill = self.kind == "prefill"
        return CaseConfig(
            seq_len=self.length if prefill else 1, max_cache_len=self.capacity, past_lengths=None if prefill else (self.length,), **PHI3_SMALL
        )

    def inputs(self) -> dict:
        """The call's eleven inputs: unit-scale random data (seeded by the shape), the case's layout."""
        config = self.config()
        inputs = random_inputs(config, np.random.default_rng(zlib.crc32(self.shape_key.encode())))
        inputs["block_row_indices"], inputs["block_col_indices"] = self.layout.csr(config.max_blocks, config.num_layout)
        if self.cache == "f16":  # what a float16 graph hands over: float16 values
            inputs = {k: (v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v) for k, v in inputs.items()}
        return inputs


@dataclass
class Row:
    """One case's measurements (times in ms; None where not measured)."""

    kind: str
    length: int
    capacity: int
    layout: str
    cache: str
    density: float
    gpu_ms: float | None
    call_ms: float
    roofline_ms: float
    roofline_work: float  # prefill: flops; decode: bytes
    torch_ms: float | None
    torch_variant: str | None  # how torch got the kv heads: "expanded kv heads" or "enable_gqa", the faster
    ort_ms: float | None
    max_error: float
    tolerance: float
    gpu_samples_ms: list = field(default_factory=list)
    call_samples_ms: list = field(default_factory=list)
    gpu_dispatch_ms: dict = field(default_factory=dict)  # median per dispatch label
    #: The same calls' dispatches timed as the one compute pass an untimed call records
    #: (SessionSettings.profile == "pass"): gpu_ms times each dispatch in a pass of its
    #: own, and each timed pass costs the GPU a few microseconds even empty (docs/benchmarks-archive.md).
    one_pass_ms: float | None = None

    @property
    def achieved(self) -> float | None:
        return None if not self.gpu_ms else self.roofline_ms / self.gpu_ms

    @property
    def failed(self) -> bool:
        return not self.max_error <= self.tolerance  # NaN fails too

    def cells(self) -> list[str]:
        achieved = "" if self.achieved is None else f" ({100 * self.achieved:.2g}%)"
        case = f"prefill {self.length}" if self.kind == "prefill" else f"decode at {self.length}"
        return [
            case,
            Layout(self.layout).label,
            f"{self.density:.3f}",
            self.cache,
            ms_cell(self.gpu_ms),
            ms_cell(self.one_pass_ms),
            ms_cell(self.call_ms),
            ms_cell(self.roofline_ms) + achieved,
            ms_cell(self.torch_ms),
            ms_cell(self.ort_ms),
            f"{self.max_error:.1e}",
        ]


def ms_cell(value: float | None) -> str:
    """Milliseconds for the table: one decimal from 10 up, else three significant digits."""
    if value is None:
        return "-"
    if value >= 10 or value <= 0:
        return f"{value:.1f}"
    return f"{value:.{max(2, 2 - math.floor(math.log10(value)))}f}"


COLUMNS = (
    "Columns: density = selected causal (query, key) pairs / all causal pairs; GPU ms = the call's dispatches, one timed pass each "
    "(GPU timestamps); one pass ms = the same as one timed pass; call ms = one executor.run, uploads and read-back included; "
    "roofline = selected flops at the fp32 "
    "rate (prefill) or selected K/V bytes at the bandwidth (decode), achieved = roofline / GPU ms; torch SDPA = dense "
    "fp32 (CUDA events); ORT CPU = onnxruntime's own kernel (wall); max err = sampled rows against float64."
)
HEADER = [
    "case",
    "layout",
    "density",
    "cache",
    "GPU ms",
    "one pass ms",
    "call ms",
    "roofline ms (achieved)",
    "torch SDPA ms",
    "ORT CPU ms",
    "max err",
]


def sweep_cases(args) -> list[Case]:
    caches = ["f32", "f16"] if args.cache == "both" else [args.cache]
    cases = [Case("prefill", n, n, layout, cache) for layout in args.layouts for n in args.prefill for cache in caches]
    cases += [Case("decode", n, args.capacity, layout, cache) for layout in args.layouts for n in args.decode for cache in caches]
    return cases


# -- work: density and roofline -------------------------------------------------------


def selected_pairs(mask: np.ndarray, block: int, first: int, count: int) -> tuple[np.ndarray, int]:
    """Selected causal (query, key) pairs of queries first..first+count-1, per layout of ``mask``
    (num_layout, blocks, blocks), and all causal pairs of those queries."""
    blocks = mask.shape[1]
    query = np.arange(first, first + count)
    row = query // block
    queries = np.bincount(row, minlength=blocks)  # queries per block row
    diagonal = np.bincount(row, weights=query - row * block + 1, minlength=blocks)  # their keys in their own block
    left = (mask & np.tri(blocks, k=-1, dtype=bool)).sum(axis=2)  # selected whole blocks left of the diagonal
    on = mask[:, np.arange(blocks), np.arange(blocks)]
    selected = queries * block * left + diagonal * on
    causal = queries * block * np.arange(blocks) + diagonal
    return selected.sum(axis=1), int(causal.sum())


def work(case: Case, inputs: dict, cache_itemsize: int, args) -> tuple[float, float, float]:
    """(density, roofline seconds, work): flops for a prefill, K/V bytes read for a decode step."""
    config = case.config()
    mask = block_mask(inputs["block_row_indices"], inputs["block_col_indices"])  # the op's reading of the CSR
    heads = np.arange(config.num_heads)
    first, count = (0, case.length) if case.kind == "prefill" else (case.length, 1)
    per_layout, causal = selected_pairs(mask, config.sparse_block_size, first, count)
    selected = per_layout[heads % mask.shape[0]].sum()  # head h follows layout h % num_layout
    density = float(selected / (config.num_heads * causal))
    if case.kind == "prefill":
        flops = 4.0 * config.head_size * selected  # q.k and p.v: 2 * head_size each
        return density, flops / (args.fp32_tflops * 1e12), flops
    group = config.num_heads // config.kv_num_heads
    union = np.stack([mask[heads[g * group : (g + 1) * group] % mask.shape[0]].any(axis=0) for g in range(config.kv_num_heads)])
    keys, _ = selected_pairs(union, config.sparse_block_size, first, count)  # one query: pairs are keys
    nbytes = 2.0 * keys.sum() * config.head_size * cache_itemsize  # K and V
    return density, nbytes / (args.bandwidth_gbs * 1e9), nbytes


# -- measurements ---------------------------------------------------------------------


def run_webgpu(case: Case, inputs: dict, reps: int, whole_pass: bool = False):
    """Warm-up, then ``reps`` timed calls: (their CallStats, the last output, the GPU cache's itemsize).
    With ``whole_pass``, each call's dispatches are timed as its one pass (CallStats.gpu_seconds["pass"]).

    Decode steps advance one token per call, from history ``length - reps - 1`` (whose call
    uploads the history) to ``length``; after each, the host history gets the row the GPU
    cache now holds, so the spot check sees what the last call saw."""
    executor = get_executor()
    attributes = OpAttributes.from_mapping(case.config().node_attributes())
    node_key = f"bench/{case.shape_key}/{case.cache}"
    settings = SessionSettings(profile="pass" if whole_pass else "dispatches")
    f16 = case.cache == "f16"
    results = []
    try:
        if case.kind == "prefill":
            call = build_call(inputs, attributes, float16_storage=f16)
            results = [executor.run(call, node_key, settings) for _ in range(1 + reps)]
        else:
            start = case.length - reps - 1
            for history in range(start, case.length + 1):
                lengths = np.array([history + 1], np.int32)
                step = {**inputs, "total_sequence_length": lengths, "key_total_sequence_lengths": lengths.copy()}
                call = build_call(step, attributes, float16_storage=f16, with_history=history == start)
                results.append(executor.run(call, node_key, settings))
                inputs["past_key"][:, :, history] = results[-1].new_key[:, :, 0]
                inputs["past_value"][:, :, history] = call.new_rows("value")[:, :, 0]
        itemsize = executor.node_state(node_key).cache.dtype.itemsize
    finally:
        executor.release(node_key)
    timed = results[-reps:]
    return [r.stats for r in timed], timed[-1].output, itemsize


def ort_cpu_seconds(case: Case, inputs: dict, reps: int, ep: str = "cpu") -> float:
    """ORT's CPU kernel, past and present bound to one buffer (it needs that for in-place
    presents), in a session whose EP is ``ep``: ORT's WebGPU EP has no SparseAttention
    kernel, so under it the node still runs on ORT's CPU EP, its tensors copied across."""
    model = sparse_attention_model(case.config().node_attributes(), inputs)
    options = ort.SessionOptions()
    add_ep(options, ep)
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"] if ep == "cpu" else None)
    arrays = {n: np.array(inputs[n]) for n in ("past_key", "past_value")}  # ORT writes the presents into them
    past = {n: ort.OrtValue.ortvalue_from_numpy(a) for n, a in arrays.items()}  # borrows ``arrays``: keep them alive
    binding = bind_shared(session, inputs, past)
    return median_seconds(lambda: session.run_with_iobinding(binding), reps)


def torch_sdpa_seconds(case: Case, reps: int) -> tuple[float, str] | tuple[None, None]:
    """Dense fp32 SDPA on CUDA at the case's shape, CUDA-event time: (seconds, variant), or Nones
    without CUDA. The faster of two ways to give it the 8 kv heads: expanded to 32 beforehand,
    and enable_gqa (torch >= 2.5; some backends lack it and fall back to a slower one)."""
    torch = import_torch_cuda()
    if torch is None:
        return None, None
    config = case.config()
    queries, keys = (case.length, case.length) if case.kind == "prefill" else (1, case.length + 1)
    q = torch.randn(1, config.num_heads, queries, config.head_size, device="cuda")
    k, v = (torch.randn(1, config.kv_num_heads, keys, config.head_size, device="cuda") for _ in range(2))
    group = config.num_heads // config.kv_num_heads
    variants = {
        "expanded kv heads": (k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), {}),
        "enable_gqa": (k, v, {"enable_gqa": True}),
    }
    causal = case.kind == "prefill"  # a decode query sees every key; is_causal would align it to key 0
    sdpa = torch.nn.functional.scaled_dot_product_attention
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = (None, None)
    for name, (keys_in, values_in, kwargs) in variants.items():
        try:
            sdpa(q, keys_in, values_in, is_causal=causal, **kwargs)  # warm-up
        except (TypeError, RuntimeError):  # torch without enable_gqa
            continue
        times = []
        for _ in range(reps):
            begin.record()
            sdpa(q, keys_in, values_in, is_causal=causal, **kwargs)
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end) * 1e-3)
        if best[0] is None or statistics.median(times) < best[0]:
            best = (statistics.median(times), name)
    return best


def import_torch_cuda():
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def measure(case: Case, args, baselines: dict) -> Row:
    """One case: the WebGPU calls, the spot check, the roofline, and the baselines. Those are
    measured once per shape (torch: per length, being dense; ORT: per layout too) and shared
    by the f32 and f16 variants: both compute in float32 either way."""
    inputs = case.inputs()
    # The one-pass timing first, on copies: a decode run writes its rows into the inputs'
    # history, which the spot check then reads from the second, per-dispatch run.
    one_pass, _, _ = run_webgpu(case, {name: array.copy() for name, array in inputs.items()}, args.reps, whole_pass=True)
    stats, output, itemsize = run_webgpu(case, inputs, args.reps)
    config = case.config()
    error = spot_check(inputs, output, config.sparse_block_size, 8, np.random.default_rng(zlib.crc32(case.label.encode())))
    density, roofline_s, amount = work(case, inputs, itemsize, args)
    torch_key, ort_key = ("torch", case.kind, case.length), ("ort", case.shape_key)
    if args.torch and torch_key not in baselines:
        baselines[torch_key] = torch_sdpa_seconds(case, args.reps)
    if args.ort and ort_key not in baselines and (case.kind == "decode" or case.length <= args.ort_max_len):
        baselines[ort_key] = ort_cpu_seconds(case, inputs, args.reps, args.ep)
    torch_s, torch_variant = baselines.get(torch_key, (None, None))
    ort_s = baselines.get(ort_key)
    gpu = [s.gpu_total for s in stats if s.gpu_total is not None]
    passes = [s.gpu_total for s in one_pass if s.gpu_total is not None]
    labels = stats[0].gpu_seconds.keys()

    def ms(seconds):
        return None if seconds is None else seconds * 1e3

    return Row(
        kind=case.kind,
        length=case.length,
        capacity=case.capacity,
        layout=case.layout.name,
        cache=case.cache,
        density=density,
        gpu_ms=ms(statistics.median(gpu)) if gpu else None,
        one_pass_ms=ms(statistics.median(passes)) if passes else None,
        call_ms=ms(statistics.median(s.seconds for s in stats)),
        roofline_ms=ms(roofline_s),
        roofline_work=amount,
        torch_ms=ms(torch_s),
        torch_variant=torch_variant,
        ort_ms=ms(ort_s),
        max_error=error,
        tolerance=TOLERANCE[case.cache],
        gpu_samples_ms=[ms(g) for g in gpu],
        call_samples_ms=[ms(s.seconds) for s in stats],
        gpu_dispatch_ms={label: ms(statistics.median(s.gpu_seconds[label] for s in stats)) for label in labels},
    )


# -- output ---------------------------------------------------------------------------


def machine_line() -> str:
    executor = get_executor()
    line = (
        f"{platform.node()} ({os.cpu_count()} CPUs), adapter {executor.context.description}, onnxruntime {ort.__version__}, wgpu {wgpu.__version__}"
    )
    torch = import_torch_cuda()
    if torch is not None:
        line += f", torch {torch.__version__} on {torch.cuda.get_device_name()}"
    return line


class Progress:
    """A tqdm bar over the cases (on stderr) where tqdm is installed; plain lines otherwise."""

    def __init__(self, cases: list[Case]):
        self.cases = cases
        try:
            from tqdm import tqdm
        except ImportError:
            print(f"note: tqdm is not installed, so there is no progress bar ({EXTRA})", file=sys.stderr)
            self.tqdm, self.bar = None, None
        else:
            self.tqdm = tqdm
            self.bar = tqdm(
                cases,
                unit="case",
                file=sys.stderr,
                dynamic_ncols=True,
                disable=None,  # None: no bar off a terminal
                bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}<{remaining}]{postfix}",
            )

    def __iter__(self):
        return iter(self.cases if self.bar is None else self.bar)

    def describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(text)

    def write(self, line: str, file=None) -> None:
        """Print a line (on stdout unless ``file``) without breaking the bar."""
        file = file or sys.stdout  # looked up now: callers (and tests) may have replaced it
        if self.bar is None:
            print(line, file=file, flush=True)
        else:
            self.tqdm.write(line, file=file)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


PLOT_STYLE = {  # method: (colormap, marker, line style, line width); a darker shade is a denser layout
    "WebGPU f32": ("Blues", "o", "-", 1.8),
    "WebGPU f16": ("Greens", "s", (0, (5, 1.5)), 1.8),
    "ORT CPU": ("Oranges", "^", "--", 1.8),
    "roofline": ("Greys", "", ":", 1.2),
}


def series(rows: list[Row], method: str) -> list[tuple[float, float]]:
    """(length, ms) points of one method; the baselines are shared by a shape's f32 and f16 rows."""
    if method == "ORT CPU":
        return sorted({(r.length, r.ort_ms) for r in rows if r.ort_ms is not None})
    if method == "torch":
        return sorted({(r.length, r.torch_ms) for r in rows if r.torch_ms is not None})
    if method == "roofline":  # of the first cache variant (an f16 cache halves a decode step's bytes)
        return sorted((r.length, r.roofline_ms) for r in rows if r.cache == rows[0].cache)
    return sorted((r.length, r.gpu_ms) for r in rows if f"WebGPU {r.cache}" == method and r.gpu_ms is not None)


def density_span(rows: list[Row]) -> str:
    low, high = min(r.density for r in rows), max(r.density for r in rows)
    return f"{low:.2f}" if high - low < 0.005 else f"{low:.2f}-{high:.2f}"


def plot(rows: list[Row], path: str, command: str, machine: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"note: matplotlib is not installed, so no plot was written ({EXTRA})", file=sys.stderr)
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullLocator

    layouts = sorted({r.layout for r in rows}, key=lambda name: (name == "dense", statistics.mean(r.density for r in rows if r.layout == name)))
    fig, axes = plt.subplots(1, 2, figsize=(15, 7.5), constrained_layout=True)
    for ax, kind in zip(axes, ("prefill", "decode")):
        kind_rows = [r for r in rows if r.kind == kind]
        if not kind_rows:
            ax.set_axis_off()
            continue
        for method, (cmap, marker, style, width) in PLOT_STYLE.items():
            for rank, layout in enumerate(layouts):
                layout_rows = [r for r in kind_rows if r.layout == layout]
                points = series(layout_rows, method) if layout_rows else []
                if points:
                    color = plt.get_cmap(cmap)(0.45 + 0.5 * rank / max(1, len(layouts) - 1))
                    label = f"{method}, {Layout(layout).label}, density {density_span(layout_rows)}"
                    ax.plot(*zip(*points), marker=marker, linestyle=style, linewidth=width, color=color, label=label)
        torch_points = series(kind_rows, "torch")
        if torch_points:
            ax.plot(*zip(*torch_points), marker="x", linestyle="-", linewidth=1.2, color="black", label="torch SDPA fp32, dense (CUDA)")
        lengths = sorted({r.length for r in kind_rows})
        ax.set_xscale("log", base=2)
        ax.set_xlim(lengths[0] / 1.25, lengths[-1] * 1.25)
        ax.set_xticks(lengths, [str(n) for n in lengths])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_yscale("log")
        ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.grid(True, alpha=0.3)
        ax.set_xlabel("prompt tokens" if kind == "prefill" else f"history rows (cache of {kind_rows[0].capacity} rows)")
        ax.set_ylabel("ms per call (log)")
        ax.set_title("prefill: one prompt" if kind == "prefill" else "decode: one token")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, frameon=False)
    fig.suptitle(
        f"SparseAttention at the Phi-3-small shape: WebGPU GPU time (timestamps), torch (CUDA events), ORT CPU (wall)\n{machine}\n{command}",
        fontsize=8,
    )
    fig.savefig(path, dpi=130, bbox_inches="tight")
    plt.close(fig)


def write_json(args, rows: list[Row], skipped: list[str], **header: str) -> None:
    # Only the sweep's own options (the CLI adds its dispatch entries to the namespace).
    options = {action.dest for action in build_parser()._actions} - {"help"}
    arguments = {name: value for name, value in vars(args).items() if name in options} | {"layouts": [layout.name for layout in args.layouts]}
    document = header | {"arguments": arguments, "rows": [asdict(r) | {"achieved": r.achieved} for r in rows], "skipped": skipped}
    with open(args.json, "w") as handle:
        json.dump(document, handle, indent=2)


# -- main -----------------------------------------------------------------------------


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The sweep's options, on ``parser`` (the CLI's ``bench`` subcommand) or a new one."""
    parser = parser or argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="lavapipe-sized sweep: prefill 256/512/1024, decode 511/1023 at capacity 1024, 1 rep")
    parser.add_argument("--prefill", type=int, nargs="*", default=None, help="prompt lengths (default 1024 2048 4096 8192)")
    parser.add_argument("--decode", type=int, nargs="*", default=None, help="history rows before one decode step (default 1023 4095 8191)")
    parser.add_argument("--capacity", type=int, default=None, help="cache rows (max_cache_len) of the decode cases (default 8192)")
    parser.add_argument(
        "--layouts",
        type=Layout.parse,
        nargs="+",
        default=None,
        help="block layouts: LOCAL/STRIDE (Phi-3-small is 16/8) or 'dense' (default 4/16 16/8 dense)",
    )
    parser.add_argument(
        "--cache",
        choices=["f32", "f16", "both"],
        default="f32",
        help="f16: a float16-storage call (inputs are float16 values), its GPU cache f16 where the adapter has shader-f16",
    )
    parser.add_argument("--reps", type=int, default=None, help="timed calls per case, after warm-up (default 5; --quick 1)")
    parser.add_argument("--torch", action="store_true", help="also time torch dense causal SDPA fp32 (needs CUDA)")
    parser.add_argument("--ort", action="store_true", help="also time ONNX Runtime's CPU kernel")
    parser.add_argument(
        "--ep",
        choices=EPS,
        default="cpu",
        help="the EP of --ort's session (default %(default)s; webgpu: ORT's WebGPU plugin EP, which leaves SparseAttention on its CPU EP)",
    )
    parser.add_argument(
        "--ort-max-len", type=int, default=4096, help="longest prompt ORT's CPU kernel runs (default %(default)s; decode steps always run)"
    )
    parser.add_argument(
        "--fp32-tflops",
        type=float,
        default=18.4,
        help="prefill roofline rate in TFLOP/s (default %(default)s: the H200's measured tiled-GEMM fp32 rate through WebGPU; its fp32 peak is ~67)",
    )
    parser.add_argument(
        "--bandwidth-gbs", type=float, default=3370, help="decode roofline rate in GB/s (default %(default)s: the H200's memory bandwidth)"
    )
    parser.add_argument("--json", type=str, default=None, metavar="OUT", help="write every measurement, the command and the machine")
    parser.add_argument("--plot", type=str, default=None, metavar="OUT.png", help="time against context length, log-log (needs matplotlib)")
    return parser


def resolve_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> argparse.Namespace:
    """Fill the sweep's defaults into parsed ``args``; ``parser.error`` on a bad combination."""
    prefill, decode, capacity, layouts, reps = SWEEPS["quick" if args.quick else "default"]
    args.prefill = prefill if args.prefill is None else args.prefill
    args.decode = decode if args.decode is None else args.decode
    args.capacity = capacity if args.capacity is None else args.capacity
    args.layouts = [Layout(name) for name in layouts] if args.layouts is None else args.layouts
    args.reps = reps if args.reps is None else args.reps
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    if not args.prefill and not args.decode:
        parser.error("--prefill and --decode name no case: give a length to one of them")
    if any(length < 1 for length in args.prefill):
        parser.error(f"--prefill lengths must be at least 1, got {min(args.prefill)}")
    if args.capacity < 1:
        parser.error(f"--capacity must be at least 1, got {args.capacity}")
    for option, rate in (("--fp32-tflops", args.fp32_tflops), ("--bandwidth-gbs", args.bandwidth_gbs)):
        if not rate > 0:
            parser.error(f"{option} must be > 0 (a roofline rate), got {rate:g}")
    if args.json == "-":
        parser.error("--json needs a file path here: the sweep's table takes stdout")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (checked before the sweep, not after it)
        except ImportError:
            parser.error(f"--plot needs matplotlib: {EXTRA}")
    if args.torch and import_torch_cuda() is None:
        parser.error("--torch needs torch with a CUDA device, and this Python has none (the baseline is CUDA's dense SDPA)")
    for history in args.decode:
        if not args.reps + 1 <= history < args.capacity:
            parser.error(f"decode history {history} must lie in [reps + 1, capacity) = [{args.reps + 1}, {args.capacity})")
    return args


def main(argv=None) -> int:
    parser = build_parser()
    return run(resolve_args(parser.parse_args(argv), parser), "python scripts/benchmark.py " + " ".join(sys.argv[1:] if argv is None else argv))


def run(args: argparse.Namespace, command: str) -> int:
    """The sweep of resolved ``args``: a markdown table on stdout, then --json and --plot."""
    machine = machine_line()
    settings = (
        f"median of {args.reps} timed call(s) per case after warm-up; roofline: prefill at {args.fp32_tflops:g} TFLOP/s fp32 "
        f"(4 * head_size flops per selected pair), decode at {args.bandwidth_gbs:g} GB/s (selected K/V bytes)"
    )
    print(f"Command: `{command}`\n\nMachine: {machine}\n\nSettings: {settings}\n\n{COLUMNS}\n")
    print("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER), flush=True)
    rows, baselines, skipped = [], {}, []
    progress = Progress(sweep_cases(args))
    start = time.perf_counter()
    for case in progress:
        progress.describe(f"{case.label}, {case.layout.name}, {case.cache}")
        try:
            row = measure(case, args, baselines)
        except SparseAttentionError as error:  # e.g. a buffer larger than this adapter binds
            skipped.append(f"{case.label}, {case.layout.name}, {case.cache}: {error}")
            progress.write(f"skipped {skipped[-1]}", sys.stderr)
            continue
        rows.append(row)
        progress.write("| " + " | ".join(row.cells()) + " |")
    elapsed = time.perf_counter() - start
    progress.close()
    failures = [r for r in rows if r.failed]
    print(
        f"\n{len(rows)} cases in {elapsed:.0f} s"
        + (f", {len(skipped)} skipped" if skipped else "")
        + (f"; {len(failures)} FAILED the spot check" if failures else "; every spot check passed"),
        flush=True,
    )
    if args.json:
        write_json(args, rows, skipped, command=command, machine=machine, settings=settings)
    if args.plot:
        plot(rows, args.plot, command, machine)
    for row in failures:
        print(f"spot check failed: {row.kind} {row.length}, {row.layout}, {row.cache}: error {row.max_error:.2e} > {row.tolerance}", file=sys.stderr)
    if not rows:
        print("no case ran: every case was skipped", file=sys.stderr)
    return 1 if failures or not rows else 0


if __name__ == "__main__":
    sys.exit(main())
