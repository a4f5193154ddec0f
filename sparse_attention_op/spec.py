"""The operator contract of ``com.microsoft.SparseAttention`` and one validated call.

Everything the executor needs to know about a call is derived here, once, from the raw
inputs the bridge hands over: shapes, the per-row history, prompt/decode mode and the
layout facts. The result is an immutable :class:`SparseAttentionCall`; the executor never
looks at ONNX and never re-derives any of it. Every malformed input raises
:class:`SparseAttentionInputError` naming the input and the rule it broke, before any GPU
work (DESIGN.md section 1 lists the rules; those ORT's kernel misses are checked too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

DOMAIN = "com.microsoft"
OP_TYPE = "SparseAttention"

#: Input slots in schema order; the bridge always passes all eleven (absent ones as
#: empty placeholders, see model.py).
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
INT_INPUTS = ("block_row_indices", "block_col_indices", "total_sequence_length", "key_total_sequence_lengths")

#: Largest value the kernels index with 32-bit unsigned arithmetic. Sizes above it would
#: wrap on the GPU, so they are refused here (ORT refuses int32 overflow likewise).
MAX_INDEX = 2**31 - 1


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
    def from_mapping(cls, attrs: Mapping[str, object]) -> "OpAttributes":
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

    @property
    def group_size(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.num_heads // self.kv_num_heads


def _flag(attrs: Mapping[str, object], name: str) -> bool:
    value = int(attrs.get(name, 0))
    if value not in (0, 1):
        _fail(name, f"must be 0 or 1, got {value}")
    return bool(value)


def _readonly(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


@dataclass(frozen=True)
class SparseAttentionCall:
    """One validated call: every fact the executor needs, and the (read-only) tensors.

    ``past_lengths[b]`` is how many cache rows of batch row ``b`` precede this call's
    tokens; its new rows land at ``[past, past + seq_len)``. In a prompt it is 0 for every
    row, and rows ``t >= key_totals[b]`` of the prompt are padding.
    """

    attributes: OpAttributes
    batch_size: int
    seq_len: int
    head_size: int
    max_cache_len: int
    num_layout: int
    max_blocks: int
    max_nnz: int
    packed_qkv: bool
    total_sequence_length: int
    is_prompt: bool
    past_lengths: tuple[int, ...]
    key_totals: tuple[int, ...]
    rotary_dim: int
    tensors: Mapping[str, np.ndarray] = field(repr=False, compare=False)
    #: The graph keeps this node's tensors in float16 and casts around it (model.py):
    #: values the op creates (rotated keys) are rounded to float16 values so that the
    #: presents survive the cast to float16 and back unchanged.
    float16_storage: bool = False

    @property
    def mode(self) -> str:
        if self.is_prompt:
            return "prompt"
        return "decode" if self.seq_len == 1 else "chunked_prefill"

    @property
    def scale(self) -> float:
        """The effective softmax scale (0 in the attribute means 1/sqrt(head_size))."""
        scale = self.attributes.scale
        return scale if scale > 0 else 1.0 / float(np.sqrt(self.head_size))

    @property
    def query_row_stride(self) -> int:
        """Elements per (batch, token) row of the query input."""
        return int(self.tensors["query"].shape[2])

    @property
    def cache_shape(self) -> tuple[int, int, int, int]:
        return (self.batch_size, self.attributes.kv_num_heads, self.max_cache_len, self.head_size)

    @property
    def output_shape(self) -> tuple[int, int, int]:
        return (self.batch_size, self.seq_len, self.attributes.num_heads * self.head_size)


def build_call(
    inputs: Sequence[np.ndarray] | Mapping[str, np.ndarray], attributes: OpAttributes, *, float16_storage: bool = False
) -> SparseAttentionCall:
    """Validate one call's inputs and describe it.

    ``inputs`` holds the eleven inputs in schema order (or a mapping by name); absent
    optional inputs (key/value when packed, cos/sin without rotary) are ``None`` or empty.
    Raises :class:`SparseAttentionInputError` for the first rule an input breaks.
    """
    tensors = _collect(inputs)
    nh, nkv = attributes.num_heads, attributes.kv_num_heads

    query = tensors["query"]
    if query.ndim != 3:
        _fail("query", f"must have rank 3 (batch, sequence, hidden), got shape {query.shape}")
    batch, seq_len, hidden = (int(d) for d in query.shape)
    if batch < 1 or seq_len < 1:
        _fail("query", f"batch and sequence dimensions must be at least 1, got shape {query.shape}")

    packed = tensors["key"] is None
    if packed != (tensors["value"] is None):
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
    if not packed:
        for name in ("key", "value"):
            expected = (batch, seq_len, nkv * head_size)
            if tensors[name].shape != expected:
                _fail(name, f"must have shape (batch, sequence, kv_num_heads * head_size) = {expected}, got {tensors[name].shape}")

    past_key = tensors["past_key"]
    if past_key.ndim != 4:
        _fail("past_key", f"must have rank 4 (batch, kv_num_heads, max_cache_len, head_size), got shape {past_key.shape}")
    max_cache_len = int(past_key.shape[2])
    expected_cache = (batch, nkv, max_cache_len, head_size)
    if past_key.shape != expected_cache:
        _fail("past_key", f"must have shape (batch, kv_num_heads, max_cache_len, head_size) = {expected_cache}, got {past_key.shape}")
    if tensors["past_value"].shape != past_key.shape:
        _fail("past_value", f"must have past_key's shape {past_key.shape}, got {tensors['past_value'].shape}")

    rows, cols = tensors["block_row_indices"], tensors["block_col_indices"]
    if rows.ndim != 2 or rows.shape[1] < 2:
        _fail("block_row_indices", f"must have shape (num_layout, max_blocks + 1) with max_blocks >= 1, got {rows.shape}")
    num_layout, max_blocks = int(rows.shape[0]), int(rows.shape[1]) - 1
    if num_layout < 1 or nh % num_layout:
        _fail("block_row_indices", f"num_layout = {num_layout} must be >= 1 and divide num_heads = {nh}")
    if cols.ndim != 2 or cols.shape[0] != num_layout:
        _fail("block_col_indices", f"must have shape (num_layout = {num_layout}, max_nnz), got {cols.shape}")
    max_nnz = int(cols.shape[1])
    if max_nnz > max_blocks * max_blocks:
        _fail("block_col_indices", f"max_nnz = {max_nnz} must not exceed max_blocks^2 = {max_blocks * max_blocks}")
    _check_csr(rows, cols, max_blocks)

    total_tensor = tensors["total_sequence_length"]
    if total_tensor.size != 1 or total_tensor.ndim > 1:
        _fail("total_sequence_length", f"must be a scalar or shape [1], got shape {total_tensor.shape}")
    total = int(total_tensor.reshape(-1)[0])
    if total < seq_len:
        _fail("total_sequence_length", f"must be >= the query's sequence length {seq_len}, got {total}")
    if total > max_cache_len:
        _fail("total_sequence_length", f"must be <= past_key's max_cache_len = {max_cache_len}, got {total}")
    if max_blocks * attributes.sparse_block_size < total:
        _fail("block_row_indices", f"max_blocks * sparse_block_size = {max_blocks * attributes.sparse_block_size} must cover total_sequence_length = {total}")

    key_totals_tensor = tensors["key_total_sequence_lengths"]
    if key_totals_tensor.shape != (batch,):
        _fail("key_total_sequence_lengths", f"must have shape (batch,) = ({batch},), got {key_totals_tensor.shape}")
    key_totals = tuple(int(v) for v in key_totals_tensor)
    is_prompt = total == seq_len
    low = 1 if is_prompt else seq_len
    for b, value in enumerate(key_totals):
        if not low <= value <= total:
            mode = "a prompt" if is_prompt else "a call with history"
            _fail("key_total_sequence_lengths", f"entry {b} = {value} must lie in [{low}, {total}] for {mode} (sequence length {seq_len}, total {total})")
    past_lengths = tuple(0 if is_prompt else value - seq_len for value in key_totals)

    rotary_dim = _check_rotary(tensors, attributes, head_size, total)

    for name, size in (("past_key", past_key.size), ("query", query.size)):
        if size > MAX_INDEX:
            _fail(name, f"has {size} elements, more than 32-bit GPU indexing allows ({MAX_INDEX})")

    return SparseAttentionCall(
        attributes=attributes,
        batch_size=batch,
        seq_len=seq_len,
        head_size=head_size,
        max_cache_len=max_cache_len,
        num_layout=num_layout,
        max_blocks=max_blocks,
        max_nnz=max_nnz,
        packed_qkv=packed,
        total_sequence_length=total,
        is_prompt=is_prompt,
        past_lengths=past_lengths,
        key_totals=key_totals,
        rotary_dim=rotary_dim,
        tensors={name: (None if t is None else _readonly(t)) for name, t in tensors.items()},
        float16_storage=float16_storage,
    )


def _check_head_size(head_size: int) -> None:
    if head_size % 8 or head_size == 0:
        _fail("query", f"head_size must be a positive multiple of 8, got {head_size}")
    if head_size > 256:
        # The attention pass stages a tile of queries in workgroup memory; 256 is the
        # largest head that fits every adapter's 16 KiB minimum with room to spare.
        _fail("query", f"head_size above 256 is not supported, got {head_size}")


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
        optional = name in ("key", "value", "cos_cache", "sin_cache")
        if optional and array.size == 0:
            tensors[name] = None  # the bridge's placeholder for an absent input
            continue
        expected = np.float32 if name in FLOAT_INPUTS else np.int32
        if array.dtype != expected:
            _fail(name, f"must be {np.dtype(expected).name}, got {array.dtype}")
        tensors[name] = array
    for name in INPUT_NAMES:
        required = name not in ("key", "value", "cos_cache", "sin_cache")
        if required and tensors[name] is None:
            _fail(name, "is required")
    return tensors


def _check_csr(rows: np.ndarray, cols: np.ndarray, max_blocks: int) -> None:
    """Row offsets start at 0, never decrease and stay in the column list; listed columns lie in [0, max_blocks)."""
    max_nnz = cols.shape[1]
    if np.any(rows[:, 0] != 0):
        layout = int(np.nonzero(rows[:, 0] != 0)[0][0])
        _fail("block_row_indices", f"layout {layout} must start at offset 0, got {int(rows[layout, 0])}")
    steps = np.diff(rows.astype(np.int64), axis=1)
    if np.any(steps < 0):
        layout, row = (int(i) for i in np.argwhere(steps < 0)[0])
        _fail("block_row_indices", f"offsets must never decrease (layout {layout}, row {row}: {int(rows[layout, row])} -> {int(rows[layout, row + 1])})")
    if np.any(rows[:, -1] > max_nnz):
        layout = int(np.nonzero(rows[:, -1] > max_nnz)[0][0])
        _fail("block_row_indices", f"layout {layout} ends at offset {int(rows[layout, -1])}, beyond block_col_indices' {max_nnz} columns")
    listed = np.arange(max_nnz)[None, :] < rows[:, -1:]
    bad = listed & ((cols < 0) | (cols >= max_blocks))
    if np.any(bad):
        layout, entry = (int(i) for i in np.argwhere(bad)[0])
        _fail("block_col_indices", f"listed column must lie in [0, max_blocks = {max_blocks}), got {int(cols[layout, entry])} (layout {layout}, entry {entry})")


def _check_rotary(tensors, attributes: OpAttributes, head_size: int, total: int) -> int:
    cos, sin = tensors["cos_cache"], tensors["sin_cache"]
    if not attributes.do_rotary:
        return 0
    if cos is None or sin is None:
        _fail("cos_cache" if cos is None else "sin_cache", "is required when do_rotary = 1")
    if head_size % 16:
        _fail("query", f"head_size must be a multiple of 16 when do_rotary = 1, got {head_size}")
    if cos.ndim != 2:
        _fail("cos_cache", f"must have rank 2 (max_rotary_len, rotary_dim / 2), got shape {cos.shape}")
    if sin.shape != cos.shape:
        _fail("sin_cache", f"must have cos_cache's shape {cos.shape}, got {sin.shape}")
    half = int(cos.shape[1])
    if half % 8 or half == 0 or half > head_size // 2:
        _fail("cos_cache", f"dimension 1 (rotary_dim / 2) must be a positive multiple of 8 and <= head_size / 2 = {head_size // 2}, got {half}")
    if cos.shape[0] < total:
        _fail("cos_cache", f"must hold at least total_sequence_length = {total} positions, got {cos.shape[0]}")
    return 2 * half
