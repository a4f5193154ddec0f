"""Unit-scale random inputs for one SparseAttention call, shared by tests, demo and benchmarks.

Unit scale matters: tiny inputs make every softmax uniform and every rotation look
right, which hides exactly the bugs the tests are for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from sparse_attention_op.op.layouts import mask_to_csr, phi3_small_mask
from sparse_attention_op.op.spec import OpAttributes


@dataclass
class CaseConfig:
    """Shape of a call; every field has the meaning of the operator's attribute or input."""

    batch: int = 1
    seq_len: int = 4
    num_heads: int = 4
    kv_num_heads: int = 2
    head_size: int = 16
    max_cache_len: int = 64
    sparse_block_size: int = 8
    num_layout: int = 2
    local_blocks: int = 2
    vert_stride: int = 2
    past_lengths: tuple[int, ...] | None = None  # None: a prompt
    prompt_lengths: tuple[int, ...] | None = None  # prompt: valid tokens per row (padding after)
    packed: bool = False
    do_rotary: bool = False
    rotary_interleaved: bool = False
    rotary_dim: int | None = None  # None: the whole head
    scale: float = 0.0
    attributes: dict = field(default_factory=dict, repr=False)

    def node_attributes(self) -> dict:
        attributes = OpAttributes(self.num_heads, self.kv_num_heads, self.sparse_block_size, self.scale, self.do_rotary, self.rotary_interleaved)
        return {**attributes.node_attributes(), **self.attributes}

    @property
    def max_blocks(self) -> int:
        return -(-self.max_cache_len // self.sparse_block_size)


def layout_arrays(config: CaseConfig) -> tuple[np.ndarray, np.ndarray]:
    mask = phi3_small_mask(config.max_blocks, config.num_layout, config.local_blocks, config.vert_stride)
    return mask_to_csr(mask)


def rotary_caches(max_len: int, rotary_dim: int, base: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """The usual RoPE tables: cos/sin of position * base^(-2i/rotary_dim), shape (max_len, rotary_dim/2)."""
    inv_freq = base ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)
    angles = np.arange(max_len, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


def random_inputs(config: CaseConfig, rng: np.random.Generator, past: tuple[np.ndarray, np.ndarray] | None = None) -> dict:
    """Inputs by name for one call. ``past`` supplies the cache (e.g. a previous present)."""
    c = config
    b, s, h = c.batch, c.seq_len, c.head_size
    if c.past_lengths is None:
        lengths = c.prompt_lengths or (s,) * b
        key_totals = np.asarray(lengths, dtype=np.int32)
        total = s
    else:
        key_totals = np.asarray(c.past_lengths, dtype=np.int32) + s
        total = int(key_totals.max())
    if past is None:
        cache_shape = (b, c.kv_num_heads, c.max_cache_len, h)
        past_key = rng.standard_normal(cache_shape, dtype=np.float32)
        past_value = rng.standard_normal(cache_shape, dtype=np.float32)
    else:
        past_key, past_value = (np.ascontiguousarray(a, dtype=np.float32) for a in past)
    rows, cols = layout_arrays(c)
    inputs = dict(
        past_key=past_key,
        past_value=past_value,
        block_row_indices=rows,
        block_col_indices=cols,
        total_sequence_length=np.array([total], dtype=np.int32),
        key_total_sequence_lengths=key_totals,
    )
    if c.packed:
        inputs["query"] = rng.standard_normal((b, s, (c.num_heads + 2 * c.kv_num_heads) * h), dtype=np.float32)
    else:
        inputs["query"] = rng.standard_normal((b, s, c.num_heads * h), dtype=np.float32)
        inputs["key"] = rng.standard_normal((b, s, c.kv_num_heads * h), dtype=np.float32)
        inputs["value"] = rng.standard_normal((b, s, c.kv_num_heads * h), dtype=np.float32)
    if c.do_rotary:
        cos, sin = rotary_caches(c.max_cache_len, c.rotary_dim or h)
        inputs["cos_cache"], inputs["sin_cache"] = cos, sin
    return inputs
