"""Block-sparse layouts and their CSR form (the operator's block_row_indices/block_col_indices)."""

from __future__ import annotations

import numpy as np


def phi3_small_mask(max_blocks: int, num_layout: int, local_blocks: int = 16, vert_stride: int = 8) -> np.ndarray:
    """Boolean (num_layout, max_blocks, max_blocks) block mask of Phi-3-small's attention.

    Each block row sees its ``local_blocks`` most recent blocks plus every ``vert_stride``-th
    block column; the vertical stripes are shifted per layout so that different heads keep
    different columns (Phi-3-small's ``homo_head=False``).
    """
    rows = np.arange(max_blocks)[:, None]
    cols = np.arange(max_blocks)[None, :]
    step = max(1, vert_stride // num_layout)
    masks = []
    for layout in range(num_layout):
        local = (rows - cols) < local_blocks
        stripe = (cols + layout * step + 1) % vert_stride == 0
        masks.append((local | stripe) & (cols <= rows))
    return np.stack(masks)


def causal_mask(max_blocks: int, num_layout: int = 1) -> np.ndarray:
    """Every causal block selected: the dense layout."""
    lower = np.tril(np.ones((max_blocks, max_blocks), dtype=bool))
    return np.broadcast_to(lower, (num_layout, max_blocks, max_blocks)).copy()


def mask_to_csr(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """CSR of a boolean (num_layout, max_blocks, max_blocks) mask.

    Returns int32 ``block_row_indices`` (num_layout, max_blocks + 1) and
    ``block_col_indices`` (num_layout, max_nnz), right-padded with -1 as the schema asks.
    """
    mask = np.asarray(mask, dtype=bool)
    if mask.ndim != 3 or mask.shape[1] != mask.shape[2]:
        raise ValueError(f"mask must have shape (num_layout, max_blocks, max_blocks), got {mask.shape}")
    num_layout, max_blocks, _ = mask.shape
    counts = mask.sum(axis=2)
    rows = np.zeros((num_layout, max_blocks + 1), dtype=np.int32)
    rows[:, 1:] = np.cumsum(counts, axis=1)
    max_nnz = max(1, int(rows[:, -1].max()))
    cols = np.full((num_layout, max_nnz), -1, dtype=np.int32)
    for layout in range(num_layout):
        listed = np.nonzero(mask[layout])[1]  # row-major order: columns of row 0, then row 1, ...
        cols[layout, : listed.size] = listed
    return rows, cols
