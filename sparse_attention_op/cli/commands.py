"""The command line's commands (cli.py parses; each function here runs one and returns its exit code).

Output goes to stdout; notes and progress to stderr. A failure raises: cli.main turns any
exception into one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import numpy as np

from sparse_attention_op.cli.tables import format_number, format_table

#: Largest |ours - ORT| / max(1, max |ORT|) accepted by ``run --compare-ort``, per output
#: dtype: float32 computes both in float32; float16 models round every op's output to
#: float16 in ORT's kernels, and the op computes attention in float32 before its cast.
COMPARE_TOLERANCE = {"float32": 1e-3, "float16": 2e-2}


def info(args: argparse.Namespace) -> int:
    from sparse_attention_op.cli.system_info import adapter_summaries, chosen_adapter, versions
    from sparse_attention_op.ort.providers import plugin_report

    report = {"versions": versions(), "adapters": adapter_summaries(), "webgpu_plugin_ep": plugin_report()}
    report["chosen"] = chosen_adapter() if report["adapters"] else None
    if args.json:
        _write_json(report, args.json)
        return 0 if report["chosen"] else 1
    print(format_table(["package", "version"], list(report["versions"].items())))
    _print_plugin()
    print("\nadapters (best first; SAO_ADAPTER picks another):")
    if not report["adapters"]:
        from sparse_attention_op.webgpu.device import no_adapter_reason

        print(f"  none: {no_adapter_reason()}")
        return 1
    print(
        format_table(
            ["#", "adapter", "vendor", "driver"], [[i, a["description"], a["vendor"], a["driver"]] for i, a in enumerate(report["adapters"])], "  "
        )
    )
    chosen = report["chosen"]
    print(f"\nchosen: {chosen['description']}")
    print("features: " + ", ".join(f"{name} {'yes' if present else 'no'}" for name, present in chosen["features"].items()))
    print("limits:\n" + format_table(["limit", "value"], list(chosen["limits"].items()), "  "))
    print("tuning (webgpu/tuning.py):\n" + format_table(["tunable", "value"], [[k, v] for k, v in chosen["tuning"].items()], "  "))
    print("routes at Phi-3-small's shape:\n" + format_table(["call", "pass"], list(chosen["routes"].items()), "  "))
    return 0


def _print_plugin() -> None:
    from sparse_attention_op.ort.providers import plugin_report

    plugin = plugin_report()
    if not plugin["installed"]:
        print(f"\nORT's WebGPU plugin EP (--ep webgpu): {plugin['problem']}")
        return
    print(f"\nORT's WebGPU plugin EP (--ep webgpu): onnxruntime-ep-webgpu {plugin['version']}, {plugin['library']}")
    if plugin["problem"]:
        print(f"  {plugin['problem']}")
    for index, device in enumerate(plugin["devices"]):
        print(f"  device {index}: {device}")


def inspect(args: argparse.Namespace) -> int:
    from sparse_attention_op.cli.inspection import format_report, inspect_model
    from sparse_attention_op.generation import model_files

    files = model_files.resolve(args.model)
    report = inspect_model(model_files.load(files, with_weights=False), files, args.ep)
    if args.json:
        _write_json(report.to_dict(), args.json)
    else:
        print(format_report(report))
    return 0 if report.refused is None else 1


def run(args: argparse.Namespace) -> int:
    """One run of the model on WebGPU with random or given feeds; optionally against ORT CPU."""
    from sparse_attention_op.generation import model_files
    from sparse_attention_op.ort.session import create_session
    from sparse_attention_op.testing.feeds import FeedSettings, check_feeds, history_lengths, npz_path, ragged_rows, random_feeds
    from sparse_attention_op.testing.plain_ort import run_plain_ort, shared_pairs

    files = model_files.resolve(args.model)
    model = model_files.load(files, with_weights=False)  # the sessions read the weights where they lie
    if args.feeds:
        feeds = check_feeds(model, _read_npz(args.feeds), str(args.feeds))
        notes = []
    else:
        settings = FeedSettings(
            batch=args.batch, seq=args.seq, past=args.past, capacity=args.capacity, head_size=args.head_size, dims=dict(args.dim), seed=args.seed
        )
        feeds, notes = random_feeds(model, settings, (files.genai_config or {}).get("model", {}).get("vocab_size"))
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    session = create_session(files.onnx_path, kv_check=args.kv_check, ep=args.ep)
    names = [o.name for o in session.get_outputs()]
    seconds = []
    for _ in range(args.repeat):
        start = time.perf_counter()
        outputs = dict(zip(names, session.run(None, feeds)))
        seconds.append(time.perf_counter() - start)
    reference = None
    if args.compare_ort:
        reference = run_plain_ort(model, feeds, files.onnx_path)
    print(f"model: {files.onnx_path}")
    print("feeds: " + ", ".join(f"{name} {list(np.shape(value))} {np.asarray(value).dtype}" for name, value in feeds.items()))
    timing = f"{1e3 * seconds[0]:.2f} ms" + (
        f" first, {1e3 * float(np.median(seconds[1:])):.2f} ms median of the other {len(seconds) - 1}" if len(seconds) > 1 else ""
    )
    print(f"session.run on WebGPU: {timing} (the first run compiles the kernels)\n")
    header = ["output", "shape", "dtype", "max |x|", "NaN/inf"]
    if reference is not None:
        header += ["max |ours - ORT CPU|", "relative", "agrees"]
    rows, failed = [], []
    ragged = ragged_rows(feeds)
    presents = set(shared_pairs(model))
    lengths = history_lengths(feeds)

    def compared(name: str, array: np.ndarray) -> np.ndarray:
        """What of an output counts: a present's rows past each batch row's history are junk by contract."""
        if name in presents and lengths is not None and array.ndim == 4:
            return np.concatenate([array[b, :, :n].reshape(-1) for b, n in enumerate(lengths)])
        return array

    for name in names:
        value = compared(name, outputs[name])
        finite = np.isfinite(value.astype(np.float64))
        row = [name, list(outputs[name].shape), value.dtype, format_number(float(np.abs(value[finite]).max(initial=0))), int((~finite).sum())]
        if not finite.all():
            failed.append(f"{name} holds NaN or inf")
        if reference is not None:
            expected = compared(name, reference[name]).astype(np.float64)
            error = float(np.abs(value.astype(np.float64) - expected).max(initial=0))
            relative = error / max(1.0, float(np.abs(expected).max(initial=0)))
            tolerance = COMPARE_TOLERANCE.get(str(value.dtype), 1e-3)
            agrees = relative <= tolerance
            row += [format_number(error), format_number(relative), "yes" if agrees else ("expected no (ragged rows)" if ragged else "NO")]
            if not agrees and not ragged:
                failed.append(f"{name} differs from ORT CPU by {relative:.3g} (relative), above {tolerance}")
        rows.append(row)
    print(format_table(header, rows))
    if lengths is not None and presents:
        print("\npresents: only each row's history rows are summarised and compared (the rest are junk by contract)")
    if reference is not None and ragged:
        print(
            "\nnote: the feeds' rows have different lengths; ORT's own CPU kernel gets those wrong (docs/design.md section 1),"
            " so differences there are expected",
            file=sys.stderr,
        )
    if args.save:
        saved = npz_path(args.save)
        np.savez(saved, **outputs)
        print(f"\nwrote {saved}")
    if failed:
        raise RuntimeError("; ".join(failed))
    return 0


def generate(args: argparse.Namespace) -> int:
    """Greedy or sampled generation from the given prompt ids; optionally against ORT CPU."""
    from sparse_attention_op.generation import model_files
    from sparse_attention_op.generation.loop import GenerationError, Sampling, cache_dims_of, divergences
    from sparse_attention_op.generation.loop import generate as generate_tokens

    files = model_files.resolve(args.model)
    prompts = args.prompt_ids
    stops = _stop_tokens(args, files)
    sampling = Sampling(do_sample=args.sample, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    model = model_files.load(files, with_weights=False)  # parsed here for its errors; the session reads the weights
    options = dict(stop_tokens=stops, pad_token_id=_pad_token(files), sampling=sampling, capacity=args.capacity)
    with _StepProgress(args.max_new_tokens, not args.no_progress) as progress:
        # The model's path, not a session: generate reads its cache dims and context there.
        try:
            result = generate_tokens(
                files.onnx_path, prompts, args.max_new_tokens, on_step=progress.step, kv_check=args.kv_check, ep=args.ep, **options
            )
        except GenerationError as error:
            raise GenerationError(_in_flags(str(error))) from None
    document = {"tokens": result.tokens, "ms_per_token": result.ms_per_token}
    # The report goes to stderr when the JSON takes stdout.
    report = sys.stderr if args.json == "-" else sys.stdout
    print(f"model: {files.onnx_path}", file=report)
    for b, (prompt, tokens) in enumerate(zip(prompts, result.tokens)):
        print(f"row {b}: prompt {','.join(map(str, prompt))} -> {','.join(map(str, tokens))} ({result.finish_reasons[b]})", file=report)
    if result.step_seconds:
        print(
            f"{result.ms_per_token:.2f} ms per token (decode step), {result.tokens_per_second:.1f} tokens/s over "
            f"{len(prompts)} row(s); prompt {1e3 * result.prompt_seconds:.1f} ms (includes compiling the kernels)",
            file=report,
        )
    else:
        print(f"one token per row, from the prompt: {1e3 * result.prompt_seconds:.1f} ms (includes compiling the kernels)", file=report)
    failures = []
    if args.compare_ort:
        # A plain session declares what the model declares: symbolic cache dims need reading from its nodes.
        dims = cache_dims_of(model)
        options["cache_dims"] = dims if None not in dims else None
        plain, reference = _ort_tokens(files, prompts, args.max_new_tokens, options)
        document["ort_cpu_tokens"] = reference
        if args.sample:
            # Seeded draws match only when both runs draw the same sequence: one batch, one seed.
            same = "identical" if reference == result.tokens else "different"
            print(
                f"ONNX Runtime's CPU kernel: {same} sampled tokens (not judged: sampled runs agree only with --seed "
                "and prompts of one length, and only while their probabilities do)",
                file=report,
            )
        else:
            found = divergences(plain, prompts, result.tokens, reference, options["cache_dims"])
            failures = [d for d in found if not d.near_tie]
            if not found:
                print("ONNX Runtime's CPU kernel: identical tokens", file=report)
            for d in found:
                verdict = "DIFFERENT" if d in failures else "identical up to a near-tie"
                print(
                    f"ONNX Runtime's CPU kernel: {verdict}: {d.describe()}" + ("" if d in failures else "; the runs follow different paths after it"),
                    file=report,
                )
    if args.json:
        _write_json(document, args.json)
    if failures:
        raise RuntimeError("tokens differ from ONNX Runtime's CPU kernel: " + "; ".join(d.describe() for d in failures))
    return 0


def _read_npz(path: Path) -> dict:
    """The arrays of an .npz archive by name; a clear error for anything else."""
    from sparse_attention_op.testing.feeds import FeedError

    if not Path(path).is_file():
        raise FeedError(f"--feeds {path}: no such file")
    try:
        loaded = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as error:
        raise FeedError(f"--feeds {path}: not an .npz archive of arrays (np.savez writes one): {error}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise FeedError(f"--feeds {path}: a single array, not an .npz archive of arrays named as the graph's inputs (np.savez writes one)")
    with loaded as archive:
        return {name: archive[name] for name in archive.files}


#: generate()'s argument names as the command line spells what sets them.
_GENERATE_FLAGS = {
    "max_new_tokens": "--max-new-tokens",
    "capacity": "--capacity",
    "stop_tokens": "the stop ids (--stop-ids, or the folder's eos_token_id)",
    "pad_token_id": "the folder's pad_token_id",
}


def _in_flags(message: str) -> str:
    """A generate() error with its argument names replaced by the options that set them."""
    return re.sub(r"\b(" + "|".join(_GENERATE_FLAGS) + r")\b", lambda match: _GENERATE_FLAGS[match.group(1)], message)


def _stop_tokens(args, files) -> list[int]:
    if args.no_stop:
        return []
    if args.stop_ids is not None:
        return args.stop_ids
    # A GenAI folder stops at its eos_token_id, as GenAI does; a bare .onnx names none.
    eos = ((files.genai_config or {}).get("model") or {}).get("eos_token_id")
    return [] if eos is None else (list(eos) if isinstance(eos, list) else [int(eos)])


def _pad_token(files) -> int:
    pad = ((files.genai_config or {}).get("model") or {}).get("pad_token_id", 0)
    return int(pad[0] if isinstance(pad, list) else pad)


def _ort_tokens(files, prompts, max_new_tokens: int, options: dict):
    """(the plain session, the same generation's tokens) with ONNX Runtime's own CPU kernels.
    Rows of different lengths run one by one: ORT's kernel gets ragged batches wrong."""
    import onnxruntime as ort

    from sparse_attention_op.generation.loop import generate as generate_tokens

    session = ort.InferenceSession(str(files.onnx_path), providers=["CPUExecutionProvider"])
    if len({len(p) for p in prompts}) == 1:
        return session, generate_tokens(session, prompts, max_new_tokens, **options).tokens
    return session, [generate_tokens(session, [prompt], max_new_tokens, **options).tokens[0] for prompt in prompts]


class _StepProgress:
    """A tqdm bar over generated tokens on stderr (when tqdm is installed and wanted)."""

    def __init__(self, total: int, enabled: bool):
        self.bar = None
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, unit="token", file=sys.stderr, leave=False, dynamic_ncols=True, disable=None)

    def step(self, step: int, tokens) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()


