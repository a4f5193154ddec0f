"""One test per validation rule: the error names the input and the rule, and the same
session answers a good call correctly afterwards (docs/design.md section 1, plus what ORT misses)."""

import dataclasses

import numpy as np
import pytest
from helpers import assert_matches_reference, graph_feeds

import sparse_attention_op as sao
from sparse_attention_op.op import spec
from sparse_attention_op.op.spec import OpAttributes, SparseAttentionInputError, build_call
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs
from sparse_attention_op.webgpu import WebGPUExecutor

# Decode-with-history batch of two, rotary on: every input is present and a graph input.
GOOD = CaseConfig(
    batch=2,
    seq_len=2,
    past_lengths=(5, 9),
    num_heads=4,
    kv_num_heads=2,
    head_size=32,
    max_cache_len=32,
    sparse_block_size=8,
    num_layout=2,
    do_rotary=True,
)
PACKED = dataclasses.replace(GOOD, packed=True)


def _with(**changes):
    return lambda f: {**f, **{k: (v(f) if callable(v) else v) for k, v in changes.items()}}


def _rows(f, layout, index, value):
    rows = f["block_row_indices"].copy()
    rows[layout, index] = value
    return rows


def _cols(f, layout, index, value):
    cols = f["block_col_indices"].copy()
    cols[layout, index] = value
    return cols


def _head_24(f):
    """Consistent inputs with head_size 24: legal without rotary, not with it."""
    b, s, h = 2, 2, 24
    return {
        **f,
        "query": np.ones((b, s, 4 * h), np.float32),
        "key": np.ones((b, s, 2 * h), np.float32),
        "value": np.ones((b, s, 2 * h), np.float32),
        "past_key": np.ones((b, 2, 32, h), np.float32),
        "past_value": np.ones((b, 2, 32, h), np.float32),
    }


