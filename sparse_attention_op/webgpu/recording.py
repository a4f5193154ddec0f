"""One call's commands: queue writes, one compute pass of launches, copies, one submit.

A decode step records the same few commands every call: a write of its small inputs, a
compute pass of two or three dispatches, a copy into the read-back buffer, a submit.
Through wgpu-py's classes each command is a method that builds its descriptor structs,
checks its arguments and wraps what it returns: about 220 Python calls per decode step
(cProfile), most of the 0.26 ms the H200 host spent encoding one (scripts/profile_step.py).
:class:`NativeRecording` makes the same wgpu-native calls with descriptors built once,
inside one capture of the errors they report (native.ErrorCapture): a validation error
still raises ``wgpu.GPUError``, a queue write's at the write and an encoder's at the
submit. :class:`WgpuPyRecording` goes through wgpu-py's classes; the executor uses it when
timing dispatches (timestamp writes) and where the internals are missing or
``SAO_WGPU_COMMANDS=public`` asks for it.

Both offer what a call records:

* ``write_buffer(buffer, offset, data)``: a queue write (it lands before the submit's work);
* ``copy_buffer_to_buffer(source, source_offset, destination, destination_offset, size)``;
* ``compute_pass(launches)``: set pipeline, bind group 0 and dispatch, per launch;
* ``submit()``, and ``release()`` (idempotent) for a recording abandoned on an error.

Timing adds ``timed_passes(passes, query_set)`` (a timed pass per list of launches: one per
dispatch, or the call's one pass) and ``resolve_query_set``, on :class:`WgpuPyRecording` only.
"""

from __future__ import annotations

import numpy as np

from sparse_attention_op.webgpu import native
from sparse_attention_op.webgpu.native import ErrorCapture, ffi, lib

#: Off (``SAO_WGPU_COMMANDS=public``): every call records through wgpu-py's classes.
NATIVE = native.enabled("SAO_WGPU_COMMANDS")

if native.AVAILABLE:
    # Zeroed descriptors: no label, no chained structs, no timestamp writes. Read-only to
    # wgpu-native, so one of each serves every call.
    _ENCODER = ffi.new("WGPUCommandEncoderDescriptor *")
    _PASS = ffi.new("WGPUComputePassDescriptor *")
    _COMMANDS = ffi.new("WGPUCommandBufferDescriptor *")


class NativeRecording:
    """A command encoder driven through wgpu-native's functions directly.

    Errors reported while recording raise ``wgpu.GPUError``: a queue write's at the write,
    an encoder's at :meth:`submit` (wgpu-native reports them when the encoder finishes). A
    recording abandoned before its submit logs what it caught at :meth:`release`, which
    never raises (the exception that abandoned it is the one to report)."""

    def __init__(self, device):
        self._queue = device.queue._internal
        self._errors = ErrorCapture("sparse_attention_op.recording")
        self._encoder = lib.wgpuDeviceCreateCommandEncoder(device._internal, _ENCODER)

    def write_buffer(self, buffer, offset: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data)
        lib.wgpuQueueWriteBuffer(self._queue, buffer._internal, offset, ffi.from_buffer(data), data.nbytes)
        if self._errors.reported():  # raised at its own call, as wgpu-py would
            self._release_encoder()
            self._errors.close()

    def copy_buffer_to_buffer(self, source, source_offset: int, destination, destination_offset: int, size: int) -> None:
        lib.wgpuCommandEncoderCopyBufferToBuffer(self._encoder, source._internal, source_offset, destination._internal, destination_offset, size)

    def compute_pass(self, launches) -> None:
        compute = lib.wgpuCommandEncoderBeginComputePass(self._encoder, _PASS)
        try:
            for launch in launches:
                lib.wgpuComputePassEncoderSetPipeline(compute, launch.pipeline._internal)
                lib.wgpuComputePassEncoderSetBindGroup(compute, 0, launch.bind_group._internal, 0, ffi.NULL)
                lib.wgpuComputePassEncoderDispatchWorkgroups(compute, *launch.workgroups)
            lib.wgpuComputePassEncoderEnd(compute)
        finally:
            lib.wgpuComputePassEncoderRelease(compute)

    def submit(self) -> None:
        commands = lib.wgpuCommandEncoderFinish(self._encoder, _COMMANDS)  # reports the encoder's errors
        self._release_encoder()
        if self._errors.reported():
            lib.wgpuCommandBufferRelease(commands)
            self._errors.close()  # raises it: an invalid command buffer must never be submitted
        lib.wgpuQueueSubmit(self._queue, 1, [commands])  # (cffi passes a list as a temporary array)
        lib.wgpuCommandBufferRelease(commands)
        self._errors.close()  # raises what the recording or the submit reported

    def release(self) -> None:
        self._release_encoder()
        self._errors.discard()

    def _release_encoder(self) -> None:
        if self._encoder is not None:
            lib.wgpuCommandEncoderRelease(self._encoder)
            self._encoder = None


class WgpuPyRecording:
    """The same commands through wgpu-py's classes; the only one that times dispatches."""

    def __init__(self, device):
        self._device = device
        self._encoder = device.create_command_encoder()

    def write_buffer(self, buffer, offset: int, data: np.ndarray) -> None:
        self._device.queue.write_buffer(buffer, offset, data)

    def copy_buffer_to_buffer(self, source, source_offset: int, destination, destination_offset: int, size: int) -> None:
        self._encoder.copy_buffer_to_buffer(source, source_offset, destination, destination_offset, size)

    def compute_pass(self, launches) -> None:
        self.timed_passes([launches])

    def timed_passes(self, passes, query_set=None) -> None:
        """One compute pass per list of launches; with a ``query_set``, pass i writes its start
        and end timestamps at indices 2i and 2i+1."""
        for index, recorded in enumerate(passes):
            writes = (
                None
                if query_set is None
                else {"query_set": query_set, "beginning_of_pass_write_index": 2 * index, "end_of_pass_write_index": 2 * index + 1}
            )
            compute = self._encoder.begin_compute_pass(timestamp_writes=writes)
            for launch in recorded:
                compute.set_pipeline(launch.pipeline)
                compute.set_bind_group(0, launch.bind_group)
                compute.dispatch_workgroups(*launch.workgroups)
            compute.end()

    def resolve_query_set(self, query_set, count: int, destination) -> None:
        self._encoder.resolve_query_set(query_set, 0, count, destination, 0)

    def submit(self) -> None:
        self._device.queue.submit([self._encoder.finish()])

    def release(self) -> None:
        pass  # wgpu-py releases its encoder when it is collected


def begin(device, timed: bool):
    """The recording for one call: wgpu-native directly, unless timing or told otherwise."""
    return WgpuPyRecording(device) if timed or not NATIVE else NativeRecording(device)
