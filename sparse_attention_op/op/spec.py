"""The operator contract of ``com.microsoft.SparseAttention``: attributes, rules, one validated call.

Two layers, because a decode step repeats the shapes of the step before it:

* :func:`describe_call` validates everything that shapes and lengths determine and returns
  a :class:`CallShape`: batch, history per row, prompt or decode, head size, rotary span.
  It needs no tensor data. Its shape rules (:func:`describe_shapes`) run once per distinct
  set of shapes in the bridge, its length rules (:func:`describe_lengths`) on every call.
* :class:`SparseAttentionCall` adds the tensors one GPU call needs: the query and the new
  key/value rows, the caller's history rows (where they lie: the resident cache compares
  what it must), the cos/sin rows of this call's positions and the layout (absent when the
  node's layout is already known). :func:`build_call` makes one from the operator's eleven
  full inputs, which is how tests, benchmarks and direct executor users drive it.

Every malformed input raises :class:`SparseAttentionInputError` naming the input and the
rule it broke, before any GPU work. The rules are ORT's (docs/design.md, "The operator
contract"), plus those its CPU kernel misses.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

DOMAIN = "com.microsoft"
OP_TYPE = "SparseAttention"

#: Input slots in schema order.
INPUT_NAMES = (
    "query",
    "key",
    "value",
    "past_key",
    "past_value",
    "block_row_indices",
    "block_col_indices",
    "total_sequence_length",
    "key_total_sequence_lengths",
    "cos_cache",
    "sin_cache",
)
OUTPUT_NAMES = ("output", "present_key", "present_value")
FLOAT_INPUTS = ("query", "key", "value", "past_key", "past_value", "cos_cache", "sin_cache")
OPTIONAL_INPUTS = ("key", "value", "cos_cache", "sin_cache")
#: Inputs validated by their shapes once per distinct set of shapes; the other two are small int tensors read every call.
SHAPED_INPUTS = tuple(name for name in INPUT_NAMES if name not in ("total_sequence_length", "key_total_sequence_lengths"))

#: Largest value the kernels index with 32-bit unsigned arithmetic. Sizes above it would
#: wrap on the GPU, so they are refused here (ORT refuses int32 overflow likewise).
MAX_INDEX = 2**31 - 1

Shape = tuple[int, ...]


class SparseAttentionError(ValueError):
    """A SparseAttention node or call breaks the operator's contract."""


class SparseAttentionInputError(SparseAttentionError):
    """One input (or attribute) of a call breaks a rule; the message names both."""

    def __init__(self, name: str, rule: str):
        super().__init__(f"SparseAttention input '{name}': {rule}")
        self.input_name = name
        self.rule = rule


def _fail(name: str, rule: str) -> None:
    raise SparseAttentionInputError(name, rule)


@dataclass(frozen=True)
class OpAttributes:
    """The node's attributes, with the schema's defaults made explicit."""

    num_heads: int
    kv_num_heads: int
    sparse_block_size: int
    scale: float = 0.0
    do_rotary: bool = False
    rotary_interleaved: bool = False

    REQUIRED = ("num_heads", "kv_num_heads", "sparse_block_size")

    @classmethod
    def from_mapping(cls, attrs: Mapping[str, object]) -> OpAttributes:
        """Build from node attributes (ints/floats as ONNX or the bridge deliver them)."""
        for name in cls.REQUIRED:
            if name not in attrs:
                _fail(name, "attribute is required")
        attributes = cls(
            num_heads=int(attrs["num_heads"]),
            kv_num_heads=int(attrs["kv_num_heads"]),
            sparse_block_size=int(attrs["sparse_block_size"]),
            scale=float(attrs.get("scale", 0.0)),
            do_rotary=_flag(attrs, "do_rotary"),
            rotary_interleaved=_flag(attrs, "rotary_interleaved"),
        )
        attributes.validate()
        return attributes

    def validate(self) -> None:
        """Rules that depend on the attributes alone (model-level faults)."""
        if self.num_heads <= 0:
            _fail("num_heads", f"must be positive, got {self.num_heads}")
        if self.kv_num_heads <= 0:
            _fail("kv_num_heads", f"must be positive, got {self.kv_num_heads}")
        if self.num_heads % self.kv_num_heads:
            # ORT's CPU kernel aborts the process here; we refuse it instead.
            _fail("num_heads", f"must be a multiple of kv_num_heads ({self.num_heads} % {self.kv_num_heads} != 0)")
        block = self.sparse_block_size
        if block <= 0 or block & (block - 1):
            _fail("sparse_block_size", f"must be a positive power of two (the schema's choices are 16..128), got {block}")
        if not np.isfinite(self.scale) or self.scale < 0:
            _fail("scale", f"must be finite and >= 0 (0 means 1/sqrt(head_size)), got {self.scale}")

    def node_attributes(self) -> dict:
        """The attributes as a node carries them, the schema's defaults made explicit."""
        return dict(
            num_heads=self.num_heads,
            kv_num_heads=self.kv_num_heads,
            sparse_block_size=self.sparse_block_size,
            scale=float(self.scale),
            do_rotary=int(self.do_rotary),
            rotary_interleaved=int(self.rotary_interleaved),
        )


