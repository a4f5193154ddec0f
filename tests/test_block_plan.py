"""The host-side plan the attention pass walks must select exactly the reference's blocks."""

import numpy as np
import pytest

from sparse_attention_op.op.block_plan import DENSE_ROW, BlockPlanCache, build_block_plan
from sparse_attention_op.op.layouts import causal_mask, mask_to_csr, phi3_small_mask
from sparse_attention_op.op.reference import block_mask


def plan_mask(plan):
    """Expand a plan back into a (num_layout, max_blocks, max_blocks) causal block mask."""
    n, m = plan.num_layout, plan.max_blocks
    table = plan.words[: n * m * 2].reshape(n, m, 2)
    mask = np.zeros((n, m, m), bool)
    for layout in range(n):
        for row in range(m):
            offset, count = (int(v) for v in table[layout, row])
            if count == DENSE_ROW:
                mask[layout, row, : row + 1] = True
            else:
                columns = plan.words[offset : offset + count]
                assert np.all(np.diff(columns.astype(np.int64)) > 0), "columns must be ascending and distinct"
                mask[layout, row, columns] = True
    return mask


def reachable(mask):
    return mask & np.tril(np.ones(mask.shape[1:], bool))


@pytest.mark.parametrize("max_blocks,num_layout", [(1, 1), (8, 2), (32, 4), (64, 8)])
def test_plan_matches_reference_on_phi3_layouts(max_blocks, num_layout):
    rows, cols = mask_to_csr(phi3_small_mask(max_blocks, num_layout, local_blocks=3, vert_stride=4))
    assert np.array_equal(plan_mask(build_block_plan(rows, cols)), reachable(block_mask(rows, cols)))


def test_plan_of_dense_layout_marks_every_row_dense():
    rows, cols = mask_to_csr(causal_mask(16, 2))
    plan = build_block_plan(rows, cols)
    assert np.all(plan.words[1 : 16 * 2 * 2 : 2] == DENSE_ROW)


def test_plan_of_malformed_but_legal_rows(rng):
    # Duplicates, future blocks, rows without their diagonal, rows listing row + 1 entries.
    max_blocks = 12
    for _ in range(20):
        lengths = rng.integers(0, 6, size=(3, max_blocks))
        rows = np.zeros((3, max_blocks + 1), np.int32)
        rows[:, 1:] = np.cumsum(lengths, axis=1)
        cols = np.full((3, int(rows[:, -1].max()) + 2), -1, np.int32)
        for layout in range(3):
            nnz = int(rows[layout, -1])
            cols[layout, :nnz] = rng.integers(0, max_blocks, size=nnz)
        plan = build_block_plan(rows, cols)
        assert np.array_equal(plan_mask(plan), reachable(block_mask(rows, cols)))


def test_cache_returns_the_same_plan_for_the_same_layout():
    cache = BlockPlanCache()
    rows, cols = mask_to_csr(phi3_small_mask(8, 2, 2, 2))
    first = cache.get(rows, cols)
    assert cache.get(rows.copy(), cols.copy()) is first
    other_cols = cols.copy()
    other_cols[0, 0] = 0 if cols[0, 0] else 1
    assert cache.get(rows, other_cols) is not first
