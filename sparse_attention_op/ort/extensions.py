"""What the bridge relies on in onnxruntime-extensions, checked in one place.

The bridge's op is added to the library's own list of ops through ``AddExternalCustomOp``,
a C function the library exports (custom_op.py). Its ``RegisterCustomOps`` adds those ops to
the ``ai.onnx.contrib`` domain of every session that registers the library, after its own;
an added op whose name one of the library's Python ops also has would make that loop spin
forever (read in 0.15's ``ops_registry.cc``), so the bridge's names are its own. The
releases tested are bounded in pyproject.toml; outside them :func:`library` fails with a
message that says so, rather than the bridge failing somewhere inside a session.
"""

from __future__ import annotations

import ctypes
from importlib import metadata

from onnxruntime_extensions import get_library_path

#: Releases the bridge was tested with.
TESTED = ((0, 15),)


class UnsupportedExtensionsError(ImportError):
    """The installed onnxruntime-extensions lacks what the bridge relies on."""


def _version() -> tuple[int, ...]:
    text = metadata.version("onnxruntime-extensions")
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def library() -> ctypes.CDLL:
    """The loaded onnxruntime-extensions library (the very copy sessions register: the
    dynamic loader hands out one copy per file), checked to be a tested release that
    exports ``AddExternalCustomOp``."""
    version = _version()
    handle = ctypes.CDLL(get_library_path())
    exported = hasattr(handle, "AddExternalCustomOp")
    if version[:2] not in TESTED or not exported:
        tested = ", ".join(".".join(map(str, v)) + ".x" for v in TESTED)
        detail = "" if exported else "; it does not export AddExternalCustomOp"
        raise UnsupportedExtensionsError(
            f"onnxruntime-extensions {'.'.join(map(str, version))} is not supported (tested: {tested}{detail}). "
            "Install a tested release: pip install 'onnxruntime-extensions>=0.15,<0.16'"
        )
    return handle
