"""Float64 numpy reference of com.microsoft.SparseAttention (docs/design.md section 1).

This is the tests' oracle, so it is written straight from the specification and shares
no code with the executor: it builds the full boolean visibility matrix per head and
does plain softmax attention in float64. Slow and obvious on purpose.
"""

from __future__ import annotations

import numpy as np


def block_mask(block_row_indices: np.ndarray, block_col_indices: np.ndarray) -> np.ndarray:
    """Boolean (num_layout, max_blocks, max_blocks) mask: may block row r see block column c.

    The CSR rules of ORT's CPU kernel: a layout whose nnz reaches the dense triangular count
    is plain causal; a row listing exactly row + 1 entries is plain causal whatever its
    columns say; otherwise the listed columns form a boolean mask, so a repeated column
    counts once. Causality itself is applied per key later, not here.
    """
    rows = np.asarray(block_row_indices, dtype=np.int64)
    cols = np.asarray(block_col_indices, dtype=np.int64)
    num_layout, max_blocks = rows.shape[0], rows.shape[1] - 1
    dense_count = max_blocks * (max_blocks + 1) // 2
    lower = np.tril(np.ones((max_blocks, max_blocks), dtype=bool))
    mask = np.zeros((num_layout, max_blocks, max_blocks), dtype=bool)
    for layout in range(num_layout):
        if rows[layout, -1] >= dense_count:
            mask[layout] = lower
            continue
        for row in range(max_blocks):
            start, end = rows[layout, row], rows[layout, row + 1]
            if end - start == row + 1:
                mask[layout, row] = lower[row]
            else:
                mask[layout, row, cols[layout, start:end]] = True
    return mask


def apply_rotary(x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: bool) -> np.ndarray:
    """Rotate the last axis of x (..., S, H) at the given absolute positions (S,).

    Non-interleaved pairs d with d + rotary_dim/2; interleaved pairs 2i with 2i+1. Dims at
    and beyond rotary_dim pass through (partial rotary).
    """
    half = cos.shape[1]
    c = np.asarray(cos, np.float64)[positions]  # (S, half)
    s = np.asarray(sin, np.float64)[positions]
    out = np.array(x, dtype=np.float64, copy=True)
    if interleaved:
        even, odd = x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2]
        out[..., 0 : 2 * half : 2] = even * c - odd * s
        out[..., 1 : 2 * half : 2] = odd * c + even * s
    else:
        first, second = x[..., :half], x[..., half : 2 * half]
        out[..., :half] = first * c - second * s
        out[..., half : 2 * half] = second * c + first * s
    return out


def attend(queries, keys, values, positions, layout_mask, block_size: int, scale: float) -> np.ndarray:
    """Attention of queries at absolute ``positions`` over keys/values 0..n-1 of one head.

    Key j is visible to the query at position q when j <= q and block j // block_size is
    selected in row q // block_size of ``layout_mask``. A query that sees no key averages V
    over its whole causal history; one whose scores hold a NaN (a NaN or infinite input) is NaN.
    """
    # NaN or infinite inputs are data here: their rows become NaN, without warnings.
    with np.errstate(invalid="ignore"):
        key_pos = np.arange(keys.shape[0])
        causal = key_pos[None, :] <= positions[:, None]
        visible = causal & layout_mask[positions[:, None] // block_size, key_pos[None, :] // block_size]
        scores = np.where(visible, (queries @ keys.T) * scale, -np.inf)
        row_max = scores.max(axis=1, keepdims=True)
        # Whether a key is visible is structural: a NaN or infinite score (from a NaN or infinite
        # input) makes the row's softmax NaN; it is not a row that sees no key.
        seen = visible.any(axis=1)
        weights = np.where(visible, np.exp(scores - np.where(seen[:, None], row_max, 0.0)), 0.0)
        weights[~seen] = causal[~seen].astype(np.float64)
        weights /= weights.sum(axis=1, keepdims=True)
        return weights @ values


def sparse_attention_reference(
    query,
    key=None,
    value=None,
    past_key=None,
    past_value=None,
    block_row_indices=None,
    block_col_indices=None,
    total_sequence_length=None,
    key_total_sequence_lengths=None,
    cos_cache=None,
    sin_cache=None,
    *,
    num_heads: int,
    kv_num_heads: int,
    sparse_block_size: int,
    scale: float = 0.0,
    do_rotary: int = 0,
    rotary_interleaved: int = 0,
):
    """Return (output, present_key, present_value) in float64.

    key/value are None (or empty) for packed QKV. Present tensors are past plus the new
    rows at [past, past + S); every other cache row is carried over unchanged.
    """
    q_in = np.asarray(query, np.float64)
    batch, seq_len, hidden = q_in.shape
    packed = key is None or np.asarray(key).size == 0
    head_size = hidden // (num_heads + 2 * kv_num_heads) if packed else hidden // num_heads
    if packed:
        q_all = q_in[..., : num_heads * head_size]
        k_all = q_in[..., num_heads * head_size : (num_heads + kv_num_heads) * head_size]
        v_all = q_in[..., (num_heads + kv_num_heads) * head_size :]
    else:
        q_all, k_all, v_all = q_in, np.asarray(key, np.float64), np.asarray(value, np.float64)
    # (B, heads, S, H)
    q_heads = q_all.reshape(batch, seq_len, num_heads, head_size).transpose(0, 2, 1, 3)
    k_new = k_all.reshape(batch, seq_len, kv_num_heads, head_size).transpose(0, 2, 1, 3)
    v_new = v_all.reshape(batch, seq_len, kv_num_heads, head_size).transpose(0, 2, 1, 3)

    total = int(np.asarray(total_sequence_length).reshape(-1)[0])
    key_totals = np.asarray(key_total_sequence_lengths).reshape(-1).astype(np.int64)
    is_prompt = total == seq_len
    scale = scale if scale and scale > 0 else 1.0 / np.sqrt(head_size)
    mask_blocks = block_mask(block_row_indices, block_col_indices)
    num_layout = mask_blocks.shape[0]
    group = num_heads // kv_num_heads

    present_key = np.array(past_key, dtype=np.float64, copy=True)
    present_value = np.array(past_value, dtype=np.float64, copy=True)
    output = np.zeros((batch, seq_len, num_heads, head_size), dtype=np.float64)

    for b in range(batch):
        past = 0 if is_prompt else int(key_totals[b]) - seq_len
        positions = past + np.arange(seq_len)
        k_rows, q_rows = k_new[b], q_heads[b]
        if do_rotary:
            k_rows = apply_rotary(k_rows, positions, cos_cache, sin_cache, bool(rotary_interleaved))
            q_rows = apply_rotary(q_rows, positions, cos_cache, sin_cache, bool(rotary_interleaved))
        present_key[b, :, past : past + seq_len] = k_rows
        present_value[b, :, past : past + seq_len] = v_new[b]

        n_keys = past + seq_len
        for h in range(num_heads):
            layout_mask = mask_blocks[h % num_layout]
            kv = h // group
            keys, values = present_key[b, kv, :n_keys], present_value[b, kv, :n_keys]
            output[b, :, h] = attend(q_rows[h], keys, values, positions, layout_mask, sparse_block_size, scale)
    return output.reshape(batch, seq_len, num_heads * head_size), present_key, present_value
