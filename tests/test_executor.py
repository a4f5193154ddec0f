"""The WebGPU executor against the float64 reference (GPU: lavapipe in CI)."""

import dataclasses

import numpy as np
import pytest
from helpers import assert_matches_reference, run_executor

from sparse_attention_op.op.reference import sparse_attention_reference
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs

pytestmark = pytest.mark.gpu


def check(executor, config, rng, past=None, node_key="test"):
    inputs = random_inputs(config, rng, past=past)
    outputs = run_executor(executor, inputs, config.node_attributes(), node_key)
    assert_matches_reference(outputs, inputs, config.node_attributes(), what=str(config))
    return outputs


@pytest.mark.parametrize("head_size", range(8, 257, 8))
def test_head_sizes_prompt_and_decode(executor, rng, head_size):
    base = CaseConfig(head_size=head_size, seq_len=6, max_cache_len=40, num_heads=4, kv_num_heads=2)
    check(executor, base, rng)
    check(executor, dataclasses.replace(base, seq_len=1, past_lengths=(29,)), rng)


@pytest.mark.parametrize("block", [8, 16, 32, 64, 128])
def test_block_sizes(executor, rng, block):
    config = CaseConfig(sparse_block_size=block, max_cache_len=4 * block, seq_len=2 * block + 3, head_size=16, local_blocks=1, vert_stride=2)
    check(executor, config, rng)
    check(executor, dataclasses.replace(config, seq_len=1, past_lengths=(3 * block + 1,)), rng)


@pytest.mark.parametrize("num_heads,kv_num_heads,num_layout", [(4, 4, 1), (4, 2, 2), (8, 2, 4), (8, 1, 8), (6, 3, 3), (12, 4, 6)])
def test_gqa_and_layout_cycling(executor, rng, num_heads, kv_num_heads, num_layout):
    config = CaseConfig(num_heads=num_heads, kv_num_heads=kv_num_heads, num_layout=num_layout, seq_len=21, max_cache_len=48, vert_stride=3)
    check(executor, config, rng)


@pytest.mark.parametrize("scale", [0.0, 0.05, 0.7])
def test_custom_scale(executor, rng, scale):
    check(executor, CaseConfig(scale=scale, seq_len=9), rng)


def test_padded_prompt_rows_of_different_lengths(executor, rng):
    check(executor, CaseConfig(batch=3, seq_len=13, prompt_lengths=(13, 1, 7)), rng)


def test_ragged_decode(executor, rng):
    check(executor, CaseConfig(batch=4, seq_len=1, past_lengths=(0, 5, 40, 63), max_cache_len=64), rng)


def test_chunked_prefill_with_ragged_history(executor, rng):
    check(executor, CaseConfig(batch=2, seq_len=7, past_lengths=(9, 30), max_cache_len=48), rng)


def test_dense_layout_and_row_with_no_reachable_block(executor, rng):
    # Layout 0: plain causal by the dense count; layout 1: row 2 selects only future
    # block 3 (its queries see nothing and average V), row 1 lists row + 1 duplicate entries.
    config = CaseConfig(seq_len=30, max_cache_len=32, sparse_block_size=8, num_layout=2)
    inputs = random_inputs(config, rng)
    rows = np.array([[0, 1, 3, 6, 10], [0, 1, 3, 4, 6]], np.int32)
    cols = np.array([[0, 0, 1, 0, 1, 2, 0, 1, 2, 3], [0, 1, 1, 3, 3, 0, -1, -1, -1, -1]], np.int32)
    inputs.update(block_row_indices=rows, block_col_indices=cols)
    outputs = run_executor(executor, inputs, config.node_attributes())
    assert_matches_reference(outputs, inputs, config.node_attributes())


def decode_chain(executor, config, rng, steps, node_key="chain"):
    """Prompt, then decode steps each feeding the last present back as the next past."""
    outputs = check(executor, config, rng, node_key=node_key)
    lengths = np.asarray(config.prompt_lengths or (config.seq_len,) * config.batch)
    for _ in range(steps):
        step = dataclasses.replace(config, seq_len=1, past_lengths=tuple(int(v) for v in lengths), prompt_lengths=None)
        outputs = check(executor, step, rng, past=outputs[1:], node_key=node_key)
        lengths = lengths + 1
    return outputs


