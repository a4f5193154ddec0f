"""The two passes of a call, declared as programs with their uniforms and dispatch sizes.

This module knows the WGSL templates' interfaces; the executor only binds buffers by name
and dispatches. Shape-dependent values are uniforms (one pipeline serves every shape);
head size, tiling and the rotary layout shape the code and so are constants.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..spec import SparseAttentionCall
from .programs import Binding, Program

VEC4 = "vec4<f32>"
VEC4_F16 = "vec4<f16>"
MAX_WORKGROUPS_PER_DIM = 65535


@dataclass(frozen=True)
class Tiling:
    """Code-shaping choices of the attention pass (tunables per adapter come later)."""

    workgroup_size: int
    q_tile: int
    # Rotate queries while staging them in the attention pass (True), or in a pass of their
    # own first. Fused saves a write and a read of every query; measured in BENCHMARKS.md.
    fuse_query_rotary: bool = True

    def value_parts(self, head_size: int) -> int:
        return max(1, self.workgroup_size // (head_size // 4))

    def workgroup_bytes(self, head_size: int) -> int:
        head_vec, wg, qt = head_size // 4, self.workgroup_size, self.q_tile
        parts = self.value_parts(head_size)
        shared = 2 * qt * head_vec * 16 + 3 * qt * wg * 4 + wg * 4
        return shared + (qt * parts * head_vec * 16 if parts > 1 else 0)


def choose_tiling(call: SparseAttentionCall, workgroup_storage_bytes: int, fuse_query_rotary: bool = True) -> Tiling:
    """Decode has one query per head, so a query tile would only idle; prefill shares each
    K/V load between four queries (they span at most two block rows for blocks >= 4)."""
    q_tile = 1 if call.seq_len == 1 else min(4, call.seq_len)
    tiling = Tiling(workgroup_size=64, q_tile=q_tile, fuse_query_rotary=fuse_query_rotary)
    while tiling.q_tile > 1 and tiling.workgroup_bytes(call.head_size) > workgroup_storage_bytes:
        tiling = dataclasses.replace(tiling, q_tile=tiling.q_tile // 2)
    return tiling


@dataclass(frozen=True)
class Pass:
    program: Program
    uniforms: dict
    workgroups: tuple[int, int, int]


def _rotary_constants(call: SparseAttentionCall, rotary: bool | None = None) -> tuple:
    rotary = call.attributes.do_rotary if rotary is None else rotary
    return (("rotary", rotary), ("rotary_interleaved", rotary and call.attributes.rotary_interleaved))


def _rotary_bindings(call: SparseAttentionCall, rotary: bool | None = None) -> tuple[Binding, ...]:
    rotary = call.attributes.do_rotary if rotary is None else rotary
    return (Binding("cos_cache", "f32"), Binding("sin_cache", "f32")) if rotary else ()


def _fold(groups: int) -> tuple[int, int, int]:
    """A 1-D dispatch folded into x * y workgroups (the kernel rebuilds the flat index)."""
    x = min(groups, MAX_WORKGROUPS_PER_DIM)
    return (x, -(-groups // x), 1)


def kv_append_pass(call: SparseAttentionCall, f16_cache: bool = False, workgroup_size: int = 256) -> Pass:
    attrs = call.attributes
    head_vec = call.head_size // 4
    cache = VEC4_F16 if f16_cache else VEC4
    bindings = (
        Binding("key_source", VEC4),
        Binding("value_source", VEC4),
        Binding("row_past", "u32"),
        Binding("key_cache", cache, writable=True),
        Binding("value_cache", cache, writable=True),
    )
    if attrs.do_rotary:
        bindings += (Binding("new_key", VEC4, writable=True),)
    bindings += _rotary_bindings(call)
    program = Program(
        template="kv_append.wgsl.jinja",
        bindings=bindings,
        uniforms=(
            ("count", "u32"),
            ("seq_len", "u32"),
            ("kv_num_heads", "u32"),
            ("max_cache_len", "u32"),
            ("src_row_vec", "u32"),
            ("key_offset_vec", "u32"),
            ("value_offset_vec", "u32"),
            ("rotary_half", "u32"),
        ),
        constants=(("head_size", call.head_size), ("workgroup_size", workgroup_size), ("cache_vec", cache),
                   ("round_keys_to_f16", attrs.do_rotary and call.float16_storage))
        + _rotary_constants(call),
    )
    count = call.batch_size * attrs.kv_num_heads * call.seq_len * head_vec
    if call.packed_qkv:
        src_row_vec = call.query_row_stride // 4
        key_offset = attrs.num_heads * head_vec
        value_offset = (attrs.num_heads + attrs.kv_num_heads) * head_vec
    else:
        src_row_vec, key_offset, value_offset = attrs.kv_num_heads * head_vec, 0, 0
    uniforms = dict(
        count=count,
        seq_len=call.seq_len,
        kv_num_heads=attrs.kv_num_heads,
        max_cache_len=call.max_cache_len,
        src_row_vec=src_row_vec,
        key_offset_vec=key_offset,
        value_offset_vec=value_offset,
        rotary_half=call.rotary_dim // 2,
    )
    return Pass(program, uniforms, _fold(-(-count // workgroup_size)))


def query_rotary_pass(call: SparseAttentionCall, workgroup_size: int = 256) -> Pass:
    """Rotated query heads into the compact ``q_rotated`` buffer (the unfused variant)."""
    attrs = call.attributes
    head_vec = call.head_size // 4
    program = Program(
        template="q_rotary.wgsl.jinja",
        bindings=(Binding("query", VEC4), Binding("row_past", "u32"), Binding("q_rotated", VEC4, writable=True)) + _rotary_bindings(call),
        uniforms=(("count", "u32"), ("seq_len", "u32"), ("num_heads", "u32"), ("query_row_vec", "u32"), ("rotary_half", "u32")),
        constants=(("head_size", call.head_size), ("workgroup_size", workgroup_size), ("rotary_interleaved", call.attributes.rotary_interleaved)),
    )
    count = call.batch_size * call.seq_len * attrs.num_heads * head_vec
    uniforms = dict(count=count, seq_len=call.seq_len, num_heads=attrs.num_heads, query_row_vec=call.query_row_stride // 4, rotary_half=call.rotary_dim // 2)
    return Pass(program, uniforms, _fold(-(-count // workgroup_size)))


def attention_pass(call: SparseAttentionCall, tiling: Tiling, f16_cache: bool = False) -> Pass:
    attrs = call.attributes
    cache = VEC4_F16 if f16_cache else VEC4
    # With an unfused query rotary the pass reads the compact rotated queries instead.
    prerotated = attrs.do_rotary and not tiling.fuse_query_rotary
    bindings = (
        Binding("q_rotated" if prerotated else "query", VEC4),
        Binding("key_cache", cache),
        Binding("value_cache", cache),
        Binding("row_past", "u32"),
        Binding("block_plan", "u32"),
        Binding("output", VEC4, writable=True),
    ) + _rotary_bindings(call, attrs.do_rotary and not prerotated)
    program = Program(
        template="attention.wgsl.jinja",
        bindings=bindings,
        uniforms=(
            ("seq_len", "u32"),
            ("num_heads", "u32"),
            ("kv_num_heads", "u32"),
            ("max_cache_len", "u32"),
            ("num_layout", "u32"),
            ("max_blocks", "u32"),
            ("block_size", "u32"),
            ("query_row_vec", "u32"),
            ("rotary_half", "u32"),
            ("scale", "f32"),
        ),
        constants=(
            ("head_size", call.head_size),
            ("workgroup_size", tiling.workgroup_size),
            ("q_tile", tiling.q_tile),
            ("value_parts", tiling.value_parts(call.head_size)),
            ("query_binding", "q_rotated" if prerotated else "query"),
        )
        + _rotary_constants(call, attrs.do_rotary and not prerotated),
    )
    uniforms = dict(
        seq_len=call.seq_len,
        num_heads=attrs.num_heads,
        kv_num_heads=attrs.kv_num_heads,
        max_cache_len=call.max_cache_len,
        num_layout=call.num_layout,
        max_blocks=call.max_blocks,
        block_size=attrs.sparse_block_size,
        query_row_vec=attrs.num_heads * call.head_size // 4 if prerotated else call.query_row_stride // 4,
        rotary_half=call.rotary_dim // 2,
        scale=call.scale,
    )
    workgroups = (-(-call.seq_len // tiling.q_tile), attrs.num_heads, call.batch_size)
    return Pass(program, uniforms, workgroups)