def _flag(attrs: Mapping[str, object], name: str) -> bool:
    value = int(attrs.get(name, 0))
    if value not in (0, 1):
        _fail(name, f"must be 0 or 1, got {value}")
    return bool(value)


@dataclass(frozen=True)
class ShapeFacts:
    """What a call's shapes alone determine (every shape rule passed): the part of
    :class:`CallShape` that a decode step shares with the step before it."""

    attributes: OpAttributes
    batch_size: int
    seq_len: int
    head_size: int
    query_hidden: int
    max_cache_len: int
    num_layout: int
    max_blocks: int
    max_nnz: int
    packed_qkv: bool
    rotary_dim: int
    max_rotary_len: int  # cos_cache rows (0 without rotary)


_FACT_NAMES = tuple(f.name for f in dataclasses.fields(ShapeFacts))


@dataclass(frozen=True)
class CallShape(ShapeFacts):
    """Every fact about one call that its shapes and lengths determine: the shapes' facts and
    the lengths.

    ``past_lengths[b]`` is how many cache rows of batch row ``b`` precede this call's
    tokens; its new rows land at ``[past, past + seq_len)``. In a prompt it is 0 for every
    row, and rows ``t >= key_totals[b]`` of the prompt are padding (written to the cache all
    the same, as ORT does, but never history: the next call's past ends at ``key_totals[b]``).
    """

    total_sequence_length: int
    is_prompt: bool
    past_lengths: tuple[int, ...]
    key_totals: tuple[int, ...]

    @functools.cached_property
    def facts(self) -> ShapeFacts:
        """The part its shapes determine (what a decode step shares with the step before);
        built once per call shape (the executor keys its launches by it every call)."""
        return ShapeFacts(**{name: getattr(self, name) for name in _FACT_NAMES})

    @property
    def scale(self) -> float:
        """The effective softmax scale (0 in the attribute means 1/sqrt(head_size))."""
        scale = self.attributes.scale
        return scale if scale > 0 else 1.0 / float(np.sqrt(self.head_size))

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        """past_key's shape: the model's cache, max_cache_len rows per (batch, kv head)."""
        return (self.batch_size, self.attributes.kv_num_heads, self.max_cache_len, self.head_size)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return (self.batch_size, self.seq_len, self.attributes.num_heads * self.head_size)

    @property
    def new_rows_shape(self) -> tuple[int, int, int, int]:
        """This call's new key (or value) rows, as the presents hold them: (batch, kv head, token, head)."""
        return (self.batch_size, self.attributes.kv_num_heads, self.seq_len, self.head_size)

    @property
    def history_rows(self) -> int:
        """Cache rows before this call that any batch row reads (0 in a prompt)."""
        return max(self.past_lengths)

    @property
    def rows_written(self) -> int:
        """Cache rows per batch row this call needs: every row's history plus its new tokens
        (a prompt's padding rows too, up to seq_len)."""
        return max(max(self.key_totals), self.history_rows + self.seq_len)

    @property
    def token_positions(self) -> np.ndarray:
        """Absolute position of every new token, (batch * seq_len,) in (batch row, token) order:
        the cos/sin rows a rotary call reads, one per token."""
        return (np.asarray(self.past_lengths, np.int64)[:, None] + np.arange(self.seq_len)).reshape(-1)


