"""The dispatches of one call: which programs run, on which buffers, with which uniforms.

This module knows the WGSL templates' interfaces; the executor only provides the call's
buffers by name (:class:`CallBuffers`) and runs the list it gets back, whatever it holds.
Shape-dependent values are uniforms (one pipeline serves every shape); head size, tiling,
the cache's element type and the rotary layout shape the code and so are constants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

from ..spec import CallShape
from .programs import MAX_WORKGROUPS_PER_DIM, Binding, BufferRange, Dispatch, Program
from .tuning import Tuning, value_parts

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


def bind(label: str, program: Program, resources: Mapping[str, BufferRange], uniforms: dict, workgroups) -> Dispatch:
    """A dispatch of ``program`` on the resources its bindings name."""
    missing = [b.name for b in program.bindings if b.name not in resources]
    if missing:
        raise ValueError(f"{label} ({program.template}) binds {missing}, which the call does not provide (it has {sorted(resources)})")
    return Dispatch(label, program, {b.name: resources[b.name] for b in program.bindings}, uniforms, tuple(workgroups))


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


def dispatch_limits_ok(shape: CallShape, tuning: Tuning) -> bool:
    """Whether this call's grids fit the adapter (checked before any GPU work)."""
    tile = tuning.attention_queries(shape)
    return -(-shape.seq_len // tile) <= MAX_WORKGROUPS_PER_DIM and shape.attributes.num_heads <= MAX_WORKGROUPS_PER_DIM and shape.batch_size <= MAX_WORKGROUPS_PER_DIM


def kv_append(shape: CallShape, tuning: Tuning, cache: CacheFormat, resources: Mapping[str, BufferRange]) -> Dispatch:
    """Write the new key/value rows at [past, past + S) of each row (keys rotated there)."""
    attrs = shape.attributes
    head_vec = shape.head_size // 4
    rotary_constants, rotary_bindings = _rotary(shape)
    bindings = (
        Binding("key_source", VEC4),
        Binding("value_source", VEC4),
        Binding("row_past", "u32"),
        Binding("key_cache", cache.vec, writable=True),
        Binding("value_cache", cache.vec, writable=True),
    )
    if attrs.do_rotary:
        bindings += (Binding("new_key", VEC4, writable=True),)
    program = Program(
        template="kv_append.wgsl.jinja",
        bindings=bindings + rotary_bindings,
        uniforms=(
            ("count", "u32"),
            ("seq_len", "u32"),
            ("kv_num_heads", "u32"),
            ("cache_rows", "u32"),
            ("src_row_vec", "u32"),
            ("key_offset_vec", "u32"),
            ("value_offset_vec", "u32"),
            ("rotary_half", "u32"),
        ),
        constants=(("head_size", shape.head_size), ("workgroup_size", tuning.append_workgroup), ("cache_vec", cache.vec),
                   ("round_keys_to_f16", attrs.do_rotary and cache.round_keys_to_f16)) + rotary_constants,
    )
    count = shape.batch_size * attrs.kv_num_heads * shape.seq_len * head_vec
    if shape.packed_qkv:
        src_row_vec = shape.query_hidden // 4
        key_offset = attrs.num_heads * head_vec
        value_offset = (attrs.num_heads + attrs.kv_num_heads) * head_vec
    else:
        src_row_vec, key_offset, value_offset = attrs.kv_num_heads * head_vec, 0, 0
    uniforms = dict(
        count=count,
        seq_len=shape.seq_len,
        kv_num_heads=attrs.kv_num_heads,
        cache_rows=cache.rows,
        src_row_vec=src_row_vec,
        key_offset_vec=key_offset,
        value_offset_vec=value_offset,
        rotary_half=shape.rotary_dim // 2,
    )
    return bind("kv_append", program, resources, uniforms, _fold(-(-count // tuning.append_workgroup)))


def attention(shape: CallShape, tuning: Tuning, cache: CacheFormat, resources: Mapping[str, BufferRange]) -> Dispatch:
    """One workgroup per (query tile, head, batch row) over the selected key blocks."""
    attrs = shape.attributes
    rotary_constants, rotary_bindings = _rotary(shape)
    query_tile = tuning.attention_queries(shape)
    program = Program(
        template="attention.wgsl.jinja",
        bindings=(
            Binding("query", VEC4),
            Binding("key_cache", cache.vec),
            Binding("value_cache", cache.vec),
            Binding("row_past", "u32"),
            Binding("block_plan", "u32"),
            Binding("output", VEC4, writable=True),
        ) + rotary_bindings,
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
        ) + rotary_constants,
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


def dispatch_key(shape: CallShape) -> CallShape:
    """What the dispatches of a call depend on: its shape without the lengths. Lengths are
    data (row_past), so a decode step can reuse the last step's dispatches; a kernel that
    needs a length-dependent choice must make it on the GPU, or add it here."""
    return dataclasses.replace(shape, past_lengths=(), key_totals=(), total_sequence_length=0, is_prompt=False)


def scratch_bytes(shape: CallShape, tuning: Tuning) -> dict[str, int]:
    """GPU-only buffers the dispatches need beyond the call's inputs, outputs and cache."""
    return {}


def call_dispatches(shape: CallShape, tuning: Tuning, cache: CacheFormat, resources: Mapping[str, BufferRange]) -> list[Dispatch]:
    """Every dispatch of one call, in order."""
    return [kv_append(shape, tuning, cache, resources), attention(shape, tuning, cache, resources)]
