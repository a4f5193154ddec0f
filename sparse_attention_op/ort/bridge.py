"""The kernel ONNX Runtime runs for each prepared SparseAttention node: ORT's tensors in,
one validated call to the executor, ORT's output buffers written.

prepare_model (model.py) replaces each ``com.microsoft::SparseAttention`` node by one node
of this module's op, ``ai.onnx.contrib::SparseAttentionWebGPU`` (``...Float16`` for float16
nodes), with the same inputs and outputs and the node's identity and its session's settings
(settings.py) stamped on as attributes. The op is a custom op of ORT's C ABI whose kernel is Python
(custom_op.py), so it reads every input where ORT holds it and writes every output into the
buffer ORT gives it: no tensor is copied to cross, whatever its size (docs/design.md section
4). Per call:

1. The inputs' shapes and lengths are validated (spec.py): every broken rule raises, naming
   the input and the rule, before any GPU work. Shapes repeat from step to step, so their
   rules run once per distinct set of shapes.
2. The executor runs the call (webgpu/executor.py). It is handed the caller's pasts as they
   lie: the exact check digests the history rows there, the fast check gathers its probe
   rows there and compares them with the GPU's cache on the GPU.
3. ``output`` is written, and ``present_key``/``present_value`` are built: the past (unless
   the caller bound past and present to one buffer, as ORT GenAI does: then it is already
   there) with the call's new rows written at ``past + t``; the keys as the GPU rotated them,
   so the presents and the GPU cache hold the same bits. A node whose pasts and presents are
   absent holds its cache itself (held_caches.py), which stands in for both.

A refused call raises out of the kernel: ORT answers ``run`` with an error whose message is
the rule (a session of create_session raises the op's own exception instead), and the
session keeps working. A bound output of the wrong shape is ORT's error too.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

from sparse_attention_op.op.spec import (
    INPUT_NAMES,
    SHAPED_INPUTS,
    CallShape,
    OpAttributes,
    SparseAttentionCall,
    SparseAttentionError,
    SparseAttentionInputError,
    assemble_call,
    describe_lengths,
    describe_shapes,
    held_cache_shape,
    new_rows,
)
from sparse_attention_op.ort import custom_op
from sparse_attention_op.ort import extensions as _ortx_compat
from sparse_attention_op.ort.custom_op import FLOAT, FLOAT16, INT32, OpDeclaration, Slot
from sparse_attention_op.ort.held_caches import held_caches
from sparse_attention_op.ort.presents import copy_past, write_rows
from sparse_attention_op.settings import SessionSettings, SettingsError
from sparse_attention_op.webgpu import host_threads
from sparse_attention_op.webgpu.executor import get_executor

#: Domain of the bridge's op: onnxruntime-extensions' own, under which its library
#: registers the ops added to it (custom_op.py).
BRIDGE_DOMAIN = "ai.onnx.contrib"
#: The op per element type T of the node.
OP_TYPES = {np.dtype(np.float32): "SparseAttentionWebGPU", np.dtype(np.float16): "SparseAttentionWebGPUFloat16"}

#: The bridge op's interface. Prepared models and GenAI folders record it (model.py,
#: genai.py), and one prepared under another format is refused with a message to prepare
#: it again. 1 and 2: PyOps; 3: one custom op per node, with the operator's own inputs and
#: outputs, and the cache check as an attribute; 4: all of a session's settings as one attribute.
BRIDGE_FORMAT = 4
#: Attributes prepare_model stamps on each node, besides the operator's own.
NODE_KEY_ATTRIBUTE = "sao_node_key"  # "<session token>/<node identity>"
SETTINGS_ATTRIBUTE = "sao_settings"  # SessionSettings.to_attribute()


_ATTRIBUTES = (
    ("num_heads", int),
    ("kv_num_heads", int),
    ("sparse_block_size", int),
    ("scale", float),
    ("do_rotary", int),
    ("rotary_interleaved", int),
    (NODE_KEY_ATTRIBUTE, str),
    (SETTINGS_ATTRIBUTE, str),
)
_QUERY, _KEY, _VALUE, _PAST_KEY, _PAST_VALUE, _ROWS, _COLS, _TOTAL, _KEY_TOTALS, _COS, _SIN = range(len(INPUT_NAMES))
_OPTIONAL = (_KEY, _VALUE, _PAST_KEY, _PAST_VALUE, _COS, _SIN)  # pasts: absent when the node holds its cache

log = logging.getLogger(__name__)


def session_token(node_key: str) -> str:
    return node_key.split("/", 1)[0]


class SessionRecords:
    """Per (session, thread), the last run's error and stats, for the sessions that collect them.

    Keyed by thread: ORT runs a node on the thread that called ``run`` (sequential
    execution, which create_session requires), so concurrent runs of one session from
    several threads never see each other's errors or stats. Only sessions made by
    create_session register; a plain InferenceSession over prepare_model's output runs with
    the settings stamped on its nodes, and its refused calls are logged as well as raised by ORT.
    """

    def __init__(self):
        self._open: set[str] = set()
        self._errors: dict[tuple[str, int], BaseException] = {}
        self._stats: dict[tuple[str, int], dict] = {}
        self._lock = threading.Lock()

    def open(self, token: str) -> None:
        self._open.add(token)

    def close(self, token: str) -> None:
        with self._lock:
            self._open.discard(token)
            for table in (self._errors, self._stats):
                for key in [k for k in table if k[0] == token]:
                    del table[key]

    def collects(self, token: str) -> bool:
        return token in self._open

    def record_error(self, token: str, error: BaseException) -> None:
        if token not in self._open:
            return
        with self._lock:
            # The first error of a run is the one to report; later nodes fail because of it.
            self._errors.setdefault((token, threading.get_ident()), error)

    def pop_error(self, token: str) -> BaseException | None:
        with self._lock:
            return self._errors.pop((token, threading.get_ident()), None)

    def record_stats(self, token: str, node_key: str, stats) -> None:
        if token in self._open:
            with self._lock:  # close() walks the table on whatever thread collects the session
                self._stats.setdefault((token, threading.get_ident()), {})[node_key.split("/", 1)[1]] = stats

    def pop_stats(self, token: str) -> dict:
        with self._lock:
            return self._stats.pop((token, threading.get_ident()), {})


records = SessionRecords()


@dataclass(frozen=True)
class NodeKernel:
    """What a node's attributes say, parsed once when its session is created."""

    attributes: OpAttributes
    node_key: str
    dtype: np.dtype  # the node's T
    settings: SessionSettings
    constant_layout: bool  # the layout's two tensors are initializers (the executor keeps it once seen)
    #: describe_shapes' verdicts by the inputs' shapes (_describe), the node's own: keyed by
    #: the shapes alone, whose hash is C's, not the attributes' dataclass hash.
    known_shapes: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    #: _held_shape's results by the inputs' shapes, for a node that holds its cache.
    held_shapes: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    @property
    def token(self) -> str:
        return session_token(self.node_key)

    @property
    def float16(self) -> bool:
        return self.dtype == np.float16