def describe_call(
    attributes: OpAttributes,
    shapes: Mapping[str, Shape | None],
    total_sequence_length: np.ndarray,
    key_total_sequence_lengths: np.ndarray,
) -> CallShape:
    """Validate what shapes and lengths determine; raise for the first broken rule.

    ``shapes`` gives each input of :data:`SHAPED_INPUTS` its shape, ``None`` for an absent
    optional input (key/value when packed, cos/sin without rotary). The shape rules
    (:func:`describe_shapes`) come first, then the length rules (:func:`describe_lengths`).
    """
    return describe_lengths(describe_shapes(attributes, shapes), total_sequence_length, key_total_sequence_lengths)


def describe_shapes(attributes: OpAttributes, shapes: Mapping[str, Shape | None]) -> ShapeFacts:
    """Every rule that the inputs' shapes decide, in the order the inputs come."""
    nkv = attributes.kv_num_heads
    batch, seq_len, hidden, packed, head_size = _query_facts(attributes, shapes)
    if not packed:
        expected = (batch, seq_len, nkv * head_size)
        for name in ("key", "value"):
            if shapes[name] != expected:
                _fail(name, f"must have shape (batch, sequence, kv_num_heads * head_size) = {expected}, got {shapes[name]}")

    past_key = shapes["past_key"]
    if past_key is None or len(past_key) != 4:
        _fail("past_key", f"must have rank 4 (batch, kv_num_heads, max_cache_len, head_size), got shape {past_key}")
    max_cache_len = past_key[2]
    expected_cache = (batch, nkv, max_cache_len, head_size)
    if past_key != expected_cache:
        _fail("past_key", f"must have shape (batch, kv_num_heads, max_cache_len, head_size) = {expected_cache}, got {past_key}")
    if shapes["past_value"] != past_key:
        _fail("past_value", f"must have past_key's shape {past_key}, got {shapes['past_value']}")

    num_layout, max_blocks, max_nnz = _layout_facts(attributes, shapes)
    rotary_dim, max_rotary_len = _check_rotary(shapes, attributes, head_size)

    for name, size in (("past_key", int(np.prod(past_key))), ("query", batch * seq_len * hidden)):
        if size > MAX_INDEX:
            _fail(name, f"has {size} elements, more than 32-bit GPU indexing allows ({MAX_INDEX})")

    return ShapeFacts(
        attributes=attributes,
        batch_size=batch,
        seq_len=seq_len,
        head_size=head_size,
        query_hidden=hidden,
        max_cache_len=max_cache_len,
        num_layout=num_layout,
        max_blocks=max_blocks,
        max_nnz=max_nnz,
        packed_qkv=packed,
        rotary_dim=rotary_dim,
        max_rotary_len=max_rotary_len,
    )


def held_cache_shape(attributes: OpAttributes, shapes: Mapping[str, Shape | None]) -> Shape:
    """The shape of the cache a node holds itself, for a call whose ``past_key`` and
    ``past_value`` are both absent: (batch, kv_num_heads, capacity, head_size), where the
    capacity is the longest sequence the call's inputs allow: the layout's
    max_blocks * sparse_block_size, and no more than cos_cache's rows with rotary. The rules
    for the other inputs' shapes run as usual afterwards, on this shape as the past's."""
    for name, other in (("past_key", "past_value"), ("past_value", "past_key")):
        if shapes[name] is not None:
            _fail(name, f"must be absent when {other} is (the node then holds its cache itself), or both given")
    batch, _, _, _, head_size = _query_facts(attributes, shapes)
    _, max_blocks, _ = _layout_facts(attributes, shapes)
    capacity = max_blocks * attributes.sparse_block_size
    if attributes.do_rotary:
        capacity = min(capacity, _check_rotary(shapes, attributes, head_size)[1])
    return (batch, attributes.kv_num_heads, capacity, head_size)


