"""The caller's past tensors, read where they lie instead of through the bridge.

The exact check digests every history row of a call, and the PyOp bridge copies every
input it carries: sending the history through it costs a native Slice and the bridge's own
copy, each a pass over the history at host-copy speed (BENCHMARKS.md, 2026-12-02 fourth:
about 5 GB/s on the H200 host, 6.5 ms per 33 MB cache). Yet the rows are already in host
memory the op could read: the numpy arrays fed to ``run``, or the OrtValues fed to
``run_with_ort_values`` or bound to an IOBinding. A session of create_session sees those
feeds before ONNX Runtime runs the graph, so it hands each node read-only views of its
``past_key``/``past_value`` feeds (:func:`past_views`), and the bridge's ops read the rows
they need from them; the graph's history Slices then cut nothing (docs/design.md, "The graph
around the op").

A view is taken only where it is exactly what ORT reads: a C-contiguous numpy array or a
CPU OrtValue of the node's element type, fed to a graph input that is the node's own
``past_key``/``past_value`` (``run`` and the session's IOBinding make a numpy past that is
not C-contiguous so first, the copy ORT would make: :func:`contiguous_pasts`). The bridge also checks the view's shape
against the shape the node was given. Everywhere else (a plain InferenceSession, ORT GenAI,
a past computed inside the graph, an IOBinding not made by the session) the rows cross the
bridge as before, with the same results. One cost differs there: create_session's graph has
no fast check op for a node whose pasts it can read in place (rewrite.py), so a fast node
whose pasts it could not read after all (a foreign IOBinding, a past bound on another
device) checks that call's whole history, exactly.

The views are valid for one ``run`` only: ONNX Runtime holds the feeds until it returns, and
the nodes that write the presents run after the op that reads the past.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Mapping

import numpy as np
import onnxruntime as ort
from onnx.helper import tensor_dtype_to_np_dtype

#: What the session knows about each node whose pasts are graph inputs: node key ->
#: (past_key input name, past_value input name, element type of the graph's float tensors).
PastInputs = Mapping[str, tuple[str, str, np.dtype]]

_ORT_TYPES = {"tensor(float)": np.dtype(np.float32), "tensor(float16)": np.dtype(np.float16)}


def past_views(past_inputs: PastInputs, feeds: Mapping[str, object]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Per node key, read-only views of the node's past_key and past_value feeds, for the
    nodes whose two feeds can be read in place (see the module doc); the others are left out.

    ``feeds`` maps graph input names to what the caller gave: numpy arrays, OrtValues, or
    :class:`BoundInput` records of an IOBinding."""
    views = {}
    for node_key, (key_name, value_name, dtype) in past_inputs.items():
        key, value = _view(feeds.get(key_name), dtype), _view(feeds.get(value_name), dtype)
        if key is not None and value is not None:
            views[node_key] = (key, value)
    return views


def contiguous_pasts(past_types: Mapping[str, np.dtype], feeds: dict) -> dict:
    """``feeds``, with every numpy past of its node's type (``past_types``: see
    :func:`past_types`) that is not C-contiguous replaced by a C-contiguous copy (the
    caller's dict is left alone). ORT would make that copy itself, where no view could see
    it; made here, the copy is what ORT reads, so it is read in place like any other past."""
    copies = {name: np.ascontiguousarray(feeds[name]) for name, dtype in past_types.items() if _strided(feeds.get(name), dtype)}
    return {**feeds, **copies} if copies else feeds


def past_types(past_inputs: PastInputs) -> dict[str, np.dtype]:
    """Graph input name -> element type, for every past the nodes could read in place (a
    session works it out once)."""
    return {name: dtype for key_name, value_name, dtype in past_inputs.values() for name in (key_name, value_name)}


def _strided(fed, dtype: np.dtype) -> bool:
    """A numpy past of the right type that ORT would copy (not C-contiguous)."""
    return isinstance(fed, np.ndarray) and fed.dtype == dtype and not fed.flags.c_contiguous


class BoundInput:
    """An input bound to an IOBinding by pointer (``bind_input``): where ORT will read it."""

    __slots__ = ("device", "dtype", "shape", "pointer")

    def __init__(self, device: str, dtype, shape, pointer: int):
        self.device, self.shape, self.pointer = str(device).lower(), tuple(int(d) for d in shape), int(pointer)
        try:  # ORT takes a numpy type or an ONNX element type number (TensorProto.FLOAT, ...)
            self.dtype = tensor_dtype_to_np_dtype(dtype) if isinstance(dtype, int) else np.dtype(dtype)
        except (TypeError, KeyError):  # a type no numpy dtype stands for: never a past read in place
            self.dtype = None


class RecordingIOBinding(ort.IOBinding):
    """The IOBinding of :meth:`SparseAttentionSession.io_binding`: an ordinary IOBinding that
    also remembers what each input is bound to, so that ``run_with_iobinding`` can hand the
    nodes their bound pasts (ORT's IOBinding does not say what it holds). A numpy past that
    is not C-contiguous is bound as a C-contiguous copy, as ``run`` does (contiguous_pasts)."""

    def __init__(self, session, past_types: Mapping[str, np.dtype]):
        super().__init__(session)
        self.bound_inputs: dict[str, object] = {}
        self._past_types = past_types

    def bind_cpu_input(self, name, arr_on_cpu):
        if name in self._past_types and _strided(arr_on_cpu, self._past_types[name]):
            arr_on_cpu = np.ascontiguousarray(arr_on_cpu)  # kept alive in bound_inputs
        super().bind_cpu_input(name, arr_on_cpu)
        self.bound_inputs[name] = arr_on_cpu

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        super().bind_input(name, device_type, device_id, element_type, shape, buffer_ptr)
        self.bound_inputs[name] = BoundInput(device_type, element_type, shape, buffer_ptr)

    def bind_ortvalue_input(self, name, ortvalue):
        super().bind_ortvalue_input(name, ortvalue)
        self.bound_inputs[name] = ortvalue

    def clear_binding_inputs(self):
        super().clear_binding_inputs()
        self.bound_inputs.clear()


def _view(fed, dtype: np.dtype) -> np.ndarray | None:
    """A read-only view of what ORT reads for this feed, or None where none is sure to be it."""
    if isinstance(fed, np.ndarray):
        if fed.dtype != dtype or not fed.flags.c_contiguous:
            return None  # ORT converts such a feed: a copy, not this memory
        view = fed.view()
        view.flags.writeable = False
        return view
    if isinstance(fed, ort.OrtValue):
        if not fed.is_tensor() or fed.device_name().lower() != "cpu" or _ORT_TYPES.get(fed.data_type()) != dtype:
            return None
        return _from_pointer(fed.data_ptr(), tuple(fed.shape()), dtype)
    if isinstance(fed, BoundInput):
        if fed.device != "cpu" or fed.dtype != dtype:
            return None
        return _from_pointer(fed.pointer, fed.shape, dtype)
    return None


@functools.lru_cache(maxsize=256)
def _from_pointer(pointer: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A read-only array over ``pointer``. Kept: a decode loop feeds the same buffers every
    step, and making the view is most of this module's cost per run (10-20 us). A kept view
    of memory freed since is never read: a view is used only in a run whose feed lies at
    that address with that shape."""
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0 or not pointer:
        view = np.zeros(shape, dtype)
    else:
        memory = (ctypes.c_char * (count * dtype.itemsize)).from_address(pointer)
        view = np.frombuffer(memory, dtype).reshape(shape)
    view.flags.writeable = False
    return view
