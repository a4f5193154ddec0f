"""IO binding with past and present on one buffer, the way ORT GenAI runs decoders.

Bound like this, the presents are written into the past's own buffer (in place: the op
writes only the new rows), and no cache-sized tensor is copied per step. Under ORT's WebGPU
EP a cache belongs where the attention that reads it runs: :func:`device_pasts` names the
pasts a GroupQueryAttention node reads (on the EP's device, :func:`on_device`); the others,
read by this package's op, stay in host memory.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import onnx
import onnxruntime as ort

from sparse_attention_op.ort.graph import is_group_query_attention
from sparse_attention_op.ort.providers import webgpu_plugin

#: The one-node convention of the operator: present_key is past_key's buffer, and so on.
DEFAULT_PRESENTS = {"present_key": "past_key", "present_value": "past_value"}


def bind_shared(
    session: ort.InferenceSession,
    feeds: Mapping[str, np.ndarray],
    caches: Mapping[str, ort.OrtValue],
    presents: Mapping[str, str] = DEFAULT_PRESENTS,
    outputs: tuple[str, ...] = ("output",),
) -> ort.IOBinding:
    """An IOBinding for one run: ``caches`` (past input name -> OrtValue) bound as inputs and,
    through ``presents`` (present output name -> past input name), as the outputs too; every
    other graph input from ``feeds`` (host arrays); ``outputs`` left for ORT to allocate.

    Run it with ``session.run_with_iobinding(binding)``; ``binding.copy_outputs_to_cpu()``
    then lists ``outputs`` first, in order. The OrtValues borrow their arrays' memory: keep
    the arrays alive while they are bound.
    """
    _check_arguments(session, caches, presents, outputs)
    binding = session.io_binding()
    for graph_input in session.get_inputs():
        name = graph_input.name
        if name in caches:
            binding.bind_ortvalue_input(name, caches[name])
        elif name in feeds:
            binding.bind_cpu_input(name, np.ascontiguousarray(feeds[name]))
        else:
            raise KeyError(f"no feed for graph input '{name}'")
    for name in outputs:
        binding.bind_output(name)
    for present, past in presents.items():
        binding.bind_ortvalue_output(present, caches[past])
    return binding


def device_pasts(model: onnx.ModelProto) -> frozenset[str]:
    """The graph inputs a GroupQueryAttention node reads as its past key or value: under ORT's
    WebGPU EP that attention runs on the EP's device, so their buffers belong there."""
    inputs = {i.name for i in model.graph.input}
    return frozenset(name for node in model.graph.node if is_group_query_attention(node) for name in node.input[3:5] if name in inputs)


def on_device(host: ort.OrtValue) -> ort.OrtValue:
    """A copy of ``host`` on the WebGPU EP's device, to bind as past and present of a layer
    :func:`device_pasts` names (made once; ORT reads and writes it there on every step)."""
    dtype = onnx.helper.tensor_dtype_to_np_dtype(host.element_type())  # (numpy() would copy the whole cache)
    device = ort.OrtValue.ortvalue_from_shape_and_type(host.shape(), dtype, memory_info=webgpu_plugin().memory_info())
    ort.copy_tensors([host], [device], None)
    return device


def _check_arguments(session, caches, presents, outputs) -> None:
    """Each mistake named before anything is bound (ORT would say it at run, or not at all)."""
    if isinstance(outputs, str):
        raise TypeError(f"outputs must be a sequence of output names, got the string {outputs!r}: write ({outputs!r},)")
    for name, value in caches.items():
        if not isinstance(value, ort.OrtValue):
            raise TypeError(f"caches['{name}'] must be an onnxruntime.OrtValue (ort.OrtValue.ortvalue_from_numpy), got {type(value).__name__}")
    output_names = [o.name for o in session.get_outputs()]
    for name in [*outputs, *presents]:
        if name not in output_names:
            raise KeyError(f"'{name}' is not an output of the session (outputs: {', '.join(output_names)})")
    for present, past in presents.items():
        if past not in caches:
            raise KeyError(
                f"presents maps '{present}' to '{past}', which caches lacks (caches: {', '.join(caches) or 'none'}); "
                "a decoder names its own pairs, such as {'present.0.key': 'past_key_values.0.key'}"
            )