def _query_facts(attributes: OpAttributes, shapes: Mapping[str, Shape | None]) -> tuple[int, int, int, bool, int]:
    """(batch, sequence, hidden, packed QKV, head_size) after the query's rules."""
    nh, nkv = attributes.num_heads, attributes.kv_num_heads
    query = shapes["query"]
    if query is None or len(query) != 3:
        _fail("query", f"must have rank 3 (batch, sequence, hidden), got shape {query}")
    batch, seq_len, hidden = query
    if batch < 1 or seq_len < 1:
        _fail("query", f"batch and sequence dimensions must be at least 1, got shape {query}")
    packed = shapes["key"] is None
    if packed != (shapes["value"] is None):
        _fail("value" if packed else "key", "key and value must both be given, or both absent for packed QKV")
    if packed:
        heads_total = nh + 2 * nkv
        if hidden % heads_total:
            _fail("query", f"packed QKV hidden size {hidden} must be a multiple of num_heads + 2 * kv_num_heads = {heads_total}")
        head_size = hidden // heads_total
    else:
        if hidden % nh:
            _fail("query", f"hidden size {hidden} must be a multiple of num_heads = {nh}")
        head_size = hidden // nh
    _check_head_size(head_size)
    return batch, seq_len, hidden, packed, head_size


def _layout_facts(attributes: OpAttributes, shapes: Mapping[str, Shape | None]) -> tuple[int, int, int]:
    """(num_layout, max_blocks, max_nnz) after the layout's shape rules."""
    nh = attributes.num_heads
    rows, cols = shapes["block_row_indices"], shapes["block_col_indices"]
    if rows is None or len(rows) != 2 or rows[1] < 2:
        _fail("block_row_indices", f"must have shape (num_layout, max_blocks + 1) with max_blocks >= 1, got {rows}")
    num_layout, max_blocks = rows[0], rows[1] - 1
    if num_layout < 1 or nh % num_layout:
        _fail("block_row_indices", f"num_layout = {num_layout} must be >= 1 and divide num_heads = {nh}")
    if cols is None or len(cols) != 2 or cols[0] != num_layout:
        _fail("block_col_indices", f"must have shape (num_layout = {num_layout}, max_nnz), got {cols}")
    max_nnz = cols[1]
    if max_nnz > max_blocks * max_blocks:
        _fail("block_col_indices", f"max_nnz = {max_nnz} must not exceed max_blocks^2 = {max_blocks * max_blocks}")
    return num_layout, max_blocks, max_nnz


def describe_lengths(facts: ShapeFacts, total_sequence_length: np.ndarray, key_total_sequence_lengths: np.ndarray) -> CallShape:
    """Every rule that the two length inputs decide, given the shapes' facts: the call's shape."""
    seq_len, batch = facts.seq_len, facts.batch_size
    total_tensor = np.asarray(total_sequence_length)
    if total_tensor.size != 1 or total_tensor.ndim > 1:
        _fail("total_sequence_length", f"must be a scalar or shape [1], got shape {total_tensor.shape}")
    total = int(total_tensor.item())  # (item(): a Python number at once, no view or numpy scalar)
    if total < seq_len:
        _fail("total_sequence_length", f"must be >= the query's sequence length {seq_len}, got {total}")
    if total > facts.max_cache_len:
        _fail("total_sequence_length", f"must be <= past_key's max_cache_len = {facts.max_cache_len}, got {total}")
    covered = facts.max_blocks * facts.attributes.sparse_block_size
    if covered < total:
        _fail("block_row_indices", f"max_blocks * sparse_block_size = {covered} must cover total_sequence_length = {total}")

    key_totals_tensor = np.asarray(key_total_sequence_lengths)
    if key_totals_tensor.shape != (batch,):
        _fail("key_total_sequence_lengths", f"must have shape (batch,) = ({batch},), got {key_totals_tensor.shape}")
    key_totals = tuple(key_totals_tensor.tolist())  # Python ints
    is_prompt = total == seq_len
    low = 1 if is_prompt else seq_len
    for b, value in enumerate(key_totals):
        if not low <= value <= total:
            mode = "a prompt" if is_prompt else "a call with history"
            _fail(
                "key_total_sequence_lengths",
                f"entry {b} = {value} must lie in [{low}, {total}] for {mode} (sequence length {seq_len}, total {total})",
            )
    past_lengths = (0,) * batch if is_prompt else tuple([value - seq_len for value in key_totals])
    if facts.attributes.do_rotary and facts.max_rotary_len < total:
        _fail("cos_cache", f"must hold at least total_sequence_length = {total} positions, got {facts.max_rotary_len}")

    # Every field set directly: the frozen dataclass's __init__ sets its 16 fields one
    # object.__setattr__ at a time, a sizeable part of a decode step's host time in the bridge.
    shape = object.__new__(CallShape)
    fields = shape.__dict__
    fields.update(facts.__dict__ if type(facts) is ShapeFacts else {name: getattr(facts, name) for name in _FACT_NAMES})
    fields.update(total_sequence_length=total, is_prompt=is_prompt, past_lengths=past_lengths, key_totals=key_totals)
    if type(facts) is ShapeFacts:
        fields["facts"] = facts  # the cached property, filled with the equal facts at hand
    return shape


