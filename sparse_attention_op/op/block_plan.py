"""The CSR block layout resolved once on the host into what the attention pass walks.

The operator's CSR carries rules the kernel should not re-derive for every key (see
docs/design.md section 1): a layout with the dense triangular count is plain causal, a row
listing exactly row + 1 entries is plain causal whatever its columns say, and a repeated
column counts once. Resolving them here, per layout row, leaves the kernel a plain loop:

* a dense row is marked ``DENSE_ROW`` and swept from key 0 to the causal bound;
* a sparse row lists its distinct blocks in ascending order, dropping blocks after the
  row itself (no query of the row can see them), so the kernel visits exactly the keys
  that can matter and reads them in memory order.

The plan is one uint32 array: a (num_layout * max_blocks) table of (offset, count) pairs
with offsets absolute in the same array, followed by the column lists. Layouts rarely
change between calls, so plans are cached by content and the same object comes back for
the same layout, which lets the executor skip re-uploading it.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

DENSE_ROW = 0xFFFFFFFF


@dataclass(frozen=True, eq=False)
class BlockPlan:
    words: np.ndarray  # uint32: row table then columns
    num_layout: int
    max_blocks: int

    @property
    def nbytes(self) -> int:
        return int(self.words.nbytes)


def build_block_plan(block_row_indices: np.ndarray, block_col_indices: np.ndarray) -> BlockPlan:
    rows = np.asarray(block_row_indices, dtype=np.int64)
    cols = np.asarray(block_col_indices, dtype=np.int64)
    num_layout, max_blocks = rows.shape[0], rows.shape[1] - 1
    table_words = num_layout * max_blocks * 2
    offsets = np.zeros((num_layout, max_blocks), dtype=np.int64)
    counts = np.zeros((num_layout, max_blocks), dtype=np.int64)
    column_lists = []
    next_offset = table_words
    dense_count = max_blocks * (max_blocks + 1) // 2
    row_ids = np.arange(max_blocks)
    for layout in range(num_layout):
        starts, ends = rows[layout, :-1], rows[layout, 1:]
        lengths = ends - starts
        if rows[layout, -1] >= dense_count:
            counts[layout] = DENSE_ROW
            continue
        dense_rows = lengths == row_ids + 1
        nnz = int(rows[layout, -1])
        entry_rows = np.repeat(row_ids, lengths)  # block row of every listed entry
        entry_cols = cols[layout, :nnz]
        keep = (entry_cols <= entry_rows) & ~dense_rows[entry_rows]
        # unique (row, col) pairs, sorted by row then column
        pairs = np.unique(entry_rows[keep] * max_blocks + entry_cols[keep])
        pair_rows, pair_cols = pairs // max_blocks, pairs % max_blocks
        per_row = np.bincount(pair_rows, minlength=max_blocks)
        offsets[layout] = next_offset + np.concatenate(([0], np.cumsum(per_row)[:-1]))
        counts[layout] = np.where(dense_rows, DENSE_ROW, per_row)
        column_lists.append(pair_cols)
        next_offset += pair_cols.size
    table = np.stack([offsets, counts], axis=-1).reshape(-1)
    words = np.concatenate([table] + column_lists).astype(np.uint32)
    return BlockPlan(words=words, num_layout=num_layout, max_blocks=max_blocks)


class BlockPlanCache:
    """Plans by layout content (a digest of both CSR arrays), least recently used dropped."""

    def __init__(self, capacity: int = 32):
        self._plans: OrderedDict[bytes, BlockPlan] = OrderedDict()
        self._capacity = capacity
        self._lock = threading.Lock()
        # The layout of the last call with its plan: a model passes the same layout on every
        # call, and comparing with it is several times cheaper than hashing it again.
        self._last: tuple[np.ndarray, np.ndarray, BlockPlan] | None = None

    def get(self, block_row_indices: np.ndarray, block_col_indices: np.ndarray) -> BlockPlan:
        last = self._last
        if (
            last is not None
            and last[0].shape == block_row_indices.shape
            and last[1].shape == block_col_indices.shape
            and np.array_equal(last[0], block_row_indices)
            and np.array_equal(last[1], block_col_indices)
        ):
            return last[2]
        plan = self._lookup(block_row_indices, block_col_indices)
        self._last = (np.array(block_row_indices), np.array(block_col_indices), plan)  # private copies
        return plan

    def _lookup(self, block_row_indices: np.ndarray, block_col_indices: np.ndarray) -> BlockPlan:
        digest = hashlib.blake2b(digest_size=16)
        for array in (block_row_indices, block_col_indices):
            digest.update(str(array.shape).encode())
            digest.update(np.ascontiguousarray(array).data)
        key = digest.digest()
        with self._lock:
            plan = self._plans.get(key)
            if plan is not None:
                self._plans.move_to_end(key)
                return plan
        plan = build_block_plan(block_row_indices, block_col_indices)
        with self._lock:
            self._plans[key] = plan
            while len(self._plans) > self._capacity:
                self._plans.popitem(last=False)
        return plan
