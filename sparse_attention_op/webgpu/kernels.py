"""The dispatches of one call: which programs run, on which buffers, with which uniforms.

This module knows the WGSL templates' interfaces; the executor only provides the call's
buffers by name (a mapping of BufferRange) and runs the list it gets back, whatever it holds.
Shape-dependent values are uniforms (one pipeline serves every shape); head size, tiling,
the cache's element type and the rotary layout shape the code and so are constants.

Which attention pass a call takes (:class:`Route`) is worked out once per call
(:func:`route`) and handed to every function here that depends on it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sparse_attention_op.op.spec import CallShape
from sparse_attention_op.webgpu.programs import MAX_WORKGROUPS_PER_DIM, Binding, BufferRange, Dispatch, Program
from sparse_attention_op.webgpu.tuning import ROWS, SPLIT, TILED, DecodeSplit, PrefillTiling, Tuning, value_parts

VEC4 = "vec4<f32>"
VEC4_F16 = "vec4<f16>"


@dataclass(frozen=True)
class CacheFormat:
    """How the resident cache stores rows, and what the append pass must do to new keys."""

    rows: int  # rows per (batch, kv head) on the GPU
    f16: bool = False  # stored as f16 (float16-storage nodes on shader-f16 adapters)
    round_keys_to_f16: bool = False  # rotated keys rounded to float16 values (float16-storage nodes)

    @property
    def vec(self) -> str:
        return VEC4_F16 if self.f16 else VEC4


@dataclass(frozen=True, eq=False)
class Route:
    """How a call runs on this adapter: the attention pass its shape takes
    (Tuning.attention_route) and, on split-K, the slice count and how the passes share the
    work. Every field but ``splits`` follows from the call's shapes; ``splits`` also from
    its lengths (it stops changing once the history is a few thousand keys long)."""

    tuning: Tuning
    attention: str  # SPLIT, TILED, ROWS or SIMPLE
    splits: int = 0  # split-K's slices per query (0 on the other passes)
    fused_append: bool = False  # split-K's passes write the new rows (Tuning.decode_fuses_append)
    merges_in_split: bool = False  # split-K's last slices merge (Tuning.decode_merges_in_split)


def route(shape: CallShape, tuning: Tuning, attention: str | None = None) -> Route:
    """The route of one call (``attention``: its pass, where the caller has worked it out)."""
    if attention is None:
        attention = tuning.attention_route(shape)
    if attention != SPLIT:
        return Route(tuning, attention)
    return Route(tuning, SPLIT, slice_count(shape, tuning, SPLIT), tuning.decode_fuses_append(shape), tuning.decode_merges_in_split(shape))


def slice_count(shape: CallShape, tuning: Tuning, attention: str) -> int:
    """Split-K's slices per query of a call taking the ``attention`` pass (0 off split-K):
    the one part of a route that a decode step's lengths can change."""
    return tuning.decode_splits(shape) if attention == SPLIT else 0


def bind(label: str, program: Program, resources: Mapping[str, BufferRange], uniforms: dict, workgroups) -> Dispatch:
    """A dispatch of ``program`` on the resources its bindings name."""
    missing = [b.name for b in program.bindings if b.name not in resources]
    if missing:
        raise ValueError(f"{label} ({program.template}) binds {missing}, which the call does not provide (it has {sorted(resources)})")
    return Dispatch(label, program, {b.name: resources[b.name] for b in program.bindings}, uniforms, tuple(workgroups))


def _attention_reads(query: str, cache: CacheFormat, writes_cache: bool = False) -> tuple[Binding, ...]:
    """What every attention pass reads: its queries (by name), the cache (also written by a
    pass that stores the call's rows), each row's past and the layout."""
    return (
        Binding(query, VEC4),
        Binding("key_cache", cache.vec, writable=writes_cache),
        Binding("value_cache", cache.vec, writable=writes_cache),
        Binding("row_past", "u32"),
        Binding("block_plan", "u32"),
    )