CALL_RULES = {
    "query-rank": (_with(query=lambda f: f["query"][0]), "query", "rank 3"),
    "query-hidden": (_with(query=lambda f: f["query"][..., :-2]), "query", "multiple of num_heads"),
    "head-size-multiple-of-8": (_with(query=lambda f: f["query"][..., :-16]), "query", "multiple of 8"),
    "head-size-max": (_with(query=lambda f: np.ones((2, 2, 4 * 264), np.float32)), "query", "above 256"),
    "key-shape": (_with(key=lambda f: f["key"][..., :-32]), "key", "must have shape"),
    "value-shape": (_with(value=lambda f: f["value"][:, :1]), "value", "must have shape"),
    "past-rank": (_with(past_key=lambda f: f["past_key"][0]), "past_key", "rank 4"),
    "past-heads": (_with(past_key=lambda f: f["past_key"][:, :1]), "past_key", "must have shape"),
    "past-value-shape": (_with(past_value=lambda f: f["past_value"][:, :, :16]), "past_value", "past_key's shape"),
    "rows-shape": (_with(block_row_indices=lambda f: f["block_row_indices"][:, :1]), "block_row_indices", "max_blocks >= 1"),
    "layouts-divide-heads": (
        _with(
            block_row_indices=lambda f: np.repeat(f["block_row_indices"][:1], 3, 0),
            block_col_indices=lambda f: np.repeat(f["block_col_indices"][:1], 3, 0),
        ),
        "block_row_indices",
        "divide num_heads",
    ),
    "cols-layouts": (_with(block_col_indices=lambda f: f["block_col_indices"][:1]), "block_col_indices", "num_layout"),
    "max-nnz": (
        _with(block_col_indices=lambda f: np.pad(f["block_col_indices"], ((0, 0), (0, 17)), constant_values=-1)),
        "block_col_indices",
        "max_blocks^2",
    ),
    "offsets-start": (_with(block_row_indices=lambda f: _rows(f, 0, 0, 1)), "block_row_indices", "start at offset 0"),
    "offsets-decrease": (_with(block_row_indices=lambda f: _rows(f, 1, 2, 0)), "block_row_indices", "never decrease"),
    "offsets-beyond": (_with(block_row_indices=lambda f: _rows(f, 0, -1, f["block_col_indices"].shape[1] + 1)), "block_row_indices", "beyond"),
    "column-negative": (_with(block_col_indices=lambda f: _cols(f, 0, 0, -1)), "block_col_indices", "[0, max_blocks"),
    "column-too-large": (_with(block_col_indices=lambda f: _cols(f, 1, 1, 4)), "block_col_indices", "[0, max_blocks"),
    "total-scalar": (_with(total_sequence_length=np.array([11, 11], np.int32)), "total_sequence_length", "scalar"),
    "total-below-seq": (_with(total_sequence_length=np.array([1], np.int32)), "total_sequence_length", ">= the query's sequence length"),
    "total-above-cache": (_with(total_sequence_length=np.array([40], np.int32)), "total_sequence_length", "max_cache_len"),
    "layout-covers-total": (
        _with(block_row_indices=np.array([[0, 1], [0, 1]], np.int32), block_col_indices=np.array([[0], [0]], np.int32)),
        "block_row_indices",
        "cover total_sequence_length",
    ),
    "key-totals-shape": (_with(key_total_sequence_lengths=lambda f: f["key_total_sequence_lengths"][:1]), "key_total_sequence_lengths", "shape"),
    "key-totals-below-seq": (_with(key_total_sequence_lengths=np.array([1, 11], np.int32)), "key_total_sequence_lengths", "[2, 11]"),
    "key-totals-above-total": (_with(key_total_sequence_lengths=np.array([12, 11], np.int32)), "key_total_sequence_lengths", "[2, 11]"),
    "prompt-key-totals-zero": (
        _with(total_sequence_length=np.array([2], np.int32), key_total_sequence_lengths=np.array([0, 2], np.int32)),
        "key_total_sequence_lengths",
        "[1, 2] for a prompt",
    ),
    "rotary-head-16": (_head_24, "query", "multiple of 16 when do_rotary"),
    "cos-rank": (_with(cos_cache=lambda f: f["cos_cache"][0]), "cos_cache", "rank 2"),
    "sin-shape": (_with(sin_cache=lambda f: f["sin_cache"][:, :8]), "sin_cache", "cos_cache's shape"),
    "cos-dim-multiple-of-8": (
        _with(cos_cache=lambda f: f["cos_cache"][:, :12], sin_cache=lambda f: f["sin_cache"][:, :12]),
        "cos_cache",
        "multiple of 8",
    ),
    "cos-dim-above-half-head": (
        _with(cos_cache=lambda f: np.ones((32, 24), np.float32), sin_cache=lambda f: np.ones((32, 24), np.float32)),
        "cos_cache",
        "head_size / 2",
    ),
    "cos-positions": (
        _with(cos_cache=lambda f: f["cos_cache"][:10], sin_cache=lambda f: f["sin_cache"][:10]),
        "cos_cache",
        "at least total_sequence_length",
    ),
}


@pytest.fixture(scope="module")
def good_case():
    inputs = random_inputs(GOOD, np.random.default_rng(7))
    session = sao.create_session(sparse_attention_model(GOOD.node_attributes(), inputs, declare_ranks=False))
    return session, inputs


@pytest.mark.gpu
@pytest.mark.parametrize("rule", sorted(CALL_RULES))
def test_call_rule(executor, good_case, rule):
    session, inputs = good_case
    mutate, name, message = CALL_RULES[rule]
    bad = mutate(graph_feeds(session, inputs))
    with pytest.raises(SparseAttentionInputError) as raised:
        session.run(None, bad)
    assert raised.value.input_name == name
    assert message in str(raised.value) and f"'{name}'" in str(raised.value)
    assert_matches_reference(session.run(None, graph_feeds(session, inputs)), inputs, GOOD.node_attributes(), f"after {rule}")


@pytest.mark.gpu
def test_packed_hidden_rule(executor):
    inputs = random_inputs(PACKED, np.random.default_rng(8))
    session = sao.create_session(sparse_attention_model(PACKED.node_attributes(), inputs, declare_ranks=False))
    feeds = graph_feeds(session, inputs)
    with pytest.raises(SparseAttentionInputError, match="num_heads \\+ 2 \\* kv_num_heads"):
        session.run(None, dict(feeds, query=feeds["query"][..., :-4]))
    assert_matches_reference(session.run(None, feeds), inputs, PACKED.node_attributes())


@pytest.mark.parametrize(
    "name,dtype", [("query", np.float64), ("past_value", np.float16), ("block_row_indices", np.int64), ("key_total_sequence_lengths", np.uint32)]
)
def test_dtype_rules(name, dtype):
    inputs = random_inputs(GOOD, np.random.default_rng(9))
    inputs[name] = inputs[name].astype(dtype)
    with pytest.raises(SparseAttentionInputError, match=f"'{name}': must be"):
        build_call(inputs, OpAttributes.from_mapping(GOOD.node_attributes()))


