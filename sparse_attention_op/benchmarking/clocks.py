"""The GPU's SM clock, read through NVIDIA's management library (NVML) where there is one.

A GPU time means little without the clock it ran at. The H200 idles at 345 MHz and boosts
to 1980 MHz only under sustained load; a decode loop keeps it busy a small part of each
step, so the loop's GPU work runs at the idle clock. Measured on 2026-12-02 (docs/benchmarks-archive.md):
decode at history 131000 took 0.526 ms of GPU time per step inside a session's decode loop,
with nvidia-smi reading 345 MHz throughout, against 0.149 ms after a warmer
(scripts/tune_kernels.py). The benchmarks read the clock after each timed step and report
it next to the times.

NVML directly (ctypes), not nvidia-smi: one call of a few microseconds, no process to start
and no pipe whose buffered lines arrive late. Reads only: nothing here sets clocks or any
other setting of the card. Where the library or a GPU is missing (lavapipe, other vendors)
:func:`sm_clock` gives a reader that answers None, and the tables print "-". The GPU read
is NVML's device 0, the only one on the machines these benchmarks ran on.
"""

from __future__ import annotations

import ctypes
import statistics

#: nvmlClockType_t's NVML_CLOCK_SM.
_NVML_CLOCK_SM = 1
_LIBRARY = "libnvidia-ml.so.1"


class SmClock:
    """Reads one GPU's current SM clock (MHz) through an NVML library; None where it cannot."""

    def __init__(self, library=None, index: int = 0):
        self._library = library
        self._device = ctypes.c_void_p()
        self._mhz = ctypes.c_uint()
        if library is not None:
            ok = library.nvmlInit_v2() == 0 and library.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(self._device)) == 0
            if not ok:
                self._library = None

    @property
    def available(self) -> bool:
        return self._library is not None

    def read(self) -> int | None:
        if self._library is None or self._library.nvmlDeviceGetClockInfo(self._device, _NVML_CLOCK_SM, ctypes.byref(self._mhz)) != 0:
            return None
        return int(self._mhz.value)


def sm_clock(library_name: str = _LIBRARY) -> SmClock:
    """A reader of device 0's SM clock, or one that answers None without NVML."""
    try:
        library = ctypes.CDLL(library_name)
        for name, argtypes in (
            ("nvmlInit_v2", []),
            ("nvmlDeviceGetHandleByIndex_v2", [ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]),
            ("nvmlDeviceGetClockInfo", [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_uint)]),
        ):
            function = getattr(library, name)
            function.argtypes, function.restype = argtypes, ctypes.c_int
    except (OSError, AttributeError):
        library = None
    return SmClock(library)


def median_mhz(readings) -> float | None:
    """The median of the readings that are not None; None if there are none."""
    values = [r for r in readings if r is not None]
    return float(statistics.median(values)) if values else None
