"""The private onnxruntime-extensions API the bridge relies on, checked in one place.

The array output path needs three things the package does not document: the invocation
hook setter (``PyCustomOpDef.install_hooker``), the stock dispatcher it replaces
(``_ocos._on_pyop_invocation``, which keeps serving every other PyOp) and the id an
``onnx_op`` registers under (``Opdef._id``). They are stable across the tested releases
(pyproject.toml bounds the dependency to them); outside those, :func:`check_version` fails
with a message that says so, rather than the bridge failing somewhere inside a session.
"""

from __future__ import annotations

from importlib import metadata

from onnxruntime_extensions import PyCustomOpDef, _ocos

#: Releases the bridge was tested with (the C++ side of 0.15.2 was read for the copy path).
TESTED = ((0, 15),)


class UnsupportedExtensionsError(ImportError):
    """The installed onnxruntime-extensions lacks what the bridge relies on."""


def _version() -> tuple[int, ...]:
    text = metadata.version("onnxruntime-extensions")
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def check_version() -> None:
    version = _version()
    missing = [name for name, present in (
        ("PyCustomOpDef.install_hooker", hasattr(PyCustomOpDef, "install_hooker")),
        ("_ocos._on_pyop_invocation", hasattr(_ocos, "_on_pyop_invocation")),
    ) if not present]
    if version[:2] not in TESTED or missing:
        tested = ", ".join(".".join(map(str, v)) + ".x" for v in TESTED)
        detail = f"; missing {', '.join(missing)}" if missing else ""
        raise UnsupportedExtensionsError(
            f"onnxruntime-extensions {'.'.join(map(str, version))} is not supported (tested: {tested}{detail}): "
            "the bridge uses its PyOp invocation hook. Install a tested release: pip install 'onnxruntime-extensions>=0.15,<0.16'"
        )


def stock_invocation(k_id, feed, attributes):
    """The package's own dispatcher, for PyOps that are not ours."""
    return _ocos._on_pyop_invocation(k_id, feed, attributes)


def install_invocation_hook(hook) -> None:
    PyCustomOpDef.install_hooker(hook)
