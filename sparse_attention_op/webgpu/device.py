"""Adapter selection and the process-wide wgpu device.

One device serves every session of the process: pipelines and the adapter's limits are
per device, and wgpu-native serialises queue work anyway. The adapter is the best one
found (native backends before OpenGL, then discrete > integrated > virtual > CPU) unless
``SAO_ADAPTER`` names a substring of the wanted adapter's description.
wgpu's own ``WGPU_BACKEND_TYPE`` still restricts which backends are enumerated.
"""

from __future__ import annotations

from dataclasses import dataclass

import wgpu

from sparse_attention_op.settings import environment, environment_name
from sparse_attention_op.webgpu.process_wide import ProcessWide

ADAPTER_ENV = "SAO_ADAPTER"

_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "CPU": 3}
_BACKEND_RANK = {"Vulkan": 0, "Metal": 0, "D3D12": 0, "OpenGL": 2}

#: Limits raised to what the adapter offers: large caches need big storage bindings, and
#: the attention pass's tiles want all the workgroup memory there is.
RAISED_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-compute-workgroup-storage-size",
    "max-storage-buffers-per-shader-stage",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroups-per-dimension",
)
#: Features used when present: f16 storage for later kernels, GPU timestamps for benchmarks,
#: subgroups for the CPU adapters' prefill, coherent storage for split-K decode's merge in
#: its split pass (a slice reads what other workgroups of the same dispatch wrote).
OPTIONAL_FEATURES = ("shader-f16", "timestamp-query", "subgroup", "memory-decoration-coherent")


class NoAdapterError(RuntimeError):
    """wgpu found no adapter that matches."""


@dataclass(frozen=True)
class GpuContext:
    """The chosen adapter and its device: plain facts the rest of the package reads."""

    adapter: object
    device: object
    description: str
    adapter_type: str
    backend: str
    limits: dict
    features: frozenset

    @property
    def max_binding_bytes(self) -> int:
        return int(self.limits["max-storage-buffer-binding-size"])

    @property
    def workgroup_storage_bytes(self) -> int:
        return int(self.limits["max-compute-workgroup-storage-size"])


def describe(adapter) -> str:
    info = adapter.info
    return f"{info.get('device', '?')} ({info.get('adapter_type', '?')}, {info.get('backend_type', '?')})"


def list_adapters(*, chosen_by_environment: bool = True) -> list:
    """Adapters in preference order (best first), after the environment's filter
    (``chosen_by_environment=False``: every adapter wgpu enumerates)."""
    adapters = list(wgpu.gpu.enumerate_adapters_sync())
    wanted = environment(ADAPTER_ENV).strip().lower()
    if wanted and chosen_by_environment:
        adapters = [a for a in adapters if wanted in describe(a).lower() or wanted in a.summary.lower()]

    def rank(adapter):
        info = adapter.info
        # Native backends first (the kernels need their storage limits), then GPUs before CPUs.
        return (_BACKEND_RANK.get(info.get("backend_type"), 1), _TYPE_RANK.get(info.get("adapter_type"), 4))

    return sorted(adapters, key=rank)


def no_adapter_reason() -> str:
    """Why :func:`list_adapters` came back empty, and what to do: a choice in the environment
    that matches nothing is named with what it could match (installing a driver would not help)."""
    wanted = environment(ADAPTER_ENV).strip()
    if wanted:
        present = [describe(a) for a in list_adapters(chosen_by_environment=False)]
        if present:
            return (
                f"{environment_name(ADAPTER_ENV)}={wanted!r} matches none of wgpu's adapters ({'; '.join(present)}): "
                "unset it, or set it to part of one of those names"
            )
    return (
        "wgpu found no GPU adapter. On a machine without a GPU install Mesa's software Vulkan driver "
        "(Debian/Ubuntu: apt-get install mesa-vulkan-drivers), or run `make setup`"
    )


def _create_context() -> GpuContext:
    adapters = list_adapters()
    if not adapters:
        raise NoAdapterError(no_adapter_reason())
    adapter = adapters[0]
    limits = {name: adapter.limits[name] for name in RAISED_LIMITS if name in adapter.limits}
    features = [f for f in OPTIONAL_FEATURES if f in adapter.features]
    device = adapter.request_device_sync(required_features=features, required_limits=limits)
    return GpuContext(
        adapter=adapter,
        device=device,
        description=describe(adapter),
        adapter_type=adapter.info.get("adapter_type", "?"),
        backend=adapter.info.get("backend_type", "?"),
        limits=dict(device.limits),
        features=frozenset(device.features),
    )


_context = ProcessWide(_create_context)


def get_context() -> GpuContext:
    """The process-wide device, created on first use."""
    return _context.get()
