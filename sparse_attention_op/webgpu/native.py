"""wgpu-native's functions as wgpu-py binds them, for the hot paths that call them directly.

Two paths of every call go around wgpu-py's Python classes: buffer maps (mapping.py) and
the recording of a call's commands (recording.py). Both call wgpu-native's functions
(``lib``) inside one :class:`ErrorCapture` each: the errors wgpu-native reports meanwhile
raise as a ``wgpu.GPUError``, as wgpu-py's own methods (and its per-function wrappers,
``libf``) would raise them, at a cost of one capture per map or recording instead of one
per function (a decode step makes about 25 such calls). Where this wgpu version lacks these
internals, both paths fall back to wgpu-py's public API; an environment variable set to
``public`` chooses the fallback anyway, for measuring the two against each other.
"""

from __future__ import annotations

import os

import wgpu

try:  # wgpu-py's native backend: its cffi handle, the library functions it binds, its error sink.
    from wgpu.backends.wgpu_native._api import error_handler, libf
    from wgpu.backends.wgpu_native._ffi import ffi, lib
    from wgpu.backends.wgpu_native._helpers import ERROR_TYPES
except ImportError:  # pragma: no cover - another wgpu version
    libf = ffi = lib = error_handler = None
    ERROR_TYPES = {}

#: The internals the direct paths use, wgpu-py's error sink's capture stack included.
AVAILABLE = libf is not None and hasattr(error_handler, "_get_proxy_stack")


class ErrorCapture:
    """Errors wgpu-native reports during a run of direct ``lib`` calls, raised at the end.

    ``libf`` wraps every function in its own capture of the errors reported during it,
    which costs a few microseconds a call. A run of calls that belong together (one call's
    recording) opens one capture instead: whatever wgpu-native reports meanwhile lands in
    it (calls through ``libf`` in between keep their own), and :meth:`close` raises the last
    error as the ``wgpu.GPUError`` that ``libf`` would have raised. An encoder's errors are
    reported when it is finished, and submitting the command buffer of a failed one aborts
    the process: check :meth:`reported` between the two.
    Per thread, opened and closed on the same one.
    """

    def __init__(self, name: str):
        self._name = name
        error_handler.capture(name)
        self._open = True

    def reported(self) -> bool:
        """Whether an error was reported since the capture opened (it is raised by close)."""
        stack = error_handler._get_proxy_stack()
        return bool(stack) and stack[-1].name == self._name and stack[-1].message is not None

    def close(self) -> None:
        """End the capture; raise the error reported meanwhile, if any."""
        found = self._end()
        if found is not None:
            kind, message = found
            raise ERROR_TYPES.get(kind, wgpu.GPUError)(message)

    def discard(self) -> None:
        """End the capture without raising (another exception is on its way): log what it
        caught, as wgpu-py logs errors nothing captures."""
        found = self._end()
        if found is not None:
            error_handler.log_error(found[1])

    def _end(self):
        """(kind, message) of the error reported meanwhile, or None; idempotent."""
        if not self._open:
            return None
        self._open = False
        return error_handler.release(self._name)


def enabled(variable: str) -> bool:
    """Whether a direct path is on: the internals exist and ``variable`` is not ``public``."""
    return AVAILABLE and os.environ.get(variable) != "public"
