#!/usr/bin/env python3
"""Write the bundled decoders into models/ (or check that the committed ones are current).

    python scripts/build_models.py            # (re)write models/<name>/{model.onnx,genai_config.json}
    python scripts/build_models.py --check    # exit 1 if a committed file differs from a fresh build

Each folder is a complete ORT GenAI model folder in the convention of
sparse_attention_op.testing.decoder_models (Phi-3-small's structure, scaled down; fixed random
weights). The builds are deterministic, so ``--check`` (and tests/test_models.py) catch a
change of the builder that the committed files do not reflect.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from sparse_attention_op.testing.decoder_models import BUNDLED_MODELS, genai_config_text, model_bytes

MODELS = Path(__file__).resolve().parent.parent / "models"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on any difference")
    parser.add_argument("--out", type=Path, default=MODELS, help="parent folder (default: the repository's models/)")
    parser.add_argument("names", nargs="*", default=sorted(BUNDLED_MODELS), help=f"which models (default: all of {sorted(BUNDLED_MODELS)})")
    args = parser.parse_args()
    unknown = [name for name in args.names if name not in BUNDLED_MODELS]
    if unknown:
        parser.error(f"unknown model(s) {unknown}; known: {sorted(BUNDLED_MODELS)}")
    stale = []
    for name in args.names:
        config = BUNDLED_MODELS[name]
        files = {"model.onnx": model_bytes(config), "genai_config.json": genai_config_text(config).encode()}
        folder = args.out / name
        for filename, content in files.items():
            path = folder / filename
            if args.check:
                if not path.is_file() or path.read_bytes() != content:
                    stale.append(str(path))
                continue
            folder.mkdir(parents=True, exist_ok=True)
            path.write_bytes(content)
            print(f"wrote {path} ({len(content) / 1e6:.2f} MB)")
    if stale:
        print("stale (rebuild with python scripts/build_models.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    if args.check:
        print(f"up to date: {', '.join(args.names)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