def _kernel_factory(dtype: np.dtype):
    def create(attributes: dict, constant_inputs: set) -> NodeKernel:
        raw = dict(attributes)
        try:
            settings = SessionSettings.from_attribute(raw.pop(SETTINGS_ATTRIBUTE, ""))
        except SettingsError as error:
            raise SparseAttentionError(f"{SETTINGS_ATTRIBUTE}: {error}") from None
        return NodeKernel(
            attributes=OpAttributes.from_mapping(raw),
            node_key=raw.pop(NODE_KEY_ATTRIBUTE, "") or "unnamed/unnamed",
            dtype=dtype,
            settings=settings,
            constant_layout={_ROWS, _COLS} <= constant_inputs,
        )

    return create


def _describe(kernel: NodeKernel, shapes: tuple, total: np.ndarray, key_totals: np.ndarray) -> CallShape:
    """The call's shape: the shape rules once per distinct set of shapes of the node (a
    decode step has the shapes of the step before it, so only the length rules run again;
    and one ShapeFacts object per set, which the key of the executor's step plans then
    matches by identity, without comparing fields)."""
    facts = _per_shapes(kernel.known_shapes, shapes, kernel.attributes, describe_shapes)
    return describe_lengths(facts, total, key_totals)


def _per_shapes(table: dict, shapes: tuple, attributes: OpAttributes, rule):
    """``rule(attributes, shapes by name)``, worked out once per distinct set of shapes (a
    decode step repeats the shapes of the step before it)."""
    found = table.get(shapes)
    if found is None:
        found = rule(attributes, dict(zip(SHAPED_INPUTS, shapes)))
        if len(table) > 64:
            table.clear()
        table[shapes] = found
    return found


