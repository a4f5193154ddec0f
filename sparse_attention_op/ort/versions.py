"""The version of the ONNX Runtime that owns an ``OrtApi`` table (custom_op.py asks).

A process can hold two copies of ORT: the Python module's own, and the shared library ORT
GenAI loads. A kernel is handed the function table of the one that created it, and the
table carries no version, while newer functions sit in slots an older table does not have.
The shared object the table lies in says which ORT it is (``dladdr``): the onnxruntime
Python module's extension, whose version is ``onnxruntime.__version__``, or a
``libonnxruntime`` that exports ``OrtGetApiBase``, whose ``GetVersionString`` says. Where
neither answers (no ``dladdr``, as on Windows; another library), the version is unknown and
callers keep to the functions every ORT they support has.
"""

from __future__ import annotations

import ctypes
import functools
import os


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def ort_version_at(address: int) -> tuple[int, int] | None:
    """(major, minor) of the ORT whose library holds ``address``, or None if it cannot be told."""
    path = _library_of(address)
    return None if path is None else _version_of_library(path)


def _library_of(address: int) -> str | None:
    try:
        dladdr = ctypes.CDLL(None).dladdr
    except (OSError, AttributeError, TypeError):  # no dladdr (TypeError: CDLL(None) on Windows)
        return None
    dladdr.argtypes, dladdr.restype = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)], ctypes.c_int
    info = _DlInfo()
    if not dladdr(address, ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


@functools.lru_cache(maxsize=8)
def _version_of_library(path: str) -> tuple[int, int] | None:
    try:
        import onnxruntime
        from onnxruntime.capi import onnxruntime_pybind11_state as module
    except ImportError:
        module = None
    if module is not None and os.path.realpath(path) == os.path.realpath(module.__file__):
        return _parse(onnxruntime.__version__)
    try:
        get_base = ctypes.CDLL(path).OrtGetApiBase  # the library is loaded already: this only finds it
    except (OSError, AttributeError):
        return None
    get_base.argtypes, get_base.restype = [], ctypes.POINTER(ctypes.c_void_p)
    base = get_base()  # OrtApiBase: {GetApi, GetVersionString}
    if not base:
        return None
    text = ctypes.CFUNCTYPE(ctypes.c_char_p)(base[1])()
    return _parse(text.decode(errors="replace")) if text else None


def _parse(text: str) -> tuple[int, int] | None:
    parts = text.split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return None
