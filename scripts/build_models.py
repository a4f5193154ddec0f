#!/usr/bin/env python3
"""Write the bundled decoders into models/ (or check that the committed ones are current), or
write a decoder of Phi-3-small's real width anywhere else.

    python scripts/build_models.py            # (re)write models/<name>/{model.onnx,genai_config.json}
    python scripts/build_models.py --check    # exit 1 if a committed file differs from a fresh build
    python scripts/build_models.py --real-width --layers 2 --out /tmp/phi3-small-2
        # Phi-3-small's shape (int4 weights, float16), 2 of its 32 layers: model.onnx,
        # model.onnx.data (the weights) and genai_config.json in /tmp/phi3-small-2
    python scripts/build_models.py --real-width --layers 32 --dense-every 1 --out /tmp/dense-32
        # the same shape with every layer GroupQueryAttention (no SparseAttention)

Each folder is a complete ORT GenAI model folder in the convention of
sparse_attention_op.testing.decoder_models (Phi-3-small's structure; fixed random weights).
The bundled builds are deterministic, so ``--check`` (and tests/test_models.py) catch a
change of the builder that the committed files do not reflect. Real-width folders are
gigabytes (1.05 GB of embedding and logits head, 90 MB a layer: 1.2 GB for 2 layers, 3.9 GB
for 32) and are never committed: --out must lie outside models/. They are written one tensor
at a time, so memory stays near 1 GB whatever the depth.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tqdm import tqdm

from sparse_attention_op.testing.decoder_models import (
    BUNDLED_MODELS,
    genai_config_text,
    initializer_bytes,
    model_bytes,
    phi3_small_config,
    write_model_folder,
)

MODELS = Path(__file__).resolve().parent.parent / "models"
REAL_WIDTH_ONLY = ("layers", "max_position", "static_cache", "seed", "dense_every")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on any difference")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="parent folder of the bundled models (default: the repository's models/); with --real-width, the model folder itself (required)",
    )
    parser.add_argument("--real-width", action="store_true", help="write Phi-3-small's real shape (int4 weights) to --out")
    parser.add_argument("--layers", type=int, default=None, help="real width: how many layers (Phi-3-small has 32)")
    parser.add_argument("--max-position", type=int, default=None, help="real width: context length (default 8192)")
    parser.add_argument("--static-cache", type=int, default=None, help="real width: rows every past/present declares (default: symbolic)")
    parser.add_argument("--seed", type=int, default=None, help="real width: the weights' seed (default 0)")
    parser.add_argument(
        "--dense-every",
        type=int,
        default=None,
        help="real width: layer i is GroupQueryAttention when (i + 1) %% N == 0 (Phi-3-small: 2, the default; "
        "1 makes every layer dense, a model ORT's WebGPU EP runs whole: the anchor for what host-side attention costs)",
    )
    parser.add_argument("names", nargs="*", help=f"bundled models to write or check (default: all of {sorted(BUNDLED_MODELS)})")
    args = parser.parse_args(argv)
    if args.real_width:
        if args.check or args.names:
            parser.error("--real-width writes one model folder: it takes neither --check nor model names")
        if args.out is None or args.layers is None:
            parser.error("--real-width needs --layers N and --out FOLDER")
        if args.out.resolve().is_relative_to(MODELS):
            parser.error(f"--out {args.out} lies in {MODELS}: real-width models are gigabytes and must not be committed")
    else:
        given = [f"--{name.replace('_', '-')}" for name in REAL_WIDTH_ONLY if getattr(args, name) is not None]
        if given:
            parser.error(f"{', '.join(given)} only apply with --real-width")
        unknown = [name for name in args.names if name not in BUNDLED_MODELS]
        if unknown:
            parser.error(f"unknown model(s) {unknown}; known: {sorted(BUNDLED_MODELS)}")
    return args


def build_bundled(names: list[str], out: Path, check: bool) -> int:
    stale = []
    for name in names:
        config = BUNDLED_MODELS[name]
        files = {"model.onnx": model_bytes(config), "genai_config.json": genai_config_text(config).encode()}
        folder = out / name
        for filename, content in files.items():
            path = folder / filename
            if check:
                if not path.is_file() or path.read_bytes() != content:
                    stale.append(str(path))
                continue
            folder.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            print(f"wrote {path} ({len(content) / 1e6:.2f} MB)")
    if stale:
        print("stale (rebuild with python scripts/build_models.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    if check:
        print(f"up to date: {', '.join(names)}")
    return 0


def build_real_width(args: argparse.Namespace) -> int:
    overrides = {name: getattr(args, name) for name in REAL_WIDTH_ONLY if getattr(args, name) is not None}
    try:
        config = phi3_small_config(**overrides)
        total = initializer_bytes(config)  # validates the config
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"{config.layers} layers") as bar:
        path = write_model_folder(config, args.out, external_data=True, progress=lambda name, size: bar.update(size))
    seconds = time.perf_counter() - start
    data = path.with_name(path.name + ".data")
    size = path.stat().st_size + data.stat().st_size
    print(f"wrote {path} and {data.name}: {size / 1e9:.2f} GB ({config.layers} layers, weights {config.weight_source}) in {seconds:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.real_width:
        return build_real_width(args)
    return build_bundled(args.names or sorted(BUNDLED_MODELS), args.out or MODELS, args.check)


if __name__ == "__main__":
    sys.exit(main())