def _check_head_size(head_size: int) -> None:
    if head_size % 8 or head_size == 0:
        _fail("query", f"head_size must be a positive multiple of 8, got {head_size}")
    if head_size > 256:
        # The attention passes stage query tiles in workgroup memory; 256 is the largest
        # head that fits every adapter's 16 KiB minimum with room to spare.
        _fail("query", f"head_size above 256 is not supported, got {head_size}")


def _check_rotary(shapes, attributes: OpAttributes, head_size: int) -> tuple[int, int]:
    """(rotary_dim, max_rotary_len) after the rotary shape rules; (0, 0) without rotary."""
    cos, sin = shapes["cos_cache"], shapes["sin_cache"]
    if not attributes.do_rotary:
        return 0, 0
    if cos is None or sin is None:
        _fail("cos_cache" if cos is None else "sin_cache", "is required when do_rotary = 1")
    if head_size % 16:
        _fail("query", f"head_size must be a multiple of 16 when do_rotary = 1, got {head_size}")
    if len(cos) != 2:
        _fail("cos_cache", f"must have rank 2 (max_rotary_len, rotary_dim / 2), got shape {cos}")
    if sin != cos:
        _fail("sin_cache", f"must have cos_cache's shape {cos}, got {sin}")
    half = cos[1]
    if half % 8 or half == 0 or half > head_size // 2:
        _fail("cos_cache", f"dimension 1 (rotary_dim / 2) must be a positive multiple of 8 and <= head_size / 2 = {head_size // 2}, got {half}")
    return 2 * half, cos[0]


def check_layout(block_row_indices: np.ndarray, block_col_indices: np.ndarray) -> None:
    """The CSR's content: offsets start at 0, never decrease and stay in the column list;
    listed columns lie in [0, max_blocks). Shapes were checked by :func:`describe_call`."""
    rows, cols = np.asarray(block_row_indices), np.asarray(block_col_indices)
    max_blocks, max_nnz = rows.shape[1] - 1, cols.shape[1]
    if np.any(rows[:, 0] != 0):
        layout = int(np.nonzero(rows[:, 0] != 0)[0][0])
        _fail("block_row_indices", f"layout {layout} must start at offset 0, got {int(rows[layout, 0])}")
    steps = np.diff(rows.astype(np.int64), axis=1)
    if np.any(steps < 0):
        layout, row = (int(i) for i in np.argwhere(steps < 0)[0])
        _fail(
            "block_row_indices", f"offsets must never decrease (layout {layout}, row {row}: {int(rows[layout, row])} -> {int(rows[layout, row + 1])})"
        )
    if np.any(rows[:, -1] > max_nnz):
        layout = int(np.nonzero(rows[:, -1] > max_nnz)[0][0])
        _fail("block_row_indices", f"layout {layout} ends at offset {int(rows[layout, -1])}, beyond block_col_indices' {max_nnz} columns")
    listed = np.arange(max_nnz)[None, :] < rows[:, -1:]
    bad = listed & ((cols < 0) | (cols >= max_blocks))
    if np.any(bad):
        layout, entry = (int(i) for i in np.argwhere(bad)[0])
        _fail(
            "block_col_indices",
            f"listed column must lie in [0, max_blocks = {max_blocks}), got {int(cols[layout, entry])} (layout {layout}, entry {entry})",
        )


