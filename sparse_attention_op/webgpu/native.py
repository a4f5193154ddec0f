"""wgpu-native's functions as wgpu-py binds them, for the hot paths that call them directly.

Two paths of every call go around wgpu-py's Python classes: buffer maps (mapping.py) and
the recording of a call's commands (recording.py). Both call the function table wgpu-py
itself uses (``libf``): each function there reports a validation error of the call it
makes as a ``wgpu.GPUError``, as wgpu-py's own methods do. Where this wgpu version lacks
these internals, both paths fall back to wgpu-py's public API; an environment variable
set to ``public`` chooses the fallback anyway, for measuring the two against each other.
"""

from __future__ import annotations

import os

try:  # wgpu-py's native backend: its cffi handle and the library functions it binds.
    from wgpu.backends.wgpu_native._api import libf
    from wgpu.backends.wgpu_native._ffi import ffi, lib
except ImportError:  # pragma: no cover - another wgpu version
    libf = ffi = lib = None

AVAILABLE = libf is not None


def enabled(variable: str) -> bool:
    """Whether a direct path is on: the internals exist and ``variable`` is not ``public``."""
    return AVAILABLE and os.environ.get(variable) != "public"
