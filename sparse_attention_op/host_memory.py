"""Large host allocations kept warm between calls (glibc's malloc settings).

The PyOp bridge copies every input of an op into a fresh numpy array, and ONNX Runtime
copies every output back (docs/design.md, "The graph around the op"). A prompt's query
alone is 134 MB at 8192 tokens of the Phi-3-small shape. glibc serves a block above its
mmap threshold (dynamic, at most 32 MiB by default) with fresh pages from the kernel, which
are faulted in and zeroed on first touch, and returns them at ``free``: every call pays the
faults again. Measured on this project's 2-core VM, allocating and filling 134 MB took
45.8 ms that way against 14.3 ms with the settings below (33.5 MB: 8.3 against 4.9 ms).

:func:`keep_large_blocks` raises the mmap threshold so such blocks come from the heap, and
the trim threshold so freed ones stay there for the next call. It is process-wide: the
process keeps up to its largest calls' worth of freed memory instead of returning it (as
ONNX Runtime's own arena does). ``SAO_HOST_HEAP=system`` leaves glibc's settings alone;
other C libraries are left alone too.

Only the main thread's heap can hold such blocks: glibc gives every other thread an arena
of at most 64 MiB, so a block above that is still mapped fresh when ``run`` is called from
another thread (measured with ``mallinfo2``: a 134 MiB block from a worker thread).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import threading

#: glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: Blocks below this come from the heap (a 131072-row past of 8 heads is 512 MiB).
MMAP_THRESHOLD = 1 << 30
#: Freed memory at the heap's top is kept up to this much before glibc trims it.
TRIM_THRESHOLD = (1 << 31) - 1  # mallopt takes an int

_lock = threading.Lock()
_applied: bool | None = None
log = logging.getLogger(__name__)


def keep_large_blocks() -> bool:
    """Apply the settings once per process; whether they are in force."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


def _apply() -> bool:
    if os.environ.get("SAO_HOST_HEAP") == "system" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # pragma: no cover - a glibc without mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Trim first: a kept threshold without it would hand freed blocks back at once.
    if not mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD):
        log.debug("glibc refused the trim threshold; its heap settings are left as they were")
        return False
    if not mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
        log.debug("glibc refused the mmap threshold; large blocks keep coming from mmap (only the trim threshold is raised)")
        return False
    return True
