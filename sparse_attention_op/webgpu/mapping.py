"""Buffer maps that wait on the calling thread.

wgpu-py's ``map_async(...).sync_wait()`` hands the wait to the device's poll thread: a
token wakes that thread, which polls the device until the map's callback fires there, then
wakes the caller through a ``threading.Event``. Every read-back of a call pays for two
thread hand-offs and for the GIL the two threads then contend for. Dispatch, copy, map and
read of 16 KiB (``scripts/measure_platform.py --only wgpu``, docs/design.md section 3):
on a 2-core CPU machine (lavapipe), 212-216 us this way against 302-320 us through the
poll thread; on the H200 host 120-157 us against 200-226 us (BENCHMARKS.md).

This module maps through the wgpu-native functions wgpu-py itself binds (the request and
the wait within one capture of the errors they report, native.ErrorCapture): it asks for
the map, polls the device on the calling thread until the map's callback has run (a blocking
poll waits for the queue's last submission, which the call's work is), and views the
mapped range as a numpy array. wgpu-py's own bookkeeping of the buffer is bypassed, so a
buffer mapped here must only ever be mapped here. Where wgpu-py's native backend does not
have these internals (another wgpu version than pyproject allows), the public API serves;
``SAO_WGPU_MAPS=public`` chooses it anyway, for measuring the two against each other.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import wgpu

from sparse_attention_op.webgpu.native import ErrorCapture, enabled
from sparse_attention_op.webgpu.native import ffi as _ffi
from sparse_attention_op.webgpu.native import lib as _lib

#: A blocking poll returns once the queue's submissions are done, so a map over finished
#: work resolves in the first poll. More polls than this mean the map can never resolve.
_MAX_POLLS = 10_000


class MapError(wgpu.GPUError):
    """A buffer could not be mapped (the executor reports it as the GPU's failure)."""


#: Where a map's status lands: the callback writes it through the userdata pointer into an
#: int of the waiting thread's request (_Request), so no table or lock sits on the path.
#: Cells of maps that never resolved are kept here, as their callback may still come.
_abandoned_cells: list = []
#: Off (``SAO_WGPU_MAPS=public``): wgpu-py's own maps, for measuring the two paths.
NATIVE = enabled("SAO_WGPU_MAPS")


def _on_map(status, _message, userdata, _userdata2):
    _ffi.cast("int *", userdata)[0] = status


# One cffi callback for every map of the process: callbacks are costly to create and must
# outlive the maps they serve.
_callback = _ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)", _on_map) if _lib is not None else None


class _Request(threading.local):
    """A thread's map request: the status cell and the callback info pointing to it, made
    once (each cffi allocation parses its type name: a decode step maps once) and made anew
    only when a map leaves its cell to a callback that may still come."""

    def __init__(self):
        self.renew()

    def renew(self) -> None:
        self.cell = _ffi.new("int *", -1)
        self.info = _ffi.new(
            "WGPUBufferMapCallbackInfo *", {"mode": _lib.WGPUCallbackMode_AllowProcessEvents, "callback": _callback, "userdata1": self.cell}
        )

    def abandon(self) -> None:
        _abandoned_cells.append(self.cell)
        self.renew()


_requests = _Request() if _lib is not None else None


@contextlib.contextmanager
def mapped(device, buffer, write: bool, offset: int, size: int, spin_seconds: float = 0.0):
    """Map ``size`` bytes of ``buffer`` at ``offset`` for reading or writing and yield them
    as a uint8 array (read-only when reading); unmapped when the block ends.

    A read map must follow the submit that filled the buffer: it waits for that work. For
    up to ``spin_seconds`` the wait polls without blocking, then it blocks (see _wait)."""
    if not NATIVE:  # another wgpu version, or SAO_WGPU_MAPS=public
        try:
            yield _mapped_public(buffer, write, offset, size)
        finally:
            buffer.unmap()
        return
    request = _requests
    cell, info = request.cell, request.info
    cell[0] = -1
    # One capture of wgpu-native's errors for the map's calls (native.ErrorCapture): a
    # refused map is reported at its request, and then waits for nothing.
    errors = ErrorCapture("sparse_attention_op.map")
    try:
        _lib.wgpuBufferMapAsync(buffer._internal, _lib.WGPUMapMode_Write if write else _lib.WGPUMapMode_Read, offset, size, info[0])
        if not errors.reported():
            _wait(device, cell, spin_seconds)
        errors.close()
    except BaseException:
        # A refused map, or a poll that raised (an error reported during it, an interrupt):
        # the callback may still come, so its cell must outlive this call.
        request.abandon()
        _lib.wgpuBufferUnmap(buffer._internal)  # cancels a map still pending
        errors.discard()  # the exception on its way is the one to report
        raise
    status = cell[0]
    if status != _lib.WGPUMapAsyncStatus_Success:
        if status == -1:
            request.abandon()
        _lib.wgpuBufferUnmap(buffer._internal)  # cancels a map still pending, so the buffer stays usable
        raise MapError(f"mapping buffer '{buffer.label}' ({size} bytes at {offset}) failed: status {status}")
    try:
        if write:
            pointer = _lib.wgpuBufferGetMappedRange(buffer._internal, offset, size)
        else:
            pointer = _lib.wgpuBufferGetConstMappedRange(buffer._internal, offset, size)
        if pointer == _ffi.NULL:  # outside any capture: wgpu-native says so by a null range
            raise MapError(f"buffer '{buffer.label}' mapped, but its range ({size} bytes at {offset}) could not be read")
        view = np.frombuffer(_ffi.buffer(pointer, size), np.uint8)
        view.flags.writeable = write
        yield view
    finally:
        # The caller has copied what it needs: the memory goes away with the unmap.
        _lib.wgpuBufferUnmap(buffer._internal)


def _wait(device, cell, spin_seconds: float) -> None:
    """Poll until the map's callback has written ``cell``.

    A blocking poll sleeps in the driver until the GPU signals: the thread then wakes on a
    core that may have dropped its clock and its caches, and a decode step's GPU work is
    tens of microseconds. So on GPUs the wait first spins on non-blocking polls (about 2 us
    each) for a short while, as CUDA's default schedule does; CPU adapters pass 0, since
    there a spinning thread takes a core from the driver's own workers."""
    poll, handle = _lib.wgpuDevicePoll, device._internal
    if spin_seconds > 0:
        deadline = time.perf_counter() + spin_seconds
        while cell[0] == -1 and time.perf_counter() < deadline:
            poll(handle, False, _ffi.NULL)
    for _ in range(_MAX_POLLS):
        if cell[0] != -1:
            return
        poll(handle, True, _ffi.NULL)


def _mapped_public(buffer, write: bool, offset: int, size: int) -> np.ndarray:
    if write:
        buffer.map_async(wgpu.MapMode.WRITE, offset, size).sync_wait()
        return np.frombuffer(buffer._experimental_get_mapped_range(offset, size), np.uint8)
    buffer.map_async("READ_NOSYNC", offset, size).sync_wait()
    return np.frombuffer(buffer.read_mapped(offset, size, copy=False), np.uint8)
