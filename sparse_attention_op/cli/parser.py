"""sparse-attention-op: run ONNX models with com.microsoft.SparseAttention on WebGPU.

MODEL is an .onnx file or an ORT GenAI model folder (its genai_config.json names the decoder).
Every command exits 0 on success and 1 with one line on stderr on failure (2 for a usage
mistake); --traceback shows the whole Python traceback instead.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from sparse_attention_op.cli import commands
from sparse_attention_op.cli.arguments import UsageError, non_negative, positive
from sparse_attention_op.generation.loop import Sampling
from sparse_attention_op.ort.providers import EPS

EPILOG = """examples:
  sparse-attention-op info
  sparse-attention-op inspect models/phi3-small-tiny
  sparse-attention-op run models/phi3-small-tiny --batch 2 --seq 40 --compare-ort
  sparse-attention-op generate models/phi3-small-tiny --prompt-ids 5,17,33 --max-new-tokens 32 --compare-ort --json out.json
  sparse-attention-op bench --quick --ort --plot quick.png
  sparse-attention-op export decoder my-model --layers 6 --dtype float16
"""


def _token_ids(text: str) -> list[int]:
    """``5,17,33`` (or ``"5 17 33"``) -> [5, 17, 33]; an empty part is a mistake, not skipped."""
    parts = re.split(r"\s*,\s*|\s+", text.strip())
    if not text.strip() or any(not part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected non-negative token ids separated by commas or spaces, such as 5,17,33, got {text!r}")
    return [int(part) for part in parts]


def _dim(text: str) -> tuple[str, int]:
    """``batch_size=2`` -> ("batch_size", 2)."""
    name, _, size = text.partition("=")
    try:
        return name, int(size)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected NAME=SIZE such as total_sequence_length=64, got {text!r}") from None


#: generate's options that only sampling reads, and their defaults: Sampling's own (None in args: not given).
SAMPLING_DEFAULTS = {name: getattr(Sampling(), name) for name in ("temperature", "top_k", "top_p")}


def resolve_generate_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """Refuse generate's options that would be ignored (``parser.error``); fill sampling's defaults."""
    given = [f"--{name.replace('_', '-')}" for name in (*SAMPLING_DEFAULTS, "seed") if getattr(args, name) is not None]
    if given and not args.sample:
        parser.error(f"{', '.join(given)} only apply with --sample (greedy decoding reads none of them)")
    if args.no_stop and args.stop_ids is not None:
        parser.error("--no-stop and --stop-ids contradict each other: give one of them")
    for name, default in SAMPLING_DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)


def build_parser() -> argparse.ArgumentParser:
    from sparse_attention_op.benchmarking import sweep
    from sparse_attention_op.cli.demo import DEFAULT_MODEL
    from sparse_attention_op.cli.export import add_decoder_options, add_graph_options

    parser = argparse.ArgumentParser(
        prog="sparse-attention-op", description=__doc__, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--traceback", action="store_true", help="on failure, print the whole traceback instead of one line")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def model_argument(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", metavar="MODEL", help="an .onnx file or an ORT GenAI model folder")

    def ep_option(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument(
            "--ep",
            choices=EPS,
            default="cpu",
            help=f"where {what} (default %(default)s; webgpu: ORT's WebGPU plugin EP, pip install onnxruntime-ep-webgpu)",
        )

    def kv_check_option(p: argparse.ArgumentParser, default: str) -> None:
        p.add_argument("--kv-check", choices=["exact", "fast"], default=default, help="the cache check (default %(default)s)")

    def traceback_option(p: argparse.ArgumentParser) -> None:
        # Also after the command's name, where users put it; SUPPRESS keeps the main parser's value otherwise.
        p.add_argument("--traceback", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)

    def command(name: str, function, help_text: str, **kwargs) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_text, description=help_text, **kwargs)
        p.set_defaults(func=function, subparser=p)
        traceback_option(p)
        return p

    p = command(
        "info",
        commands.info,
        "versions, wgpu adapters, the chosen adapter's features, limits and tuning, and which pass runs a prompt and a decode step",
    )
    p.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT ('-': stdout)")

    p = command(
        "inspect",
        commands.inspect,
        "SparseAttention nodes, their attributes and inputs, layout densities, what runs where, "
        "and whether create_session loads the model (exit 1 if it would refuse it)",
    )
    model_argument(p)
    p.add_argument("--json", metavar="OUT", help="write the report as JSON to OUT ('-': stdout)")
    ep_option(p, "the other nodes would run: webgpu asks ORT by making a session")

    p = command("run", commands.run, "run MODEL once on WebGPU with random (or given) feeds and report every output")
    model_argument(p)
    p.add_argument("--feeds", type=Path, metavar="X.npz", help="feeds by graph input name (np.savez); default: random, unit scale")
    p.add_argument("--compare-ort", action="store_true", help="also run ONNX Runtime's own CPU kernels and compare every output")
    p.add_argument("--batch", type=positive, default=1, help="rows of random feeds (default %(default)s)")
    p.add_argument("--seq", type=positive, default=8, help="new tokens per row (default %(default)s)")
    p.add_argument("--past", type=non_negative, default=0, help="history rows before them (default %(default)s: a prompt)")
    p.add_argument("--capacity", type=positive, default=None, help="rows of each KV cache input (default: past + seq)")
    p.add_argument("--head-size", type=positive, default=None, help="head size, where the model's shapes do not say it")
    p.add_argument("--dim", type=_dim, action="append", default=[], metavar="NAME=SIZE", help="size of a symbolic dim (repeatable)")
    p.add_argument("--seed", type=non_negative, default=0, help="seed of the random feeds (default %(default)s)")
    kv_check_option(p, "exact")
    p.add_argument("--repeat", type=positive, default=1, help="runs to time (default %(default)s; the first compiles kernels)")
    p.add_argument("--save", type=Path, metavar="OUT.npz", help="write the outputs")
    ep_option(p, "the other nodes run")

    p = command("generate", commands.generate, "generate tokens from prompt ids with a GenAI-convention decoder (shared KV buffers)")
    model_argument(p)
    p.add_argument(
        "--prompt-ids",
        type=_token_ids,
        action="append",
        required=True,
        metavar="IDS",
        help="one prompt as comma-separated token ids; repeat for a batch (rows may differ in length)",
    )
    p.add_argument("--max-new-tokens", type=positive, default=32, help="new tokens per row at most (default %(default)s)")
    p.add_argument("--compare-ort", action="store_true", help="check the tokens against ONNX Runtime's own CPU kernels (exit 1 if they differ)")
    p.add_argument("--json", metavar="OUT", help='write {"tokens": [[new ids per row]], "ms_per_token": x} to OUT (\'-\': stdout)')
    p.add_argument(
        "--stop-ids",
        type=_token_ids,
        default=None,
        metavar="IDS",
        help="a row stops after emitting one of these (default: a GenAI folder's eos_token_id; none for a bare .onnx)",
    )
    p.add_argument("--no-stop", action="store_true", help="never stop before --max-new-tokens")
    p.add_argument("--sample", action="store_true", help="sample instead of greedy argmax")
    p.add_argument("--temperature", type=float, default=None, help=f"with --sample (default {SAMPLING_DEFAULTS['temperature']})")
    p.add_argument("--top-k", type=non_negative, default=None, help="with --sample: keep the k likeliest tokens (default 0: all)")
    p.add_argument("--top-p", type=float, default=None, help=f"with --sample: nucleus mass (default {SAMPLING_DEFAULTS['top_p']})")
    p.add_argument("--seed", type=non_negative, default=None, help="with --sample: seed of the draws")
    p.add_argument("--capacity", type=positive, default=None, help="rows of each KV buffer (default: longest prompt + max new tokens)")
    kv_check_option(p, "fast")
    ep_option(p, "the other nodes run")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")

    p = command(
        "bench",
        commands.bench,
        "the benchmark sweep (prefill and decode against torch and ORT CPU), with a PNG plot",
        epilog=sweep.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sweep.build_parser(p)

    p = command("export", None, "write test graphs and small decoders")
    exports = p.add_subparsers(dest="what", required=True, metavar="WHAT")
    graph = exports.add_parser(
        "graph",
        help="a one-node SparseAttention graph, and random feeds for it (--inputs)",
        description="a one-node SparseAttention graph (the layout as initializers), and random feeds for it",
    )
    add_graph_options(graph)
    graph.set_defaults(func=commands.export_graph)
    decoder = exports.add_parser(
        "decoder",
        help="an ORT GenAI model folder with a small Phi-3-small-style decoder",
        description="an ORT GenAI model folder (model.onnx, genai_config.json) with a decoder like those in models/, fields overridable",
    )
    add_decoder_options(decoder)
    decoder.set_defaults(func=commands.export_decoder)
    demo_model = exports.add_parser(
        "demo",
        help="the one-block demo model (models/demo_decoder_attention.onnx)",
        description="Write the one-block demo model, the file the package ships, to OUTPUT.",
    )
    demo_model.add_argument(
        "output",
        type=Path,
        nargs="?",
        default=DEFAULT_MODEL,
        metavar="OUTPUT",
        help=f"where to write it (default {DEFAULT_MODEL}, which it overwrites)",
    )
    demo_model.set_defaults(func=commands.export_demo)
    for export_parser in (graph, decoder, demo_model):
        export_parser.set_defaults(subparser=export_parser)  # usage errors show this command's usage
        traceback_option(export_parser)

    p = command("adapters", commands.adapters, "list the wgpu adapters, best first (exit 1 if none)")
    p.add_argument("--native", action="store_true", help="only Vulkan, Metal and D3D12 adapters count")

    p = command("demo", commands.demo, "generate with the bundled multi-layer decoder on WebGPU, checked against ORT CPU and the reference")
    p.add_argument("--model", type=Path, default=None, help="a GenAI model folder (default: models/phi3-small-tiny)")
    p.add_argument("--prompt", type=positive, default=40, help="the longer prompt's length (default %(default)s)")
    p.add_argument("--steps", type=positive, default=24, help="new tokens per row (default %(default)s)")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    import onnxruntime as ort

    # ORT's own error log would repeat, in colour and before it, what the one line says.
    ort.set_default_logger_severity(4)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate":
        resolve_generate_args(args, args.subparser)
    if args.command == "bench":
        from sparse_attention_op.benchmarking import sweep

        sweep.resolve_args(args, args.subparser)
        args.argv = argv[argv.index("bench") + 1 :]
    try:
        return args.func(args)
    except UsageError as error:
        if args.traceback:
            raise
        args.subparser.error(str(error))  # usage and the message on stderr, exit 2
    except KeyboardInterrupt:
        print("sparse-attention-op: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # every failure: one line, exit 1
        if args.traceback:
            raise
        message = " ".join(str(error).split()) or type(error).__name__
        print(f"sparse-attention-op {args.command}: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