_SHAPED_SLOTS = tuple(INPUT_NAMES.index(name) for name in SHAPED_INPUTS)


def compute(kernel: NodeKernel, context: custom_op.KernelContext) -> None:
    """One call of a node (the op's kernel; see the module doc). Raises for a refused call,
    after recording the error for the node's session (or logging it, for sessions that
    would not collect it)."""
    try:
        _compute(kernel, context)
    except BaseException as error:
        # The error outlives the run (the session raises it again), and its frames' locals
        # are views of ORT's tensors, which ORT frees when the run returns: a debugger or
        # a traceback printer reading them then would read freed memory. So they go.
        _drop_locals(error)
        if not records.collects(kernel.token):
            log.error("SparseAttention node %s refused a call: %s", kernel.node_key.split("/", 1)[-1], error)
        records.record_error(kernel.token, error)
        raise


def _drop_locals(error: BaseException) -> None:
    """Clear the local variables of every finished frame in ``error``'s traceback and in
    those of the exceptions it chains to."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)  # (frames still running are skipped)
        error = error.__cause__ or error.__context__


def _compute(kernel: NodeKernel, context: custom_op.KernelContext) -> None:
    start = time.perf_counter()
    tensors = context.inputs()
    shapes = tuple([None if tensors[i] is None else tensors[i].shape for i in _SHAPED_SLOTS])  # (a list is cheaper to build than a generator)
    held = None
    if tensors[_PAST_KEY] is None or tensors[_PAST_VALUE] is None:
        # A node without pasts holds its cache itself (held_caches.py): it stands in for them.
        held = held_caches.for_call(kernel.node_key, _held_shape(kernel, shapes), kernel.dtype)
        tensors[_PAST_KEY], tensors[_PAST_VALUE] = held.key, held.value
        shapes = tuple([None if tensors[i] is None else tensors[i].shape for i in _SHAPED_SLOTS])
    try:
        shape = _describe(kernel, shapes, tensors[_TOTAL], tensors[_KEY_TOTALS])
    except SparseAttentionInputError as error:
        if held is None or "past_key" not in error.rule:
            raise
        rows = held.key.shape[2]
        held_rule = f"{error.rule} (the node holds its cache: its past_key is a buffer of the {rows} rows its layout and cos/sin allow)"
        raise SparseAttentionInputError(error.input_name, held_rule) from None
    past_key, past_value = tensors[_PAST_KEY], tensors[_PAST_VALUE]
    if held is not None:
        held.check(shape)
    rotary = shape.attributes.do_rotary
    settings = kernel.settings
    executor = get_executor()  # (made on the first call: the GPU is touched then, not at import)
    known_layout = kernel.constant_layout and executor.knows_layout(kernel.node_key)
    as_f32 = _float32 if kernel.float16 else _as_is
    query = as_f32(tensors[_QUERY], "query")
    key, value = (None, None) if shape.packed_qkv else (as_f32(tensors[_KEY], "key"), as_f32(tensors[_VALUE], "value"))
    # Every output buffer before any GPU work: a bound output of the wrong shape is ORT's
    # error at this point, with nothing done. The output goes straight into ORT's buffer
    # where the types agree (no host copy of it at all).
    output = context.output(0, shape.output_shape)
    presents = [context.output(index, shape.cache_shape) for index in (1, 2)]
    if held is not None:
        if presents[0] is not None or presents[1] is not None:
            name = "present_key" if presents[0] is not None else "present_value"
            raise SparseAttentionInputError(name, "must be absent when past_key and past_value are (the node holds its cache itself)")
        presents = [held.key, held.value]  # the new rows go in place, as into a shared past/present buffer
    direct = output if output is not None and not kernel.float16 else None

    def while_gpu_runs():
        """The presents' parts that need no result of the GPU: the past's copy where the
        present is a buffer of its own (a plain run), the value rows, and the key rows
        unless the GPU rotates them."""
        for present, past in zip(presents, (past_key, past_value)):
            # Whole tensors of one shape overlap only if they are one buffer (bounds only:
            # ndarray.ctypes builds a Python object per use, microseconds each in a step).
            if present is not None and not np.may_share_memory(present, past):
                copy_past(present, past)
        if presents[1] is not None:
            write_rows(presents[1], shape, new_rows(shape, query, key, value, "value"))
        if presents[0] is not None and not rotary:
            write_rows(presents[0], shape, new_rows(shape, query, key, value, "key"))

    def make_call() -> SparseAttentionCall:
        """The call as the executor's run() takes it: the tensors checked against the shape,
        the layout's only where the executor does not hold it yet (asked here, when the call
        is made: an attempt at a replay may have freed what a closed session left)."""
        known_layout = kernel.constant_layout and executor.knows_layout(kernel.node_key)
        history = 0 if shape.is_prompt else shape.max_cache_len  # the whole pasts as they lie: the executor reads what it needs
        positions = shape.token_positions if rotary else None
        return assemble_call(
            shape,
            query,
            key,
            value,
            past_key[:, :, :history],
            past_value[:, :, :history],
            as_f32(tensors[_COS][positions], "cos") if rotary else None,
            as_f32(tensors[_SIN][positions], "sin") if rotary else None,
            None if known_layout else tensors[_ROWS],
            None if known_layout else tensors[_COLS],
            float16_storage=kernel.float16,
            fast_check=settings.kv_check == "fast" and not shape.is_prompt,
        )

    inputs_done = time.perf_counter()
    result = None
    if settings.kv_check == "fast" and known_layout and not shape.is_prompt:
        # A decode step that the node's step plan serves as it stands runs it straight from
        # these tensors (webgpu/step_plan.py); None: it takes the general call.
        result = executor.replay(
            kernel.node_key,
            settings,
            shape,
            query,
            key,
            value,
            past_key,
            past_value,
            tensors[_COS] if rotary else None,
            tensors[_SIN] if rotary else None,
            make_call,
            output=direct,
            while_gpu_runs=while_gpu_runs,
        )
    if result is None:
        result = executor.run(make_call(), kernel.node_key, settings, reuse_host_arrays=True, output=direct, while_gpu_runs=while_gpu_runs)
    outputs_start = time.perf_counter()
    if output is not None and direct is None:
        host_threads.copy_flat(output, result.output)
    if presents[0] is not None and rotary:  # the keys as the GPU rotated them
        write_rows(presents[0], shape, result.new_key)
    if held is not None:
        held_caches.advance(kernel.node_key, held, shape)
    phases = result.stats.phases
    phases["inputs"], phases["outputs"] = inputs_done - start, time.perf_counter() - outputs_start
    records.record_stats(kernel.token, kernel.node_key, result.stats)


def _held_shape(kernel: NodeKernel, shapes: tuple) -> tuple[int, ...]:
    """spec.held_cache_shape for a call without pasts."""
    return _per_shapes(kernel.held_shapes, shapes, kernel.attributes, held_cache_shape)


def _as_is(array, name: str):
    return array


def _float32(array, name: str):
    """A float16 node's tensor as the executor takes it (a prompt's, into a reused buffer)."""
    return None if array is None else host_threads.as_float32(array, name)


def _declaration(dtype: np.dtype) -> OpDeclaration:
    element = FLOAT16 if dtype == np.float16 else FLOAT
    inputs = tuple(
        Slot(element if name in ("query", "key", "value", "past_key", "past_value", "cos_cache", "sin_cache") else INT32, optional=i in _OPTIONAL)
        for i, name in enumerate(INPUT_NAMES)
    )
    outputs = (Slot(element), Slot(element, optional=True), Slot(element, optional=True))
    return OpDeclaration(OP_TYPES[dtype], inputs, outputs, _ATTRIBUTES)


_register_lock = threading.Lock()
_registered = False


def register() -> None:
    """Add the bridge's ops to onnxruntime-extensions' library (idempotent). Sessions that
    register the library afterwards (``register_custom_ops_library``) run them."""
    global _registered
    with _register_lock:
        if _registered:
            return
        library = _ortx_compat.library()
        for dtype in OP_TYPES:
            custom_op.define(_declaration(dtype), _kernel_factory(dtype), compute, library, rule_errors=(SparseAttentionError,))
        _registered = True


def forget_session(token: str, kernels: bool = True) -> None:
    """Drop what the bridge keeps for a closed session's nodes. ``kernels=False`` keeps
    their kernel objects: for owners whose end does not end ORT's sessions (an ORT GenAI
    model collected while a generator still runs its sessions)."""
    records.close(token)
    if kernels:
        # Held caches go with the kernels: a GenAI generator may still run a collected model's
        # sessions (and a reload of its folder, which keeps its token, finds them again).
        held_caches.forget(token)
        for op_type in OP_TYPES.values():
            custom_op.forget_kernels(op_type, lambda kernel: kernel.token == token)
