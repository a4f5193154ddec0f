"""wgpu-native's functions as wgpu-py binds them, for the hot paths that call them directly.

Two paths of every call go around wgpu-py's Python classes: buffer maps (mapping.py) and
the recording of a call's commands (recording.py). Both call wgpu-native's functions
(``lib``) inside one :class:`ErrorCapture` each: the errors wgpu-native reports meanwhile
raise as a ``wgpu.GPUError``, as wgpu-py's own methods (and its per-function wrappers,
``libf``) would raise them, at a cost of one capture per map or recording instead of one
per function (a decode step makes about 25 such calls). Where this wgpu version lacks these
internals, both paths fall back to wgpu-py's public API; an environment variable set to
``public`` chooses the fallback anyway, for measuring the two against each other.

Compiling goes around them once too: shader modules without Naga's runtime checks
(:func:`create_unchecked_shader_module`, for the pipeline cache).
"""

from __future__ import annotations

import wgpu

from sparse_attention_op.settings import environment

try:  # wgpu-py's native backend: its cffi handle, the library functions it binds, its error sink.
    from wgpu.backends.wgpu_native._api import GPUShaderModule, error_handler, libf, new_struct_p, to_c_string_view
    from wgpu.backends.wgpu_native._ffi import ffi, lib
    from wgpu.backends.wgpu_native._helpers import ERROR_TYPES
except ImportError:  # pragma: no cover - another wgpu version
    libf = ffi = lib = error_handler = GPUShaderModule = new_struct_p = to_c_string_view = None
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
    return AVAILABLE and environment(variable) != "public"


#: Whether wgpu-native can create a shader module without Naga's runtime checks.
UNCHECKED_SHADERS = AVAILABLE and hasattr(lib, "wgpuDeviceCreateShaderModuleTrusted")


def create_unchecked_shader_module(device, wgsl: str, label: str):
    """A shader module of ``wgsl`` compiled without Naga's runtime checks.

    By default (``wgpuDeviceCreateShaderModule``) Naga clamps every dynamic index into an
    array held in workgroup or function memory and counts every loop's iterations in a
    64-bit counter that breaks out at 2^64 (ForceLoopBounding), so that no WGSL program can
    read out of bounds or make a driver assume an infinite loop away. The counter keeps
    drivers from unrolling fixed-count loops and each clamp sits between an index and its
    load (the loop counters alone have been seen to slow a pipeline 100x). wgpu-native's
    ``wgpuDeviceCreateShaderModuleTrusted`` with ``WGPUShaderRuntimeChecks_None`` leaves
    both out. Only for WGSL whose indices are in range and whose loops end by construction:
    this package's own templates (Tuning.shader_runtime_checks says why they qualify).
    On Vulkan, storage buffer accesses stay guarded by the driver: wgpu enables the device's
    robustBufferAccess wherever the driver offers it (NVIDIA's and lavapipe do).
    Raises as wgpu-py's ``create_shader_module`` does: a ``wgpu.GPUError``.
    """
    # The descriptor as wgpu-py's create_shader_module builds it (its helpers keep the
    # strings alive with the structs); `source` must outlive the call, which reads it by pointer.
    source = new_struct_p("WGPUShaderSourceWGSL *", code=to_c_string_view(wgsl))
    source[0].chain.next = ffi.NULL
    source[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
    descriptor = new_struct_p("WGPUShaderModuleDescriptor *", nextInChain=ffi.cast("WGPUChainedStruct *", source), label=to_c_string_view(label))
    # libf raises wgpu-native's validation errors (a WGSL error) as wgpu-py's own call would.
    handle = libf.wgpuDeviceCreateShaderModuleTrusted(device._internal, descriptor, lib.WGPUShaderRuntimeChecks_None)
    if handle == ffi.NULL:  # refused without a reported error: the GPU's failure all the same
        raise wgpu.GPUError(f"{label}: wgpu-native created no shader module")
    return GPUShaderModule(label, handle, device)
