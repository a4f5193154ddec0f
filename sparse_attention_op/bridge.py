"""The onnxruntime-extensions PyOp that routes com.microsoft::SparseAttention to the executor.

Two facts about the bridge shape this module (measured, DESIGN.md section 2):

* The stock invocation hook turns every output into a Python list (``tolist``), 75x slower
  than handing the numpy array over; the C++ side memcpy's a contiguous array directly.
  :func:`register` installs a hook that does that for this op and defers to the stock
  dispatcher for every other PyOp.
* An exception escaping the hook terminates the process (the C++ ``Compute`` does not
  catch it). So the hook never raises: it records the error for the calling session and
  thread, and returns NaN-filled outputs; :class:`~sparse_attention_op.session.SparseAttentionSession`
  re-raises the recorded error from ``run``. Validation happens before any GPU work, so a
  refused call leaves nothing half-done and the session keeps working.
"""

from __future__ import annotations

import logging
import threading

import numpy as np
from onnxruntime_extensions import PyCustomOpDef, _ocos, onnx_op

from .spec import DOMAIN, INPUT_NAMES, OP_TYPE, OpAttributes, build_call

#: Attribute prepare_model stamps on every node: "<session token>/<node identity>".
NODE_KEY_ATTRIBUTE = "sao_node_key"
#: Attribute prepare_model stamps on every node: "float16" when the graph keeps the node's
#: tensors in float16 (and casts around it), else "float32".
STORAGE_ATTRIBUTE = "sao_storage"

_F, _I = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32
_INPUT_TYPES = [_F, _F, _F, _F, _F, _I, _I, _I, _I, _F, _F]
_ATTRIBUTE_TYPES = {
    "num_heads": PyCustomOpDef.dt_int64,
    "kv_num_heads": PyCustomOpDef.dt_int64,
    "sparse_block_size": PyCustomOpDef.dt_int64,
    "scale": PyCustomOpDef.dt_float,
    "do_rotary": PyCustomOpDef.dt_int64,
    "rotary_interleaved": PyCustomOpDef.dt_int64,
    NODE_KEY_ATTRIBUTE: PyCustomOpDef.dt_string,
    STORAGE_ATTRIBUTE: PyCustomOpDef.dt_string,
}
assert len(_INPUT_TYPES) == len(INPUT_NAMES)

log = logging.getLogger(__name__)


class CallErrors:
    """Errors raised inside the op, waiting for the session run that caused them.

    Keyed by (session token, thread): ORT runs a node on the thread that called ``run``
    in sequential execution (which create_session sets), so concurrent runs of one session
    from several threads never see each other's errors.
    """

    def __init__(self):
        self._errors: dict[tuple[str, int], BaseException] = {}
        self._lock = threading.Lock()

    def record(self, token: str, error: BaseException) -> None:
        with self._lock:
            # The first error of a run is the one to report; later nodes fail because of it.
            self._errors.setdefault((token, threading.get_ident()), error)

    def pop(self, token: str) -> BaseException | None:
        with self._lock:
            return self._errors.pop((token, threading.get_ident()), None)


call_errors = CallErrors()

_register_lock = threading.RLock()  # register() holds it while registering
_opdef = None
#: PyOps whose outputs take the array path (by the id onnxruntime-extensions gives them).
_array_ops: dict = {}


def session_token(node_key: str) -> str:
    return node_key.split("/", 1)[0]


def _sparse_attention(*inputs, **attributes):
    """The op body: validate, run on the GPU, hand (output, present_key, present_value) back."""
    from .webgpu import get_executor  # the GPU is touched on the first call, not at import

    node_key = attributes.pop(NODE_KEY_ATTRIBUTE, "")
    float16_storage = attributes.pop(STORAGE_ATTRIBUTE, "float32") == "float16"
    call = build_call(inputs, OpAttributes.from_mapping(attributes), float16_storage=float16_storage)
    # The bridge hands fresh copies of past_key/past_value: complete them in place.
    past_key, past_value = inputs[3], inputs[4]
    donate = past_key.flags.writeable and past_value.flags.writeable and past_key.flags.c_contiguous and past_value.flags.c_contiguous
    return get_executor().run(call, node_key, present_out=(past_key, past_value) if donate else None)


def _poisoned_outputs(inputs) -> tuple[np.ndarray, ...]:
    """NaN outputs for a refused call, shaped as well as the inputs allow."""
    query = np.asarray(inputs[0]) if inputs else np.empty(0)
    past = np.asarray(inputs[3]) if len(inputs) > 3 else np.empty(0)
    output = np.full(query.shape if query.ndim == 3 else (0,), np.nan, dtype=np.float32)
    present = np.full(past.shape, np.nan, dtype=np.float32)
    return output, present, present.copy()


def _invoke(k_id, feed, attributes):
    """Hook for every PyOp of the process; ours return arrays, others go to the stock hook."""
    opdef = _array_ops.get(k_id)
    if opdef is None:
        return _ocos._on_pyop_invocation(k_id, feed, attributes)
    node_key = str(attributes.get(NODE_KEY_ATTRIBUTE, ""))
    try:
        outputs = _as_fetch(opdef.body(*feed, **opdef.cast_attributes(attributes)))
    except BaseException as error:  # noqa: BLE001 - anything escaping here aborts the process
        log.debug("PyOp node %s refused a call: %s", node_key, error)
        call_errors.record(session_token(node_key), error)
        outputs = _as_fetch(_poisoned_outputs(feed))
    return (k_id,) + outputs


def _as_fetch(outputs) -> tuple:
    """(shape, flat array) per output: the C++ side memcpy's each array's data as it is."""
    fetch = []
    for array in outputs:
        array = np.ascontiguousarray(array, dtype=np.float32)
        fetch += [array.shape, array.reshape(-1)]
    return tuple(fetch)


def register_array_op(function, **declaration):
    """Register a PyOp (``onnx_op`` arguments) whose float32 outputs cross as numpy arrays.

    SparseAttention is one; the decode benchmark registers a pass-through op to measure
    what the bridge's own copies cost.
    """
    with _register_lock:
        opdef = onnx_op(**declaration)(function)
        _array_ops[opdef._id] = opdef
        PyCustomOpDef.install_hooker(_invoke)
        return opdef


def register() -> None:
    """Register com.microsoft::SparseAttention with onnxruntime-extensions (idempotent)."""
    global _opdef
    with _register_lock:
        if _opdef is None:
            _opdef = register_array_op(
                _sparse_attention, op_type=f"{DOMAIN}::{OP_TYPE}", inputs=_INPUT_TYPES, outputs=[_F, _F, _F], attrs=_ATTRIBUTE_TYPES
            )


def is_registered() -> bool:
    return _opdef is not None
