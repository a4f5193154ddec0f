"""The onnxruntime-extensions PyOps that carry a SparseAttention node's work to the executor.

prepare_model (model.py) replaces each SparseAttention node by native ONNX Runtime nodes
around the bridge's PyOps (three for a fast node, two for an exact one, and two for a fast
node of create_session's graph whose pasts the session reads in place), so that no
cache-sized tensor crosses the bridge (docs/design.md, "The graph around the op"):

* ``SparseAttentionPlan`` sees shapes and lengths only. It validates them and says which
  past rows the fast check probes, which cos/sin rows the call's tokens read, whether the
  layout must cross (only until the node has seen it, when it is a constant), and how many
  history rows the exact check reads (all of them: exact nodes have no check op).
* ``SparseAttentionCacheCheck`` (fast nodes of prepare_model's graphs) sees the probe rows.
  It says how many history rows must cross: none when the resident cache holds the past,
  all of them otherwise.
* ``SparseAttentionKernel`` sees the query, the new key/value rows, the history rows asked
  for, the cos/sin rows and the layout when it crosses. It runs the GPU call and returns the
  output, the rotated new key rows and the ScatterND indices that place the new rows in
  the presents.

Where the run's session published views of the node's pasts (pasts.py), no probe or
history row crosses: the plan op asks for none, and the kernel op hands the views to the
executor, which compares a fast node's probe rows with its cache on the GPU during the call
(and reads the history, the exact check, only if they differ) or runs the exact check on
them. Such nodes have no check op (rewrite.py).

Facts about the bridge that shape this module (measured, docs/design.md):

* The stock invocation hook turns every output into a Python list (``tolist``), 75x slower
  than handing the numpy array over; the C++ side memcpy's a contiguous array directly.
  :func:`register` installs a hook that does that for these ops and defers to the stock
  dispatcher for every other PyOp.
* An exception escaping the hook terminates the process (the C++ ``Compute`` does not
  catch it). So the hook never raises. A refused call is recorded for its session and
  thread and logged, and the op returns outputs that make the next native node fail with an
  ordinary ONNX Runtime error (a Gather index out of range, a Reshape or ScatterND of the
  wrong size): ``run`` raises under any session, and
  :class:`~sparse_attention_op.session.SparseAttentionSession` raises the op's own error.
* No PyOp output is a graph output or can be bound by the caller: a bound output of the
  wrong shape makes ORT throw inside the PyOp, which aborts the process. Native nodes
  produce every graph output, and answer such mistakes with an exception.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import numpy as np
from onnxruntime_extensions import PyCustomOpDef, onnx_op

from . import _ortx_compat, host_memory
from .cache_record import chunk_rows_for, model_itemsize, probe_chunks, probe_row_indices
from .presents import scatter_indices
from .spec import SHAPED_INPUTS, CallShape, OpAttributes, ShapeFacts, SparseAttentionError, assemble_call, describe_lengths, describe_shapes

#: Domain of the bridge's own ops (they exist only in prepared models).
BRIDGE_DOMAIN = "ai.sparse_attention_op"
PLAN_OP, CHECK_OP, KERNEL_OP = "SparseAttentionPlan", "SparseAttentionCacheCheck", "SparseAttentionKernel"

#: The bridge ops' interface: their inputs and outputs. Prepared models and GenAI folders
#: record it (model.py, genai.py), and one prepared under another format is refused with a
#: message instead of ORT's complaint about an op's output count. 1: until 2026-12-02;
#: 2: the plan op also gives the history rows (eight outputs), exact nodes have no check op.
BRIDGE_FORMAT = 2
#: Attributes prepare_model stamps on each of a node's ops, besides the operator's own.
NODE_KEY_ATTRIBUTE = "sao_node_key"  # "<session token>/<node identity>"
STORAGE_ATTRIBUTE = "sao_storage"  # "float16" when the graph keeps the node's tensors in float16
KV_CHECK_ATTRIBUTE = "sao_kv_check"  # "exact" or "fast"
LAYOUT_ATTRIBUTE = "sao_layout"  # "constant" (an initializer) or "per_call"
KV_CHECKS = ("exact", "fast")


def require_kv_check(kv_check, error: type[Exception] = ValueError) -> None:
    """The one check of a caller's ``kv_check`` argument (create_session, prepare_model,
    prepare_genai_folder, generate), raised as ``error``."""
    if kv_check not in KV_CHECKS:
        raise error(f"kv_check must be one of {KV_CHECKS}, got {kv_check!r}")


_F, _I32, _I64 = PyCustomOpDef.dt_float, PyCustomOpDef.dt_int32, PyCustomOpDef.dt_int64
_SHAPES = [_I64] * len(SHAPED_INPUTS)
_ATTRIBUTE_TYPES = {
    "num_heads": PyCustomOpDef.dt_int64,
    "kv_num_heads": PyCustomOpDef.dt_int64,
    "sparse_block_size": PyCustomOpDef.dt_int64,
    "scale": PyCustomOpDef.dt_float,
    "do_rotary": PyCustomOpDef.dt_int64,
    "rotary_interleaved": PyCustomOpDef.dt_int64,
    NODE_KEY_ATTRIBUTE: PyCustomOpDef.dt_string,
    STORAGE_ATTRIBUTE: PyCustomOpDef.dt_string,
    KV_CHECK_ATTRIBUTE: PyCustomOpDef.dt_string,
    LAYOUT_ATTRIBUTE: PyCustomOpDef.dt_string,
}
#: Poison that no Gather/ScatterND accepts as an index.
_BAD_INDEX = np.int64(2**62)
#: A Slice end of two entries for one axis: ORT refuses it (the history Slices' poison).
_SLICE_POISON = np.zeros(2, np.int64)
_SLICE_POISON.flags.writeable = False
#: An empty index list (no probe rows, no rotary rows), shared: the bridge copies outputs.
_NO_ROWS = np.zeros(0, np.int64)
_NO_ROWS.flags.writeable = False

log = logging.getLogger(__name__)


def session_token(node_key: str) -> str:
    return node_key.split("/", 1)[0]


class SessionRecords:
    """Per-session settings, and per (session, thread) the last run's error and stats.

    Keyed by thread: ORT runs a node on the thread that called ``run`` in sequential
    execution (which create_session sets), so concurrent runs of one session from several
    threads never see each other's errors or stats. Only sessions made by create_session
    register; a plain InferenceSession over prepare_model's output gets default settings,
    and its refused calls are logged (nothing would ever collect them).
    """

    def __init__(self):
        self._settings: dict[str, object] = {}
        self._errors: dict[tuple[str, int], BaseException] = {}
        self._stats: dict[tuple[str, int], dict] = {}
        self._pasts: dict[tuple[str, int], dict] = {}
        self._lock = threading.Lock()

    def open(self, token: str, settings) -> None:
        self._settings[token] = settings

    def close(self, token: str) -> None:
        with self._lock:
            self._settings.pop(token, None)
            for table in (self._errors, self._stats, self._pasts):
                for key in [k for k in table if k[0] == token]:
                    del table[key]

    def settings(self, token: str):
        return self._settings.get(token)

    def record_error(self, token: str, error: BaseException) -> None:
        if token not in self._settings:
            return
        with self._lock:
            # The first error of a run is the one to report; later nodes fail because of it.
            self._errors.setdefault((token, threading.get_ident()), error)

    def pop_error(self, token: str) -> BaseException | None:
        with self._lock:
            return self._errors.pop((token, threading.get_ident()), None)

    def record_stats(self, token: str, node_key: str, stats) -> None:
        if token in self._settings:
            with self._lock:  # close() walks the table on whatever thread collects the session
                self._stats.setdefault((token, threading.get_ident()), {})[node_key.split("/", 1)[1]] = stats

    def pop_stats(self, token: str) -> dict:
        with self._lock:
            return self._stats.pop((token, threading.get_ident()), {})

    def publish_pasts(self, token: str, views: dict) -> None:
        """This thread's run of the session feeds these pasts (node key -> (key view, value
        view), pasts.py): the nodes read their history from them instead of the bridge."""
        if views:
            with self._lock:  # close() walks the table on whatever thread collects the session
                self._pasts[(token, threading.get_ident())] = views

    def withdraw_pasts(self, token: str) -> None:
        """The run is over: its feeds may be freed, so no view of them may be read again, or
        kept (a numpy view would keep the caller's cache arrays alive): the tickets of this
        thread's run let go of theirs too."""
        with self._lock:
            published = self._pasts.pop((token, threading.get_ident()), None)
        if published is not None:
            tickets.drop_pasts(published)

    def pasts(self, node_key: str) -> tuple | None:
        views = self._pasts.get((session_token(node_key), threading.get_ident()))
        return None if views is None else views.get(node_key)


records = SessionRecords()


@dataclass(frozen=True)
class NodeInfo:
    """What the stamped attributes say about a node, parsed once per distinct attribute set."""

    attributes: OpAttributes
    node_key: str
    float16_storage: bool
    kv_check: str
    constant_layout: bool

    @property
    def token(self) -> str:
        return session_token(self.node_key)


_node_infos: dict[tuple, NodeInfo] = {}


def node_info(attributes: dict) -> NodeInfo:
    """Parse the attributes as the bridge delivers them (strings), once per distinct set."""
    key = tuple(attributes.items())
    info = _node_infos.get(key)
    if info is None:
        raw = dict(attributes)
        kv_check = raw.pop(KV_CHECK_ATTRIBUTE, "exact")
        if kv_check not in KV_CHECKS:
            raise SparseAttentionError(f"{KV_CHECK_ATTRIBUTE} must be one of {KV_CHECKS}, got {kv_check!r}")
        info = NodeInfo(
            node_key=raw.pop(NODE_KEY_ATTRIBUTE, ""),
            float16_storage=raw.pop(STORAGE_ATTRIBUTE, "float32") == "float16",
            kv_check=kv_check,
            constant_layout=raw.pop(LAYOUT_ATTRIBUTE, "per_call") == "constant",
            attributes=OpAttributes.from_mapping(raw),
        )
        _node_infos[key] = info
    return info


def _shapes(arrays) -> dict:
    """Shape tensors (from native Shape nodes) as tuples; an empty optional input is absent."""
    shapes = {}
    for name, array in zip(SHAPED_INPUTS, arrays):
        dims = tuple(int(d) for d in array)
        shapes[name] = None if dims == (0,) and name in ("key", "value", "cos_cache", "sin_cache") else dims
    return shapes


@dataclass(frozen=True, eq=False)
class _KnownShapes:
    """What a set of input shapes decides, worked out once: the shape facts, and the plan
    op's outputs that follow from them alone (the native Reshapes' target shapes)."""

    facts: ShapeFacts
    past_rows_shape: np.ndarray
    split_shape: np.ndarray
    output_shape: np.ndarray

    @classmethod
    def of(cls, facts: ShapeFacts) -> _KnownShapes:
        attrs, b, h = facts.attributes, facts.batch_size, facts.head_size
        split_heads = attrs.num_heads + 2 * attrs.kv_num_heads if facts.packed_qkv else attrs.kv_num_heads
        arrays = ([b * attrs.kv_num_heads * facts.max_cache_len, h], [b, facts.seq_len, split_heads, h],
                  [b, facts.seq_len, attrs.num_heads * h])
        frozen = []
        for values in arrays:
            array = np.array(values, np.int64)
            array.flags.writeable = False  # handed out every call (the bridge copies outputs)
            frozen.append(array)
        return cls(facts, *frozen)


_known_shapes: dict[tuple, _KnownShapes] = {}


def _describe(info: NodeInfo, shape_arrays, total, key_totals) -> tuple[CallShape, _KnownShapes]:
    """describe_call, remembered by shapes: a decode step has the shapes of the step before
    it, so only the length rules run again."""
    shapes_key = (info.attributes, b"".join(a.tobytes() for a in shape_arrays), tuple(len(a) for a in shape_arrays))
    known = _known_shapes.get(shapes_key)
    if known is None:
        known = _KnownShapes.of(describe_shapes(info.attributes, _shapes(shape_arrays)))
        if len(_known_shapes) > 256:
            _known_shapes.clear()
        _known_shapes[shapes_key] = known
    return describe_lengths(known.facts, total, key_totals), known


class _PlanRefused(Exception):
    """The node's plan op refused this call (and recorded why): the later ops only poison."""


@dataclass(eq=False)
class Issued:
    """What a node's plan op decided about one call, for the node's later ops."""

    number: int
    shape: CallShape
    #: The fast check's probes: (chunk rows, probe chunks (batch, probes)).
    probes: tuple | None = None
    #: Read-only views of the caller's past_key/past_value (pasts.py), when the run fed
    #: them where the op can read them; the history then never crosses the bridge: the
    #: kernel op hands the views to the executor, for the exact check or (with probes) the
    #: fast check on the GPU, which reads the history only if a probe differs.
    pasts: tuple | None = None


class _Tickets:
    """What each node's plan op decided, for its (check and) kernel ops of the same run.

    The plan op hands a ticket (a one-element int64 tensor) to the later ops instead of
    the eleven shape and length tensors they would otherwise take and describe again: fewer
    inputs for the bridge to copy, no second description. The ticket redeems an
    :class:`Issued`. Per thread: ORT runs the ops of one node on the thread that called
    ``run`` (sequential execution), in data order. A session's entries go when it closes
    (:meth:`forget`).
    """

    REFUSED = -1

    def __init__(self):
        self._issued: dict[tuple[int, str], Issued] = {}
        self._count = 0
        # Re-entrant: a session's finaliser (forget) can run inside issue on the same thread.
        self._lock = threading.RLock()

    def issue(self, node_key: str, shape: CallShape, **decided) -> np.ndarray:
        """A ticket for ``shape`` and what else the plan op ``decided`` (Issued's fields)."""
        with self._lock:
            self._count += 1
            number = self._count
            self._issued[(threading.get_ident(), node_key)] = Issued(number, shape, **decided)
        return np.array([number], np.int64)

    def redeem(self, node_key: str, ticket: np.ndarray) -> Issued:
        number = int(ticket.reshape(-1)[0]) if ticket.size == 1 else self.REFUSED
        if number == self.REFUSED:
            raise _PlanRefused()
        issued = self._issued.get((threading.get_ident(), node_key))
        if issued is None or issued.number != number:
            raise SparseAttentionError(
                f"SparseAttention: ticket {number} of node {node_key} was not issued by its plan op on this thread: the node's "
                "ops must run on one thread, in order (ORT_SEQUENTIAL execution; sparse_attention_op.session.session_options() refuses ORT_PARALLEL)")
        return issued

    def drop_pasts(self, node_keys) -> None:
        """Let go of the past views this thread's tickets of these nodes hold (their run is over)."""
        me = threading.get_ident()
        with self._lock:
            for node_key in node_keys:
                issued = self._issued.get((me, node_key))
                if issued is not None:
                    issued.pasts = None

    def forget(self, token: str) -> None:
        """Drop the entries of a closed session's nodes (every thread's)."""
        with self._lock:
            for key in [key for key in self._issued if session_token(key[1]) == token]:
                del self._issued[key]


tickets = _Tickets()


#: The process-wide executor, once a call has needed it (webgpu.get_executor: made once,
#: never replaced), kept here so that a decode step's ops do not look it up again.
_process_executor = None


def _executor():
    global _process_executor
    if _process_executor is None:
        from .webgpu import get_executor  # the GPU is touched on the first call, not at import

        _process_executor = get_executor()
    return _process_executor


def _settings(info: NodeInfo):
    settings = records.settings(info.token)
    if settings is None:  # a plain InferenceSession over prepare_model's output: the defaults
        from .webgpu.executor import ExecutionSettings

        settings = ExecutionSettings()
    return settings


# -- the ops ------------------------------------------------------------------------------
def plan_op(*inputs, **attributes):
    """Shapes and lengths -> probe row indices, the new tokens' rotary rows, how many layouts cross,
    the target shapes of the native Reshapes (past as rows, the new rows by head, the
    output), and how many history rows cross: none where the run fed the pasts where the op
    reads them in place (pasts.py; the fast check then runs on the GPU), all of them otherwise (the
    exact check reads them all, and so does a fast node without a check op whose pasts
    could not be read in place). Every native node that could fail on a malformed input
    depends on one of these outputs, so this op's own check runs first and its message is
    the one reported."""
    info = node_info(attributes)
    shape_arrays, (total, key_totals) = inputs[: len(SHAPED_INPUTS)], inputs[len(SHAPED_INPUTS) :]
    shape, known = _describe(info, shape_arrays, total, key_totals)
    pasts = None if shape.is_prompt else _readable_pasts(info, shape)
    probes, rows = None, _NO_ROWS
    if info.kv_check == "fast" and not shape.is_prompt:
        chunk_rows = chunk_rows_for(shape.head_size, model_itemsize(info.float16_storage))  # the node's record's (cache_record.py)
        chunks = probe_chunks(shape.past_lengths, chunk_rows, shape.total_sequence_length)
        if pasts is None:  # the probe rows cross to the check op
            rows = probe_row_indices(chunks, chunk_rows, shape.attributes.kv_num_heads, shape.max_cache_len)
        # Read in place, the probes go with the history to the kernel op, and the GPU
        # compares them with its cache (executor.py): the check op, if any, has nothing to do.
        probes = (chunk_rows, chunks)
    # The history rows that cross: none where the op reads them in place, all of them
    # otherwise (an exact node, or a fast node whose graph has no check op: see rewrite.py).
    history_rows = 0 if pasts is not None else shape.history_rows
    positions = shape.token_positions if shape.attributes.do_rotary else _NO_ROWS
    layouts = 0 if info.constant_layout and _executor().knows_layout(info.node_key) else shape.num_layout
    return (
        rows,
        positions,
        np.array([layouts], np.int64),
        known.past_rows_shape,
        known.split_shape,
        known.output_shape,
        np.array([history_rows], np.int64),
        tickets.issue(info.node_key, shape, probes=probes, pasts=pasts),
    )


def _readable_pasts(info: NodeInfo, shape: CallShape) -> tuple | None:
    """The views of this node's pasts the run published (pasts.py, which took them only in
    the node's float type), if they have the shape the node was given."""
    pasts = records.pasts(info.node_key)
    if pasts is None or any(view.shape != shape.cache_shape for view in pasts):
        return None
    return pasts


def _plan_poison(inputs):
    # An index no Gather accepts, one-element Reshape targets no tensor here fits, a Slice
    # end ORT refuses (an exact node then fails before its Slices copy the history; the
    # kernel op's poison would fail it later anyway), and a ticket that tells the later ops
    # to poison their outputs too.
    one = np.ones(1, np.int64)
    return (np.array([_BAD_INDEX]), np.zeros(0, np.int64), np.zeros(1, np.int64), one, one, one, _SLICE_POISON,
            np.array([_Tickets.REFUSED], np.int64))


def check_op(probe_key, probe_value, ticket, **attributes):
    """The fast check of a node whose pasts cross (prepare_model's graphs: no session reads
    them in place): probe rows -> how many history rows must cross (0: the resident cache
    holds the past, all of them otherwise)."""
    info = node_info(attributes)
    issued = tickets.redeem(info.node_key, ticket)
    shape = issued.shape
    if shape.is_prompt:
        return (np.zeros(1, np.int64),)
    chunk_rows, chunks = issued.probes  # a fast node's plan op chose them for every decode call
    b, heads, _, h = shape.cache_shape
    rows = (b, heads, chunks.shape[1] * chunk_rows, h)
    if probe_key.size == np.prod(rows) and _executor().cache_holds(
        info.node_key, shape, chunks, probe_key.reshape(rows), probe_value.reshape(rows), info.float16_storage, _settings(info)
    ):
        return (np.zeros(1, np.int64),)
    return (np.array([shape.history_rows], np.int64),)


def _check_poison(inputs):
    return (_SLICE_POISON,)


def kernel_op(query, key, value, history_key, history_value, block_rows, block_cols, cos_rows, sin_rows, ticket, **attributes):
    """The GPU call: output, rotated new key rows (empty without rotary), ScatterND indices."""
    info = node_info(attributes)
    issued = tickets.redeem(info.node_key, ticket)
    shape = issued.shape
    in_place = issued.pasts is not None
    if in_place:  # the history is read where the caller keeps it (pasts.py)
        history_key, history_value = issued.pasts
    layout_given = block_rows.shape[0] > 0
    rotary = shape.attributes.do_rotary
    call = assemble_call(
        shape,
        query,
        None if shape.packed_qkv else key,
        None if shape.packed_qkv else value,
        history_key,
        history_value,
        cos_rows if rotary else None,
        sin_rows if rotary else None,
        block_rows if layout_given else None,
        block_cols if layout_given else None,
        float16_storage=info.float16_storage,
        probe_chunks=issued.probes[1] if in_place and issued.probes is not None else None,
    )
    result = _executor().run(call, info.node_key, _settings(info), reuse_host_arrays=True)
    result.stats.history_read_in_place = in_place and result.stats.history_rows_compared > 0
    records.record_stats(info.token, info.node_key, result.stats)
    new_key = result.new_key if result.new_key is not None else np.zeros(0, np.float32)
    return result.output, new_key, scatter_indices(shape)


def _kernel_poison(inputs):
    return np.full(3, np.nan, np.float32), np.zeros(0, np.float32), np.full((1, 1, 1, 3), _BAD_INDEX)


# -- registration and the invocation hook ---------------------------------------------
@dataclass(frozen=True)
class _ArrayOp:
    opdef: object
    poison: object  # inputs -> outputs that make the next native node fail, or None
    raw_attributes: bool = False  # the body takes the attribute strings as delivered


_register_lock = threading.RLock()
_registered = False
#: PyOps whose outputs take the array path (by the id onnxruntime-extensions gives them).
_array_ops: dict[int, _ArrayOp] = {}


def _invoke(k_id, feed, attributes):
    """Hook for every PyOp of the process; ours return arrays, others go to the stock hook."""
    op = _array_ops.get(k_id)
    if op is None:
        return _ortx_compat.stock_invocation(k_id, feed, attributes)
    try:
        # Our own ops parse the attribute strings themselves (once per node, see node_info).
        arguments = attributes if op.raw_attributes else op.opdef.cast_attributes(attributes)
        outputs = _as_fetch(op.opdef.body(*feed, **arguments))
    except _PlanRefused:
        outputs = _as_fetch(op.poison(feed))  # the plan op already recorded and logged why
    except BaseException as error:  # noqa: BLE001 - anything escaping here aborts the process
        node_key = str(attributes.get(NODE_KEY_ATTRIBUTE, ""))
        token = session_token(node_key)
        if records.settings(token) is None:
            # Nothing will collect it: say it here, naming the node and the rule.
            log.error("SparseAttention node %s refused a call: %s", node_key.split("/", 1)[-1], error)
        else:
            log.debug("SparseAttention node %s refused a call: %s", node_key, error)
        records.record_error(token, error)
        if op.poison is None:
            raise
        outputs = _as_fetch(op.poison(feed))
    return (k_id,) + outputs


def _as_fetch(outputs) -> tuple:
    """(shape, flat array) per output: the C++ side memcpy's each array's data as it is."""
    fetch = []
    for array in outputs:
        array = np.ascontiguousarray(array)
        fetch += [array.shape, array.reshape(-1)]
    return tuple(fetch)


def register_array_op(function, poison=None, raw_attributes=False, **declaration):
    """Register a PyOp (``onnx_op`` arguments) whose outputs cross as numpy arrays.

    ``poison(inputs)`` gives the outputs of a call whose body raised (see the module doc);
    without it the exception escapes, which only a test or benchmark op may allow.
    """
    with _register_lock:
        opdef = onnx_op(**declaration)(function)
        _array_ops[opdef._id] = _ArrayOp(opdef, poison, raw_attributes)
        _ortx_compat.install_invocation_hook(_invoke)
        return opdef


def register() -> None:
    """Register the bridge's ops with onnxruntime-extensions (idempotent)."""
    global _registered
    with _register_lock:
        if _registered:
            return
        _ortx_compat.check_version()
        host_memory.keep_large_blocks()  # the bridge's copies of large inputs, warm from call to call
        common = dict(attrs=_ATTRIBUTE_TYPES, raw_attributes=True)
        register_array_op(plan_op, _plan_poison, op_type=f"{BRIDGE_DOMAIN}::{PLAN_OP}", inputs=_SHAPES + [_I32, _I32],
                          outputs=[_I64] * 8, **common)
        register_array_op(check_op, _check_poison, op_type=f"{BRIDGE_DOMAIN}::{CHECK_OP}", inputs=[_F, _F, _I64], outputs=[_I64], **common)
        register_array_op(kernel_op, _kernel_poison, op_type=f"{BRIDGE_DOMAIN}::{KERNEL_OP}",
                          inputs=[_F, _F, _F, _F, _F, _I32, _I32, _F, _F, _I64], outputs=[_F, _F, _I64], **common)
        _registered = True