def test_decode_chain_crosses_blocks(executor, rng):
    config = CaseConfig(batch=2, seq_len=5, prompt_lengths=(5, 3), max_cache_len=40, sparse_block_size=8)
    decode_chain(executor, config, rng, steps=12)


def test_sequence_restarted_in_the_same_node(executor, rng):
    config = CaseConfig(seq_len=6, max_cache_len=32)
    decode_chain(executor, config, rng, steps=3, node_key="restart")
    decode_chain(executor, dataclasses.replace(config, seq_len=4), rng, steps=3, node_key="restart")


def test_beam_reorder_between_steps(executor, rng):
    config = CaseConfig(batch=3, seq_len=4, max_cache_len=24)
    outputs = check(executor, config, rng, node_key="beam")
    lengths = (4, 4, 4)
    for order in ([2, 0, 1], [1, 1, 0], [0, 2, 2]):
        past = tuple(np.ascontiguousarray(present[order]) for present in outputs[1:])
        step = dataclasses.replace(config, seq_len=1, past_lengths=lengths)
        outputs = check(executor, step, rng, past=past, node_key="beam")
        lengths = tuple(v + 1 for v in lengths)


def test_presents_keep_every_other_cache_row(executor, rng):
    config = CaseConfig(batch=2, seq_len=1, past_lengths=(3, 17), max_cache_len=32)
    inputs = random_inputs(config, rng)
    _, present_key, present_value = run_executor(executor, inputs, config.node_attributes())
    for b, past in enumerate(config.past_lengths):
        keep = np.ones(32, bool)
        keep[past] = False
        assert np.array_equal(present_key[b][:, keep], inputs["past_key"][b][:, keep])
        assert np.array_equal(present_value[b][:, keep], inputs["past_value"][b][:, keep])


def test_buffers_are_reused_across_calls(executor, rng):
    config = CaseConfig(seq_len=1, past_lengths=(10,), max_cache_len=32)
    check(executor, config, rng, node_key="reuse")
    compiled = len(executor.pipelines)
    check(executor, dataclasses.replace(config, past_lengths=(11,)), rng, node_key="reuse")
    assert len(executor.pipelines) == compiled, "a new shape of the same kind must not compile again"


def test_unit_scale_inputs_give_peaked_softmax(rng):
    # Guards the tests themselves: with tiny inputs every softmax would be near uniform.
    config = CaseConfig(seq_len=16, max_cache_len=16)
    inputs = random_inputs(config, rng)
    out, _, _ = sparse_attention_reference(**inputs, **config.node_attributes())
    uniform_inputs = dict(inputs, query=inputs["query"] * 1e-4)
    out_small, _, _ = sparse_attention_reference(**uniform_inputs, **config.node_attributes())
    assert np.abs(out - out_small).max() > 0.1


def test_float16_rounding_of_rotated_keys_matches_numpy(executor, rng):
    # Keys spanning float16's normal and subnormal ranges, and ties: the GPU rounding of
    # float16-storage nodes must be numpy's (ties to even), bit for bit.
    from sparse_attention_op.op.spec import OpAttributes, build_call

    config = CaseConfig(seq_len=1, past_lengths=(3,), head_size=32, do_rotary=True, max_cache_len=16)
    inputs = random_inputs(config, rng)
    scales = np.logspace(-9, 3, inputs["key"].size).astype(np.float32).reshape(inputs["key"].shape)
    inputs["key"] = (inputs["key"] * scales).astype(np.float32)
    inputs["cos_cache"][:] = 1.0  # rotation by angle 0: the key passes through unchanged ...
    inputs["sin_cache"][:] = 0.0  # ... so the stored value is the key's own float16 rounding
    call = build_call(inputs, OpAttributes.from_mapping(config.node_attributes()), float16_storage=True)
    new_rows = executor.run(call, node_key="f16-rounding").new_key[0, :, 0]
    expected = inputs["key"][0, 0].reshape(config.kv_num_heads, config.head_size).astype(np.float16).astype(np.float32)
    assert np.array_equal(new_rows, expected)
