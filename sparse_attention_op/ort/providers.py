"""Which execution provider runs the rest of the graph: ORT's CPU EP, or ORT's WebGPU EP.

The SparseAttention nodes always run through this package's op, a host-side node (its
kernel is Python on ORT's CPU EP, and its GPU work goes through wgpu). Every other node runs
where the session's EP puts it:

* ``ep="cpu"``: ORT's CPU EP, the default.
* ``ep="webgpu"``: ORT's WebGPU EP, shipped as a plugin library for the standard
  ``onnxruntime`` package (``pip install onnxruntime-ep-webgpu``, or this package's
  ``webgpu`` extra). It has kernels for GroupQueryAttention, MatMulNBits, the norms and
  rotary embeddings, and none for SparseAttention, so ORT hands it everything but this
  package's op, and falls back to its CPU EP for whatever else it cannot run.

The plugin is registered once per process. Each failure to get it (not installed, an
onnxruntime too old for plugin EPs, no adapter found) raises :class:`ExecutionProviderError`
with one line that says what to install or do, before any session is made.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import onnxruntime as ort

#: The EP choices of create_session, generate and the CLI's --ep.
EPS = ("cpu", "webgpu")
#: The WebGPU EP's name in ORT (the plugin's own, onnxruntime_ep_webgpu.get_ep_name()).
WEBGPU_EP = "WebGpuExecutionProvider"
#: The oldest onnxruntime that loads the plugin (it checks this itself at registration).
MINIMUM_ORT = "1.24.4"
INSTALL_HINT = "pip install onnxruntime-ep-webgpu (or sparse-attention-op[webgpu])"
#: SessionOptions that already carry an EP chosen here: adding a provider twice would run two.
_EP_MARK = "sparse_attention_op.ep"


class ExecutionProviderError(RuntimeError):
    """The chosen execution provider cannot be used here; the message says what to do."""


@dataclass(frozen=True)
class WebGpuPlugin:
    """The registered plugin: its library, its version, and the devices ORT lists for it."""

    library: str
    version: str
    devices: tuple  # onnxruntime.OrtEpDevice, best first as ORT lists them

    @property
    def device(self):
        """The device sessions use (the first, as ORT GenAI also picks)."""
        return self.devices[0]

    def memory_info(self):
        """Where tensors on the EP's device live (an OrtValue allocated there stays there)."""
        return self.device.memory_info(ort.OrtDeviceMemoryType.DEFAULT)


_lock = threading.Lock()
_plugin: WebGpuPlugin | None = None


def require_ep(ep) -> str:
    if ep not in EPS:
        raise ValueError(f"ep must be one of {EPS}, got {ep!r}")
    return ep


def webgpu_plugin() -> WebGpuPlugin:
    """The WebGPU plugin EP, registered with onnxruntime on first use; raises
    ExecutionProviderError where it cannot be had, and says why."""
    global _plugin
    with _lock:
        if _plugin is None:
            _plugin = _register()
        if not _plugin.devices:
            raise ExecutionProviderError(
                f"ORT's WebGPU plugin EP ({_plugin.version}) found no GPU adapter on this machine (it does not use software "
                "Vulkan drivers such as lavapipe): run with ep='cpu' (--ep cpu), or on a machine with a GPU and its Vulkan, "
                "Metal or D3D12 driver"
            )
        return _plugin


def _register() -> WebGpuPlugin:
    try:
        import onnxruntime_ep_webgpu as package
    except ImportError:
        raise ExecutionProviderError(f"ORT's WebGPU plugin EP is not installed: {INSTALL_HINT}") from None
    if not hasattr(ort, "register_execution_provider_library"):
        raise ExecutionProviderError(
            f"onnxruntime {ort.__version__} cannot load plugin EPs: the WebGPU plugin EP needs onnxruntime >= {MINIMUM_ORT} "
            "(pip install -U onnxruntime)"
        )
    library = package.get_library_path()
    try:
        ort.register_execution_provider_library(WEBGPU_EP, library)
    except Exception as error:  # onnxruntime's Fail: the message is the reason
        text = str(error)
        if "already registered" not in text:
            if "below the minimum required version" in text:
                raise ExecutionProviderError(
                    f"onnxruntime {ort.__version__} is too old for this WebGPU plugin EP, which needs >= {MINIMUM_ORT}: pip install -U onnxruntime"
                ) from None
            raise ExecutionProviderError(f"ORT could not load its WebGPU plugin EP from {library}: {text}") from None
    devices = tuple(d for d in ort.get_ep_devices() if d.ep_name == WEBGPU_EP)
    return WebGpuPlugin(library, _version(package), devices)


def _version(package) -> str:
    from importlib import metadata

    try:
        return metadata.version("onnxruntime-ep-webgpu")
    except metadata.PackageNotFoundError:
        return getattr(package, "__version__", "unknown version")


def add_ep(options: ort.SessionOptions, ep: str, provider_options: dict | None = None) -> None:
    """Put ``ep`` on ``options`` for the nodes this package's op does not run (the CPU EP
    needs nothing). Options that carry an EP from here already are left as they are."""
    require_ep(ep)
    if ep == "cpu":
        return
    try:
        chosen = options.get_session_config_entry(_EP_MARK)
    except RuntimeError:  # absent: these options carry no EP of ours yet
        chosen = None
    if chosen is not None:
        if chosen != ep:
            raise ValueError(f"these SessionOptions already run the graph on ep={chosen!r}: pass fresh options for ep={ep!r}")
        return
    plugin = webgpu_plugin()
    options.add_provider_for_devices([plugin.device], {k: str(v) for k, v in (provider_options or {}).items()})
    options.add_session_config_entry(_EP_MARK, ep)


def session_ep(session: ort.InferenceSession) -> str:
    """``"webgpu"`` where the session runs nodes on ORT's WebGPU EP, else ``"cpu"``."""
    return "webgpu" if WEBGPU_EP in session.get_providers() else "cpu"


def plugin_report() -> dict:
    """What ``info`` shows of the plugin: installed or not, its version and library, its
    devices, or why it cannot be used."""
    try:
        plugin = webgpu_plugin()
    except ExecutionProviderError as error:
        installed = _plugin is not None
        return {
            "installed": installed,
            "version": _plugin.version if installed else None,
            "library": _plugin.library if installed else None,
            "devices": [],
            "problem": str(error),
        }
    return {
        "installed": True,
        "version": plugin.version,
        "library": plugin.library,
        "devices": [describe_device(d) for d in plugin.devices],
        "problem": None,
    }


def describe_device(device) -> str:
    hardware = device.device
    kind = getattr(hardware.type, "name", str(hardware.type))
    vendor = f"{hardware.vendor} " if hardware.vendor else ""
    return f"{vendor}{kind} (vendor id {hardware.vendor_id:#06x}, device id {hardware.device_id:#06x})"