@dataclass(frozen=True)
class SparseAttentionCall:
    """One validated GPU call: its shape facts and the (read-only) tensors it needs.

    ``history_key``/``history_value`` hold cache rows ``[0, F)`` of every batch row, as the
    caller's past has them (the caller's own float32 or float16 arrays, or views of them):
    ``F == 0`` means "use what the resident cache holds" (a prompt, or a caller that checked
    the cache itself), otherwise ``F >= shape.history_rows`` and the cache compares them
    with what it holds (the exact check, or first the fast check with ``fast_check``). ``cos_rows``/``sin_rows`` are the rotary table
    rows of ``shape.token_positions``, one per new token. The layout arrays are ``None`` when the node's
    layout is already known to the executor.
    """

    shape: CallShape
    query: np.ndarray
    key: np.ndarray | None
    value: np.ndarray | None
    history_key: np.ndarray
    history_value: np.ndarray
    cos_rows: np.ndarray | None = None
    sin_rows: np.ndarray | None = None
    block_row_indices: np.ndarray | None = None
    block_col_indices: np.ndarray | None = None
    #: The node's tensors are float16 (the bridge converts the call's new rows to float32):
    #: values the op creates (rotated keys) are rounded to float16 values so that the
    #: float16 presents hold exactly what the GPU holds.
    float16_storage: bool = False
    #: With a history (the caller's past, read in place): check it with the fast check.
    #: The executor compares the probe rows (cache_record.probe_rows) with
    #: what the GPU holds, on the GPU, and reads the whole history (the exact check) only
    #: where a length or a probed row differs.
    fast_check: bool = False

    @property
    def has_history(self) -> bool:
        return self.history_key.shape[2] > 0

    def new_rows(self, which: str) -> np.ndarray:
        """This call's new key or value rows from the inputs (keys not rotated), as (batch, kv head, token, head)."""
        return new_rows(self.shape, self.query, self.key, self.value, which)


def new_rows(shape: CallShape, query: np.ndarray, key: np.ndarray | None, value: np.ndarray | None, which: str) -> np.ndarray:
    """A call's new key or value rows (``which``) from its query, key and value inputs (keys not
    rotated), as (batch, kv head, token, head): a view, also of packed QKV's rows."""
    attrs, h = shape.attributes, shape.head_size
    if shape.packed_qkv:
        start = (attrs.num_heads + (attrs.kv_num_heads if which == "value" else 0)) * h
        source = query[:, :, start : start + attrs.kv_num_heads * h]
    else:
        source = key if which == "key" else value
    return source.reshape(shape.batch_size, shape.seq_len, attrs.kv_num_heads, h).transpose(0, 2, 1, 3)


def _readonly(array: np.ndarray | None) -> np.ndarray | None:
    if array is None or not array.flags.writeable:  # (the bridge's views of ORT's inputs are read-only already)
        return array
    view = array.view()
    view.flags.writeable = False
    return view


