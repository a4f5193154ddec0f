"""Where a command-line MODEL argument points: an .onnx file, or an ORT GenAI model folder.

A GenAI folder holds ``genai_config.json``, whose ``model.decoder.filename`` names the
decoder's ONNX file. Every failure raises :class:`ModelFileError` with one line that says
what is wrong with which path.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import onnx

GENAI_CONFIG = "genai_config.json"


class ModelFileError(ValueError):
    """The MODEL argument does not lead to a readable ONNX model."""


@dataclass(frozen=True)
class ModelFiles:
    onnx_path: Path
    genai_config: dict | None = None  # the parsed genai_config.json of a GenAI folder

    @property
    def decoder_config(self) -> dict:
        """``model.decoder`` of the GenAI config (empty for a bare .onnx file)."""
        return ((self.genai_config or {}).get("model") or {}).get("decoder") or {}


def resolve(path: str | Path) -> ModelFiles:
    """The ONNX file (and GenAI config) that ``path`` names."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(f"{path}: no such file or folder")
    if path.is_dir():
        config_path = path / GENAI_CONFIG
        if not config_path.is_file():
            raise ModelFileError(f"{path} is a folder without {GENAI_CONFIG}: pass an .onnx file or an ORT GenAI model folder")
        try:
            config = json.loads(config_path.read_text())
        except (OSError, ValueError) as error:
            raise ModelFileError(f"{config_path}: not valid JSON ({error})") from None
        filename = _decoder_filename(config, config_path)
        if not filename:
            raise ModelFileError(f"{config_path} names no decoder file (model.decoder.filename)")
        onnx_path = path / filename
        if not onnx_path.is_file():
            raise ModelFileError(f"{config_path} names decoder {filename!r}, which is not in {path}")
        return ModelFiles(onnx_path, config)
    return ModelFiles(path)


def load(files: ModelFiles, *, with_weights: bool = True) -> onnx.ModelProto:
    """The model, parsed. ``with_weights=False`` leaves external weight files unread (inspection
    of a multi-gigabyte export should not read gigabytes)."""
    try:
        model = onnx.load(str(files.onnx_path), load_external_data=with_weights)
    except Exception as error:  # protobuf's DecodeError, or a missing external data file
        kind = type(error).__name__
        if "Decode" in kind or "protobuf" in type(error).__module__:
            raise ModelFileError(f"{files.onnx_path} is not an ONNX model (it does not parse as one)") from None
        raise ModelFileError(f"{files.onnx_path}: cannot load ({kind}: {' '.join(str(error).split())})") from None
    # Protobuf parses an empty or truncated file as a model with nothing in it.
    if not model.ir_version or not model.HasField("graph"):
        raise ModelFileError(f"{files.onnx_path} is not an ONNX model (no IR version or graph)")
    return model


def _decoder_filename(config, config_path: Path) -> str | None:
    """``model.decoder.filename``; a level that is not a JSON object is named, not skipped."""
    node = config
    for where, key in (("the file", "model"), ("model", "decoder"), ("model.decoder", "filename")):
        if not isinstance(node, dict):
            raise ModelFileError(f"{config_path}: {where} must be a JSON object, got {type(node).__name__}")
        node = node.get(key, {})
    return node if isinstance(node, str) else None