def _rotary(shape: CallShape) -> tuple[tuple, tuple[Binding, ...]]:
    """The rotary constants and bindings of a program that rotates (nothing when it does not)."""
    attrs = shape.attributes
    constants = (("rotary", attrs.do_rotary), ("rotary_interleaved", attrs.do_rotary and attrs.rotary_interleaved))
    bindings = (Binding("cos_cache", "f32"), Binding("sin_cache", "f32")) if attrs.do_rotary else ()
    return constants, bindings


def _fold(groups: int) -> tuple[int, int, int]:
    """A 1-D dispatch folded into x * y workgroups (the kernel rebuilds the flat index)."""
    x = min(groups, MAX_WORKGROUPS_PER_DIM)
    return (x, -(-groups // x), 1)


def dispatch_limits_ok(shape: CallShape, route: Route) -> bool:
    """Whether this call's grids fit the adapter (checked before any GPU work)."""
    heads, batch, tuning = shape.attributes.num_heads, shape.batch_size, route.tuning
    if route.attention == SPLIT:
        along_x = route.splits * shape.seq_len
    elif route.attention == TILED:
        along_x = _tiled_rows(shape, tuning.prefill_tiling(shape).query_tile)
    elif route.attention == ROWS:
        lanes, queries = tuning.rows_shape(shape)
        along_x = _tiled_rows(shape, lanes * queries)
    else:
        along_x = -(-shape.seq_len // tuning.attention_queries(shape))
    return along_x <= MAX_WORKGROUPS_PER_DIM and heads <= MAX_WORKGROUPS_PER_DIM and batch <= MAX_WORKGROUPS_PER_DIM


def _new_row_io(shape: CallShape, cache: CacheFormat) -> tuple[Binding, ...]:
    """What a pass that writes the call's new rows binds (new_rows.wgsl.jinja): the key/value
    inputs, the cache it writes, and the rotated keys it hands back when rotary is on."""
    bindings = _NEW_ROW_SOURCES + (Binding("key_cache", cache.vec, writable=True), Binding("value_cache", cache.vec, writable=True))
    return bindings + ((Binding("new_key", VEC4, writable=True),) if shape.attributes.do_rotary else ())


#: The call's key/value inputs, which every reader of its new rows binds.
_NEW_ROW_SOURCES = (Binding("key_source", VEC4), Binding("value_source", VEC4))
_NEW_ROW_UNIFORMS = (("src_row_vec", "u32"), ("key_offset_vec", "u32"), ("value_offset_vec", "u32"))


def _new_row_uniforms(shape: CallShape) -> dict:
    """Where a token's key and value rows lie in the inputs: separate key/value tensors,
    or the K and V heads of the packed query's rows."""
    attrs, head_vec = shape.attributes, shape.head_size // 4
    if shape.packed_qkv:
        return dict(
            src_row_vec=shape.query_hidden // 4,
            key_offset_vec=attrs.num_heads * head_vec,
            value_offset_vec=(attrs.num_heads + attrs.kv_num_heads) * head_vec,
        )
    return dict(src_row_vec=attrs.kv_num_heads * head_vec, key_offset_vec=0, value_offset_vec=0)


def _new_row_constants(shape: CallShape, cache: CacheFormat) -> tuple:
    return (("cache_vec", cache.vec), ("round_keys_to_f16", shape.attributes.do_rotary and cache.round_keys_to_f16))


def kv_append(shape: CallShape, tuning: Tuning, cache: CacheFormat, resources: Mapping[str, BufferRange]) -> Dispatch:
    """Write the new key/value rows at [past, past + S) of each row (keys rotated there)."""
    attrs = shape.attributes
    head_vec = shape.head_size // 4
    rotary_constants, rotary_bindings = _rotary(shape)
    program = Program(
        template="kv_append.wgsl.jinja",
        bindings=_new_row_io(shape, cache) + (Binding("row_past", "u32"),) + rotary_bindings,
        uniforms=(("count", "u32"), ("seq_len", "u32"), ("kv_num_heads", "u32"), ("cache_rows", "u32"))
        + _NEW_ROW_UNIFORMS
        + (("rotary_half", "u32"),),
        constants=(("head_size", shape.head_size), ("workgroup_size", tuning.append_workgroup)) + _new_row_constants(shape, cache) + rotary_constants,
    )
    count = shape.batch_size * attrs.kv_num_heads * shape.seq_len * head_vec
    uniforms = dict(
        count=count,
        seq_len=shape.seq_len,
        kv_num_heads=attrs.kv_num_heads,
        cache_rows=cache.rows,
        rotary_half=shape.rotary_dim // 2,
        **_new_row_uniforms(shape),
    )
    return bind("kv_append", program, resources, uniforms, _fold(-(-count // tuning.append_workgroup)))


def attention(shape: CallShape, tuning: Tuning, cache: CacheFormat, resources: Mapping[str, BufferRange]) -> Dispatch:
    """One workgroup per (query tile, head, batch row) over the selected key blocks."""
    attrs = shape.attributes
    rotary_constants, rotary_bindings = _rotary(shape)
    query_tile = tuning.attention_queries(shape)
    program = Program(
        template="attention.wgsl.jinja",
        bindings=_attention_reads("query", cache) + (Binding("output", VEC4, writable=True),) + rotary_bindings,
        uniforms=(
            ("seq_len", "u32"),
            ("num_heads", "u32"),
            ("kv_num_heads", "u32"),
            ("cache_rows", "u32"),
            ("num_layout", "u32"),
            ("max_blocks", "u32"),
            ("block_size", "u32"),
            ("query_row_vec", "u32"),
            ("rotary_half", "u32"),
            ("scale", "f32"),
        ),
        constants=(
            ("head_size", shape.head_size),
            ("workgroup_size", tuning.attention_workgroup),
            ("q_tile", query_tile),
            ("value_parts", value_parts(tuning.attention_workgroup, shape.head_size)),
        )
        + rotary_constants,
    )
    uniforms = dict(
        seq_len=shape.seq_len,
        num_heads=attrs.num_heads,
        kv_num_heads=attrs.kv_num_heads,
        cache_rows=cache.rows,
        num_layout=shape.num_layout,
        max_blocks=shape.max_blocks,
        block_size=attrs.sparse_block_size,
        query_row_vec=shape.query_hidden // 4,
        rotary_half=shape.rotary_dim // 2,
        scale=shape.scale,
    )
    workgroups = (-(-shape.seq_len // query_tile), attrs.num_heads, shape.batch_size)
    return bind("attention", program, resources, uniforms, workgroups)


def _tiled_rows(shape: CallShape, query_tile: int) -> int:
    """Query tiles a batch row can need: tiles are aligned to absolute positions, so a
    call of S tokens starting mid-tile touches up to ceil(S / TQ) + 1 of them."""
    return -(-shape.seq_len // query_tile) + 1


def query_prep(shape: CallShape, tuning: Tuning, resources: Mapping[str, BufferRange]) -> Dispatch:
    """Queries rotated and scaled into (batch, head, token, head) rows for the tiled pass."""
    attrs = shape.attributes
    rotary_constants, rotary_bindings = _rotary(shape)
    program = Program(
        template="query_prep.wgsl.jinja",
        bindings=(Binding("query", VEC4), Binding("row_past", "u32"), Binding("prepared_query", VEC4, writable=True)) + rotary_bindings,
        uniforms=(("count", "u32"), ("seq_len", "u32"), ("num_heads", "u32"), ("query_row_vec", "u32"), ("rotary_half", "u32"), ("scale", "f32")),
        constants=(("head_size", shape.head_size), ("workgroup_size", tuning.append_workgroup)) + rotary_constants,
    )
    count = shape.batch_size * attrs.num_heads * shape.seq_len * (shape.head_size // 4)
    uniforms = dict(
        count=count,
        seq_len=shape.seq_len,
        num_heads=attrs.num_heads,
        query_row_vec=shape.query_hidden // 4,
        rotary_half=shape.rotary_dim // 2,
        scale=shape.scale,
    )
    return bind("query_prep", program, resources, uniforms, _fold(-(-count // tuning.append_workgroup)))


def _layout_uniforms(shape: CallShape, cache: CacheFormat) -> dict:
    """The uniforms every attention pass reads to find a head's cache rows and layout row."""
    attrs = shape.attributes
    return dict(
        seq_len=shape.seq_len,
        num_heads=attrs.num_heads,
        kv_num_heads=attrs.kv_num_heads,
        cache_rows=cache.rows,
        num_layout=shape.num_layout,
        max_blocks=shape.max_blocks,
        block_size=attrs.sparse_block_size,
        block_shift=attrs.sparse_block_size.bit_length() - 1,
    )


_LAYOUT_UNIFORMS = (
    ("seq_len", "u32"),
    ("num_heads", "u32"),
    ("kv_num_heads", "u32"),
    ("cache_rows", "u32"),
    ("num_layout", "u32"),
    ("max_blocks", "u32"),
    ("block_size", "u32"),
    ("block_shift", "u32"),
)


def _prefill_bindings(cache: CacheFormat, query: str = "prepared_query") -> tuple[Binding, ...]:
    """What the prefill passes bind: their queries (query_prep's, unless a tiled pass
    prepares the call's own), the cache, and the output."""
    return _attention_reads(query, cache) + (Binding("output", VEC4, writable=True),)


def prepares_queries(shape: CallShape, route: Route) -> bool:
    """Whether the call runs query_prep before its attention: the rows pass, and the tiled
    pass where its queries do not stay in registers (PrefillTiling.resident_query)."""
    attention = route.attention
    return attention == ROWS or (attention == TILED and not route.tuning.prefill_tiling(shape).resident_query)


#: Where a pass that rotates and scales the call's queries itself finds them.
_QUERY_UNIFORMS = (("query_row_vec", "u32"), ("rotary_half", "u32"), ("scale", "f32"))


def _query_uniforms(shape: CallShape) -> dict:
    return dict(query_row_vec=shape.query_hidden // 4, rotary_half=shape.rotary_dim // 2, scale=shape.scale)


def prefill_tiled(shape: CallShape, tiling: PrefillTiling, cache: CacheFormat, resources: Mapping[str, BufferRange]) -> Dispatch:
    """One workgroup per (query tile, head, batch row); heads along x so that the latest
    (heaviest) tiles of every head are dispatched first. With ``tiling.resident_query`` it
    reads the call's queries and rotates and scales them itself (no query_prep pass)."""
    uniforms = _layout_uniforms(shape, cache)
    if tiling.resident_query:
        rotary_constants, rotary_bindings = _rotary(shape)
        bindings = _prefill_bindings(cache, query="query") + rotary_bindings
        declared = _LAYOUT_UNIFORMS + _QUERY_UNIFORMS
        uniforms.update(_query_uniforms(shape))
    else:
        rotary_constants, bindings, declared = (), _prefill_bindings(cache), _LAYOUT_UNIFORMS
    program = Program(
        template="prefill_tiled.wgsl.jinja",
        bindings=bindings,
        uniforms=declared,
        constants=(
            ("head_vec", tiling.head_vec),
            ("query_tile", tiling.query_tile),
            ("key_tile", tiling.key_tile),
            ("query_regs", tiling.query_regs),
            ("key_regs", tiling.key_regs),
            ("depth_chunk", tiling.depth_chunk),
            ("value_chunk", tiling.value_chunk),
            ("value_cols", tiling.value_cols),
            ("probs_row", tiling.probs_row_vec4),
            ("smem_vec4", tiling.smem_vec4),
            ("prefetch", tiling.prefetch),
            ("fma_scores", tiling.fma_scores),
            ("resident_query", tiling.resident_query),
        )
        + rotary_constants,
    )
    workgroups = (shape.attributes.num_heads, _tiled_rows(shape, tiling.query_tile), shape.batch_size)
    return bind("attention_tiled", program, resources, uniforms, workgroups)


def prefill_rows(shape: CallShape, tuning: Tuning, cache: CacheFormat, resources: Mapping[str, BufferRange]) -> Dispatch:
    """The CPU adapters' pass: one subgroup per (query tile, head, batch row), a few queries
    per invocation, heads along x like the tiled pass."""
    lanes, queries = tuning.rows_shape(shape)
    program = Program(
        template="prefill_rows.wgsl.jinja",
        bindings=_prefill_bindings(cache),
        uniforms=_LAYOUT_UNIFORMS,
        constants=(("head_vec", shape.head_size // 4), ("rows", lanes), ("query_regs", queries)),
    )
    workgroups = (shape.attributes.num_heads, _tiled_rows(shape, lanes * queries), shape.batch_size)
    return bind("attention_rows", program, resources, _layout_uniforms(shape, cache), workgroups)


def decode_split(
    shape: CallShape,
    split: DecodeSplit,
    splits: int,
    cache: CacheFormat,
    resources: Mapping[str, BufferRange],
    fused_append: bool = False,
    merges: bool = False,
) -> Dispatch:
    """One workgroup per (slice, query, head, batch row): a partial softmax per slice.
    With ``fused_append`` it reads the call's own rows from the inputs (decode_merge writes them).
    With ``merges`` each query's last slice to finish merges the slices into the output
    (and writes the call's rows, with ``fused_append``): no decode_merge pass follows."""
    rotary_constants, rotary_bindings = _rotary(shape)
    bindings = _attention_reads("query", cache, writes_cache=merges and fused_append)  # the last slices store the call's rows
    # The merging slice reads the other slices' partials, written in this dispatch.
    bindings += (
        (
            Binding("partial_acc", VEC4, writable=True, coherent=merges),
            Binding("partial_stats", "vec2<f32>", writable=True, coherent=merges),
        )
        + (_NEW_ROW_SOURCES if fused_append else ())
        + rotary_bindings
    )
    if merges:
        bindings += (Binding("output", VEC4, writable=True), Binding("slice_counts", "atomic<u32>", writable=True))
        if fused_append and shape.attributes.do_rotary:
            bindings += (Binding("new_key", VEC4, writable=True),)
    uniforms = dict(_layout_uniforms(shape, cache), **_query_uniforms(shape), splits=splits, **(_new_row_uniforms(shape) if fused_append else {}))
    program = Program(
        template="decode_split.wgsl.jinja",
        bindings=bindings,
        uniforms=_LAYOUT_UNIFORMS + _QUERY_UNIFORMS + (("splits", "u32"),) + (_NEW_ROW_UNIFORMS if fused_append else ()),
        constants=(
            ("head_vec", split.head_vec),
            ("workgroup_size", split.workgroup),
            ("lanes_per_key", split.lanes_per_key),
            ("keys_per_group", split.keys_per_group),
            ("shared_query", split.shared_query),
            ("fused_append", fused_append),
            ("merges", merges),
        )
        + _new_row_constants(shape, cache)
        + rotary_constants,
    )
    workgroups = (splits * shape.seq_len, shape.attributes.num_heads, shape.batch_size)
    return bind("attention_split", program, resources, uniforms, workgroups)


def decode_merge(
    shape: CallShape, tuning: Tuning, splits: int, cache: CacheFormat, resources: Mapping[str, BufferRange], fused_append: bool = False
) -> Dispatch:
    """One workgroup per query: the slices' partials combined into the output; with
    ``fused_append`` also the call's new rows written into the cache (kv_append's job)."""
    attrs = shape.attributes
    head_vec = shape.head_size // 4
    workgroup = tuning.merge_workgroup_for(head_vec)
    rotary_constants, rotary_bindings = _rotary(shape)
    bindings = (
        Binding("partial_acc", VEC4),
        Binding("partial_stats", "vec2<f32>"),
        Binding("row_past", "u32"),
        Binding("output", VEC4, writable=True),
    )
    uniforms = dict(
        count=shape.batch_size * shape.seq_len * attrs.num_heads,
        seq_len=shape.seq_len,
        num_heads=attrs.num_heads,
        kv_num_heads=attrs.kv_num_heads,
        cache_rows=cache.rows,
        splits=splits,
    )
    declared = (("count", "u32"), ("seq_len", "u32"), ("num_heads", "u32"), ("kv_num_heads", "u32"), ("cache_rows", "u32"), ("splits", "u32"))
    if fused_append:
        bindings += _new_row_io(shape, cache) + rotary_bindings
        uniforms.update(_new_row_uniforms(shape), rotary_half=shape.rotary_dim // 2)
        declared += _NEW_ROW_UNIFORMS + (("rotary_half", "u32"),)
    else:
        bindings += (Binding("value_cache", cache.vec),)  # a query that sees no key averages V
    program = Program(
        template="decode_merge.wgsl.jinja",
        bindings=bindings,
        uniforms=declared,
        constants=(("head_vec", head_vec), ("workgroup_size", workgroup), ("fused_append", fused_append))
        + _new_row_constants(shape, cache)
        + rotary_constants,
    )
    return bind("attention_merge", program, resources, uniforms, _fold(uniforms["count"]))


#: Invocations of a probe_compare workgroup (one per vec4 of the probe rows).
PROBE_WORKGROUP = 256


def probe_grid(shape: CallShape, probes: int) -> tuple[int, int, int]:
    """The probe_compare grid for ``probes`` probe rows per batch row: one flag per workgroup."""
    vec4s = shape.batch_size * probes * (shape.head_size // 4)
    return _fold(max(1, -(-vec4s // PROBE_WORKGROUP)))


def probe_compare(shape: CallShape, cache: CacheFormat, resources: Mapping[str, BufferRange], probes: int) -> Dispatch:
    """The fast check on the GPU (probe_compare.wgsl.jinja): ``probes`` (kv head, row) pairs
    per batch row of the caller's past against the cache, one flag per workgroup."""
    program = Program(
        template="probe_compare.wgsl.jinja",
        bindings=(
            Binding("probe_slots", "u32"),
            Binding("row_past", "u32"),
            Binding("probe_key", VEC4),
            Binding("probe_value", VEC4),
            Binding("key_cache", cache.vec),
            Binding("value_cache", cache.vec),
            Binding("probe_flags", "u32", writable=True),
        ),
        uniforms=(("batch", "u32"), ("kv_num_heads", "u32"), ("probes", "u32"), ("cache_rows", "u32")),
        constants=(("head_vec", shape.head_size // 4), ("workgroup_size", PROBE_WORKGROUP)),
    )
    uniforms = dict(batch=shape.batch_size, kv_num_heads=shape.attributes.kv_num_heads, probes=probes, cache_rows=cache.rows)
    return bind("probe_compare", program, resources, uniforms, probe_grid(shape, probes))


def scratch_bytes(shape: CallShape, route: Route) -> dict[str, int]:
    """GPU-only buffers the dispatches need beyond the call's inputs, outputs and cache."""
    queries = shape.batch_size * shape.seq_len * shape.attributes.num_heads
    if route.attention == SPLIT:
        slices = queries * route.splits
        scratch = {"partial_acc": slices * shape.head_size * 4, "partial_stats": slices * 8}
        if route.merges_in_split:
            # Zero when created (WebGPU zeroes new buffers) and after every dispatch (the last
            # slice of each query resets its count), so shared by every node and call.
            scratch["slice_counts"] = queries * 4
        return scratch
    if prepares_queries(shape, route):
        return {"prepared_query": queries * shape.head_size * 4}
    return {}


def call_dispatches(shape: CallShape, route: Route, cache: CacheFormat, resources: Mapping[str, BufferRange]) -> list[Dispatch]:
    """Every dispatch of one call, in order: the new rows into the cache (kv_append), the
    queries prepared where the pass needs it (prepares_queries), then the attention by the
    pass of the call's route. Split-K decode on GPUs writes the new rows in its merge
    instead (Tuning.decode_fused_append), and merges in its split pass's last slices
    (Tuning.decode_split_merges): one dispatch per decode step."""
    tuning = route.tuning
    if route.attention == SPLIT:
        splits, split, fused = route.splits, tuning.decode_split(shape), route.fused_append
        if route.merges_in_split:
            passes = [decode_split(shape, split, splits, cache, resources, fused, merges=True)]
        else:
            passes = [decode_split(shape, split, splits, cache, resources, fused), decode_merge(shape, tuning, splits, cache, resources, fused)]
    elif route.attention == TILED:
        passes = [prefill_tiled(shape, tuning.prefill_tiling(shape), cache, resources)]
    elif route.attention == ROWS:
        passes = [prefill_rows(shape, tuning, cache, resources)]
    else:
        passes = [attention(shape, tuning, cache, resources)]
    if prepares_queries(shape, route):
        passes = [query_prep(shape, tuning, resources)] + passes
    return passes if route.fused_append else [kv_append(shape, tuning, cache, resources)] + passes