def assemble_call(
    shape: CallShape,
    query: np.ndarray,
    key: np.ndarray | None,
    value: np.ndarray | None,
    history_key: np.ndarray,
    history_value: np.ndarray,
    cos_rows: np.ndarray | None = None,
    sin_rows: np.ndarray | None = None,
    block_row_indices: np.ndarray | None = None,
    block_col_indices: np.ndarray | None = None,
    *,
    float16_storage: bool = False,
    fast_check: bool = False,
) -> SparseAttentionCall:
    """Check the tensors against ``shape`` (the layout's content too, when given) and bundle them."""
    b, nkv, _, h = shape.cache_shape
    for name, history in (("past_key", history_key), ("past_value", history_value)):
        rows = history.shape[2] if history.ndim == 4 else -1
        if history.shape != (b, nkv, rows, h) or (0 < rows < shape.history_rows) or rows > shape.max_cache_len:
            _fail(
                name,
                f"history rows passed to the op must have shape ({b}, {nkv}, 0 or "
                f"{shape.history_rows}..{shape.max_cache_len}, {h}), got {history.shape}",
            )
    if history_key.shape != history_value.shape:
        _fail("past_value", f"history rows must match past_key's {history_key.shape}, got {history_value.shape}")
    if shape.attributes.do_rotary:
        for name, rows in (("cos_cache", cos_rows), ("sin_cache", sin_rows)):
            expected = (shape.batch_size * shape.seq_len, shape.rotary_dim // 2)
            if rows is None or rows.shape != expected:
                _fail(name, f"the rows of the call's tokens must have shape {expected}, got {None if rows is None else rows.shape}")
    if (block_row_indices is None) != (block_col_indices is None):
        _fail("block_col_indices", "the layout's two CSR tensors must be given together")
    if block_row_indices is not None:
        check_layout(block_row_indices, block_col_indices)
    if fast_check and history_key.shape[2] == 0:
        _fail("past_key", "the fast check needs the history rows (the caller's past) in the call")
    return SparseAttentionCall(
        shape=shape,
        query=_readonly(query),
        key=_readonly(key),
        value=_readonly(value),
        history_key=_readonly(history_key),
        history_value=_readonly(history_value),
        cos_rows=_readonly(cos_rows),
        sin_rows=_readonly(sin_rows),
        block_row_indices=_readonly(block_row_indices),
        block_col_indices=_readonly(block_col_indices),
        float16_storage=float16_storage,
        fast_check=fast_check,
    )


def build_call(
    inputs: Sequence[np.ndarray] | Mapping[str, np.ndarray],
    attributes: OpAttributes,
    *,
    float16_storage: bool = False,
    with_history: bool = True,
) -> SparseAttentionCall:
    """One call from the operator's eleven inputs (in schema order, or a mapping by name).

    Absent optional inputs (key/value when packed, cos/sin without rotary) are ``None`` or
    empty. The call carries the history rows every batch row reads (the exact check), or
    none with ``with_history=False`` (trust the resident cache, as after a passed fast check).
    Raises :class:`SparseAttentionInputError` for the first rule an input breaks.
    """
    tensors = _collect(inputs)
    shapes = {name: (None if tensors[name] is None else tuple(int(d) for d in tensors[name].shape)) for name in SHAPED_INPUTS}
    shape = describe_call(attributes, shapes, tensors["total_sequence_length"], tensors["key_total_sequence_lengths"])
    rows = shape.history_rows if with_history else 0
    positions = shape.token_positions
    rotary = shape.attributes.do_rotary
    return assemble_call(
        shape,
        tensors["query"],
        tensors["key"],
        tensors["value"],
        tensors["past_key"][:, :, :rows],
        tensors["past_value"][:, :, :rows],
        tensors["cos_cache"][positions] if rotary else None,
        tensors["sin_cache"][positions] if rotary else None,
        tensors["block_row_indices"],
        tensors["block_col_indices"],
        float16_storage=float16_storage,
    )


def _collect(inputs) -> dict[str, np.ndarray | None]:
    if isinstance(inputs, Mapping):
        unknown = set(inputs) - set(INPUT_NAMES)
        if unknown:
            _fail(sorted(unknown)[0], f"is not an input of SparseAttention (inputs: {', '.join(INPUT_NAMES)})")
        raw = [inputs.get(name) for name in INPUT_NAMES]
    else:
        raw = list(inputs)
        if len(raw) > len(INPUT_NAMES):
            _fail("inputs", f"SparseAttention takes at most {len(INPUT_NAMES)} inputs, got {len(raw)}")
        raw += [None] * (len(INPUT_NAMES) - len(raw))
    tensors: dict[str, np.ndarray | None] = {}
    for name, value in zip(INPUT_NAMES, raw):
        if value is None:
            tensors[name] = None
            continue
        array = np.asarray(value)
        if name in OPTIONAL_INPUTS and array.size == 0:
            tensors[name] = None  # an empty tensor stands for an absent optional input
            continue
        expected = np.float32 if name in FLOAT_INPUTS else np.int32
        if array.dtype != expected:
            _fail(name, f"must be {np.dtype(expected).name}, got {array.dtype}")
        tensors[name] = array
    for name in INPUT_NAMES:
        if name not in OPTIONAL_INPUTS and tensors[name] is None:
            _fail(name, "is required")
    return tensors