def test_required_inputs():
    inputs = random_inputs(GOOD, np.random.default_rng(10))
    del inputs["past_value"]
    with pytest.raises(SparseAttentionInputError, match="'past_value': is required"):
        build_call(inputs, OpAttributes.from_mapping(GOOD.node_attributes()))


def test_sizes_beyond_32_bit_indexing(monkeypatch):
    monkeypatch.setattr(spec, "MAX_INDEX", 1000)
    inputs = random_inputs(GOOD, np.random.default_rng(11))
    with pytest.raises(SparseAttentionInputError, match="32-bit"):
        build_call(inputs, OpAttributes.from_mapping(GOOD.node_attributes()))


@pytest.mark.gpu
def test_buffers_beyond_the_adapter_limit_are_refused_before_gpu_work(executor):
    limits = dict(executor.context.limits, **{"max-storage-buffer-binding-size": 4096})
    small = WebGPUExecutor(dataclasses.replace(executor.context, limits=limits))
    inputs = random_inputs(GOOD, np.random.default_rng(12))
    call = build_call(inputs, OpAttributes.from_mapping(GOOD.node_attributes()))
    with pytest.raises(spec.SparseAttentionError, match="'past_key'.*binds"):
        small.run(call)
    assert small.node_keys() == [], "nothing was allocated for the refused call"


@pytest.mark.parametrize(
    "attrs,name",
    [
        (dict(num_heads=0, kv_num_heads=1, sparse_block_size=8), "num_heads"),
        (dict(num_heads=4, kv_num_heads=-1, sparse_block_size=8), "kv_num_heads"),
        (dict(num_heads=6, kv_num_heads=4, sparse_block_size=8), "num_heads"),
        (dict(num_heads=4, kv_num_heads=2, sparse_block_size=0), "sparse_block_size"),
        (dict(num_heads=4, kv_num_heads=2, sparse_block_size=24), "sparse_block_size"),
        (dict(num_heads=4, kv_num_heads=2, sparse_block_size=8, scale=-1.0), "scale"),
        (dict(num_heads=4, kv_num_heads=2, sparse_block_size=8, scale=float("nan")), "scale"),
        (dict(num_heads=4, kv_num_heads=2, sparse_block_size=8, do_rotary=2), "do_rotary"),
        (dict(num_heads=4, kv_num_heads=2, sparse_block_size=8, rotary_interleaved=-1), "rotary_interleaved"),
        (dict(kv_num_heads=2, sparse_block_size=8), "num_heads"),
    ],
)
def test_attribute_rules(attrs, name):
    with pytest.raises(SparseAttentionInputError) as raised:
        OpAttributes.from_mapping(attrs)
    assert raised.value.input_name == name


@pytest.mark.parametrize("elem,slot_name", [(np.float64, "past_key")])
def test_unsupported_float_types_are_refused_by_prepare_model(elem, slot_name):
    from onnx import TensorProto, helper

    inputs = random_inputs(GOOD, np.random.default_rng(13))
    model = sparse_attention_model(GOOD.node_attributes(), inputs)
    for graph_input in model.graph.input:
        if graph_input.name == slot_name:
            graph_input.CopyFrom(helper.make_tensor_value_info(slot_name, TensorProto.DOUBLE, [None] * 4))
    with pytest.raises(sao.SparseAttentionError, match=f"'{slot_name}' is DOUBLE"):
        sao.prepare_model(model)


def test_a_fast_check_without_history_is_refused():
    """The fast check compares probe rows of the caller's past: a call that asks for it must
    carry that past (the executor could otherwise compare nothing and trust its cache)."""
    call = build_call(random_inputs(GOOD, np.random.default_rng(3)), OpAttributes.from_mapping(GOOD.node_attributes()), with_history=False)
    with pytest.raises(SparseAttentionInputError, match="the fast check needs the history rows"):
        spec.assemble_call(
            call.shape,
            call.query,
            call.key,
            call.value,
            call.history_key,
            call.history_value,
            call.cos_rows,
            call.sin_rows,
            call.block_row_indices,
            call.block_col_indices,
            fast_check=True,
        )
