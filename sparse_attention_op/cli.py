"""Command line: ``python -m sparse_attention_op {adapters,demo,export-demo}``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _adapters(args) -> int:
    from .webgpu.device import describe, list_adapters

    adapters = list_adapters()
    if args.native:
        # OpenGL adapters lack what the kernels need (storage limits, compute robustness).
        adapters = [a for a in adapters if a.info.get("backend_type") != "OpenGL"]
    if not adapters:
        print("no wgpu adapter found" + (" on a native backend (Vulkan, Metal, D3D12)" if args.native else ""), file=sys.stderr)
        return 1
    for adapter in adapters:
        print(describe(adapter))
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    reports = run_demo(args.model, prompt_len=args.prompt, decode_steps=args.steps)
    return 0 if max(r.max_error for r in reports) < 2e-3 else 1


def _export_demo(args) -> int:
    import onnx

    from .demo import build_demo_model

    args.output.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(build_demo_model(), str(args.output))
    print(f"wrote {args.output}")
    return 0


def main(argv=None) -> int:
    from .demo import DEFAULT_MODEL

    parser = argparse.ArgumentParser(prog="sparse-attention-op", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    adapters = commands.add_parser("adapters", help="list the wgpu adapters, best first (exit 1 if none)")
    adapters.add_argument("--native", action="store_true", help="only Vulkan, Metal and D3D12 adapters count")
    adapters.set_defaults(func=_adapters)
    demo = commands.add_parser("demo", help="run the bundled model on WebGPU and check it against the reference")
    demo.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="demo model (built in memory if the file is missing)")
    demo.add_argument("--prompt", type=int, default=48, help="prompt length (at most the model's cache length)")
    demo.add_argument("--steps", type=int, default=16, help="decode steps after the prompt")
    demo.set_defaults(func=_demo)
    export = commands.add_parser("export-demo", help="write the demo model")
    export.add_argument("output", type=Path, nargs="?", default=DEFAULT_MODEL)
    export.set_defaults(func=_export_demo)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