def bench(args: argparse.Namespace) -> int:
    from sparse_attention_op.benchmarking import sweep

    command = "sparse-attention-op bench " + " ".join(args.argv)
    return sweep.run(args, command)


def export_graph(args: argparse.Namespace) -> int:
    from sparse_attention_op.cli.export import export_graph as write

    for path in write(args):
        print(f"wrote {path}")
    return 0


def export_decoder(args: argparse.Namespace) -> int:
    from sparse_attention_op.cli.export import export_decoder as write

    path, config = write(args)
    print(
        f"wrote {path} and {path.parent / 'genai_config.json'}: {config.layers} layers, {config.dtype}, "
        f"{config.num_heads} heads over {config.kv_num_heads}, head size {config.head_size}, context {config.max_position}"
    )
    return 0


def export_demo(args: argparse.Namespace) -> int:
    import onnx

    from sparse_attention_op.cli.demo import build_demo_model

    args.output.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build_demo_model(), str(args.output))
    print(f"wrote {args.output}")
    return 0


def adapters(args: argparse.Namespace) -> int:
    from sparse_attention_op.webgpu.device import describe, list_adapters, no_adapter_reason

    found = list_adapters()
    if not found:
        raise RuntimeError(no_adapter_reason())
    if args.native:
        # OpenGL adapters lack what the kernels need (storage limits, compute robustness).
        found = [a for a in found if a.info.get("backend_type") != "OpenGL"]
        if not found:
            raise RuntimeError("no wgpu adapter on a native backend (Vulkan, Metal, D3D12), only OpenGL ones")
    for adapter in found:
        print(describe(adapter))
    return 0


def demo(args: argparse.Namespace) -> int:
    from sparse_attention_op.cli.demo import run_demo

    if args.model is not None and not (Path(args.model) / "genai_config.json").is_file():
        raise ValueError(f"--model {args.model}: the demo runs an ORT GenAI decoder folder (such as models/phi3-small-tiny)")
    return 0 if run_demo(args.model, prompt_len=args.prompt, steps=args.steps) else 1


def _write_json(document, destination: str) -> None:
    text = json.dumps(document, indent=2, default=str)
    if destination == "-":
        print(text)
        return
    Path(destination).write_text(text + "\n")
    print(f"wrote {destination}", file=sys.stderr)
