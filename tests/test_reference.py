"""The oracle itself: hand-checkable CSR rules, and agreement with ORT's CPU kernel where it is right."""

import numpy as np
import pytest
from helpers import assert_close, run_ort_cpu

from sparse_attention_op.op.reference import apply_rotary, block_mask, sparse_attention_reference
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs


def test_dense_count_layout_is_causal_whatever_its_columns():
    max_blocks = 3
    rows = np.array([[0, 2, 4, 6]], np.int32)  # nnz 6 = 3 * 4 / 2: the dense count
    cols = np.array([[2, 2, 2, 2, 2, 2]], np.int32)
    assert np.array_equal(block_mask(rows, cols)[0], np.tril(np.ones((max_blocks, max_blocks), bool)))


def test_row_with_row_plus_one_entries_is_causal_and_duplicates_count_once():
    rows = np.array([[0, 1, 3, 4]], np.int32)
    cols = np.array([[0, 1, 1, 0, -1, -1]], np.int32)  # row 1 lists 2 = row + 1 entries; row 2 lists [0]
    mask = block_mask(rows, cols)[0]
    assert mask[1].tolist() == [True, True, False]
    assert mask[2].tolist() == [True, False, False]


def test_query_that_sees_nothing_averages_v_over_its_causal_history():
    # Block row 1 selects only block 2 (in its future): queries 2 and 3 see no key.
    rows = np.array([[0, 1, 2, 3]], np.int32)
    cols = np.array([[0, 2, 2]], np.int32)
    rng = np.random.default_rng(0)
    s, h = 4, 8
    q = rng.standard_normal((1, s, h), dtype=np.float32)
    k = rng.standard_normal((1, s, h), dtype=np.float32)
    v = rng.standard_normal((1, s, h), dtype=np.float32)
    cache = np.zeros((1, 1, 6, h), np.float32)
    out, _, _ = sparse_attention_reference(
        q,
        k,
        v,
        cache,
        cache,
        rows,
        cols,
        np.array([s], np.int32),
        np.array([s], np.int32),
        num_heads=1,
        kv_num_heads=1,
        sparse_block_size=2,
    )
    assert_close(out[0, 2], v[0, :3].mean(axis=0), "query 2")
    assert_close(out[0, 3], v[0, :4].mean(axis=0), "query 3")


def test_rotary_layouts_and_partial_dims():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((1, 2, 8))
    cos, sin = rng.standard_normal((4, 2)), rng.standard_normal((4, 2))
    pos = np.array([1, 3])
    half = apply_rotary(x, pos, cos, sin, interleaved=False)
    inter = apply_rotary(x, pos, cos, sin, interleaved=True)
    c, s = cos[pos][None], sin[pos][None]
    assert np.allclose(half[..., :2], x[..., :2] * c - x[..., 2:4] * s)
    assert np.allclose(half[..., 2:4], x[..., 2:4] * c + x[..., :2] * s)
    assert np.allclose(inter[..., 0:4:2], x[..., 0:4:2] * c - x[..., 1:4:2] * s)
    assert np.allclose(inter[..., 1:4:2], x[..., 1:4:2] * c + x[..., 0:4:2] * s)
    assert np.array_equal(half[..., 4:], x[..., 4:]) and np.array_equal(inter[..., 4:], x[..., 4:])


@pytest.mark.parametrize(
    "config",
    [
        CaseConfig(seq_len=16, num_heads=4, kv_num_heads=2, head_size=16, sparse_block_size=4, num_layout=2, local_blocks=1),
        CaseConfig(seq_len=1, past_lengths=(37,), num_heads=8, kv_num_heads=2, head_size=32, num_layout=4),
        CaseConfig(batch=2, seq_len=3, past_lengths=(20, 20), head_size=32, do_rotary=True),
        CaseConfig(seq_len=9, head_size=32, do_rotary=True, rotary_interleaved=True, packed=True, rotary_dim=16),
    ],
    ids=["prompt", "decode", "chunked-rotary", "packed-interleaved-partial"],
)
def test_reference_agrees_with_ort_cpu_kernel(config, rng):
    inputs = random_inputs(config, rng)
    model = sparse_attention_model(config.node_attributes(), inputs)
    expected = run_ort_cpu(model, inputs)
    ref = sparse_attention_reference(**inputs, **config.node_attributes())
    assert_close(ref[0], expected[0], "output")
    live = int(inputs["key_total_sequence_lengths"].max())
    assert_close(ref[1][:, :, :live], expected[1][:, :, :live], "present_key")
    assert_close(ref[2][:, :, :live], expected[2][:, :, :live], "present_value")
