"""The attention passes one by one (tiled prefill, split-K decode, rows, simple) against the
float64 reference, each forced through a tuning of its own, at the shapes their tiling makes
hard: tiles across block rows and the causal diagonal, tails, chunks that start mid-tile,
head sizes whose tiles need padding or do not fit, slices emptier than the work."""

import dataclasses

import numpy as np
import pytest
import wgpu
from helpers import assert_matches_reference, run_executor

from sparse_attention_op.op.reference import sparse_attention_reference
from sparse_attention_op.op.spec import OpAttributes, build_call
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs
from sparse_attention_op.webgpu import kernels, native
from sparse_attention_op.webgpu.executor import WebGPUExecutor
from sparse_attention_op.webgpu.programs import BufferRange
from sparse_attention_op.webgpu.tuning import ROWS, SIMPLE, SPLIT, TILED, Tuning, choose_tuning

pytestmark = pytest.mark.gpu

#: Small tiles, so that a test of tens of tokens crosses many tiles, block rows and key tiles.
SMALL_TILES = dict(
    prefill_query_tile=16,
    prefill_key_tile=16,
    prefill_query_regs=2,
    prefill_key_regs=2,
    prefill_depth_chunk=2,
    prefill_value_chunk=8,
    prefill_min_queries=2,
    decode_max_queries=1,
    prefill_pass=TILED,
)
ROUTES = {
    TILED: dict(SMALL_TILES),
    "tiled-default": dict(prefill_min_queries=2, decode_max_queries=1, prefill_pass=TILED),
    "tiled-no-prefetch": dict(SMALL_TILES, prefill_prefetch=False),
    "tiled-dot-scores": dict(SMALL_TILES, prefill_fma_scores=False),
    # Queries from a query_prep pass, re-read every key tile (by default they stay in registers).
    "tiled-prepared-query": dict(SMALL_TILES, prefill_resident_query=False),
    # ...and staged without prefetch: the runtime loop over depth chunks, loads in each step.
    "tiled-prepared-no-prefetch": dict(SMALL_TILES, prefill_resident_query=False, prefill_prefetch=False),
    SPLIT: dict(
        decode_max_queries=4096, decode_target_workgroups=4096, decode_min_keys_per_split=3, decode_fused_append=True, decode_split_merges=True
    ),
    "split-unfused": dict(
        decode_max_queries=4096, decode_target_workgroups=4096, decode_min_keys_per_split=3, decode_fused_append=False, decode_split_merges=True
    ),
    # The merge as a pass of its own (by default the split pass's last slices merge).
    "split-merge-pass": dict(
        decode_max_queries=4096, decode_target_workgroups=4096, decode_min_keys_per_split=3, decode_fused_append=True, decode_split_merges=False
    ),
    # One slice per query in small tiles (64 invocations: 32 keys a tile at head size 16), so
    # a slice walks several history tiles before the tile of this call's own rows, the only
    # one that reads the inputs; fused (CPU adapters' own tuning does not fuse).
    "split-tiles": dict(decode_max_queries=4096, decode_target_workgroups=1, decode_workgroup=64, decode_fused_append=True, decode_split_merges=True),
    # One key per lane group and tile (the GPUs' default; CPU adapters score 2).
    "split-one-key": dict(
        decode_max_queries=4096,
        decode_target_workgroups=4096,
        decode_min_keys_per_split=3,
        decode_fused_append=True,
        decode_split_merges=True,
        decode_keys_per_group=1,
    ),
    # Every lane group loading and rotating the query itself (by default it is rotated once
    # per workgroup into workgroup memory: Tuning.decode_shared_query).
    "split-per-lane-query": dict(
        decode_max_queries=4096,
        decode_target_workgroups=4096,
        decode_min_keys_per_split=3,
        decode_fused_append=True,
        decode_split_merges=True,
        decode_shared_query=False,
    ),
    # ...in slices of several tiles, with the merge pass and the append pass (CPU adapters' way).
    "split-tiles-per-lane-query": dict(
        decode_max_queries=4096,
        decode_target_workgroups=1,
        decode_workgroup=64,
        decode_fused_append=False,
        decode_split_merges=False,
        decode_shared_query=False,
    ),
    ROWS: dict(prefill_pass=ROWS, rows_lanes=8, rows_query_regs=2, prefill_min_queries=1, decode_max_queries=0),
    SIMPLE: dict(decode_max_queries=0, prefill_min_queries=1 << 30),
}
_executors: dict = {}


def executor_for(base, fields: dict) -> WebGPUExecutor:
    """An executor on the session's device with the adapter's tuning and these fields replaced
    (one per distinct tuning, so its pipelines compile once)."""
    tuning = dataclasses.replace(base.tuning, **fields)
    if tuning not in _executors:
        _executors[tuning] = WebGPUExecutor(base.context, tuning)
    return _executors[tuning]


def assert_same_arithmetic(executor, got, want, what=""):
    """Two builds of the same arithmetic agree: bit for bit on CPU adapters (lavapipe), within
    float32 ulps on GPUs, whose drivers may contract multiply-adds into FMAs differently in
    each build (SPIR-V allows it and Naga marks nothing NoContraction; the H200 did so)."""
    if executor.context.adapter_type == "CPU":
        np.testing.assert_array_equal(got, want, err_msg=what)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=what)


def check(executor, config, rng, expect_route, past=None, node_key="kernels", tol=2e-3, float16_storage=False, inputs=None):
    """One call through ``executor``, which must take ``expect_route``, against the reference."""
    if inputs is None:
        inputs = random_inputs(config, rng, past=past)
    if float16_storage:
        inputs = {k: (v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v) for k, v in inputs.items()}
    shape = build_call(inputs, OpAttributes.from_mapping(config.node_attributes())).shape
    assert executor.tuning.attention_route(shape) == expect_route
    outputs = run_executor(executor, inputs, config.node_attributes(), node_key, float16_storage=float16_storage)
    assert_matches_reference(outputs, inputs, config.node_attributes(), what=f"{expect_route} {config}", tol=tol)
    return outputs


def forced(executor, route):
    expect = next((r for r in (TILED, SPLIT) if route.startswith(r)), route)
    return executor_for(executor, ROUTES[route]), expect


def decode_route(route) -> str:
    """The pass a one-query call takes under ROUTES[route]."""
    return SPLIT if route.startswith((TILED, SPLIT)) else route


@pytest.mark.parametrize(
    "route", [TILED, "tiled-default", "tiled-no-prefetch", "tiled-dot-scores", "tiled-prepared-query", "tiled-prepared-no-prefetch", ROWS, SIMPLE]
)
@pytest.mark.parametrize("seq_len", [16, 37, 70])
def test_prompt_tiles_cross_block_rows_and_the_diagonal(executor, rng, route, seq_len):
    # Blocks of 32 with tiles of 16: two query tiles per block row, key tiles inside and
    # across blocks, the diagonal block cut at every tile; 37 and 70 leave tails.
    runner, expect = forced(executor, route)
    config = CaseConfig(seq_len=seq_len, max_cache_len=96, sparse_block_size=32, head_size=32, local_blocks=1, vert_stride=2)
    check(runner, config, rng, expect)


@pytest.mark.parametrize("route", [TILED, "tiled-no-prefetch", "tiled-prepared-query", ROWS, SPLIT])
@pytest.mark.parametrize("past", [(9,), (16,), (30, 3)])
def test_chunked_prefill_with_history_starts_mid_tile(executor, rng, route, past):
    runner, expect = forced(executor, route)
    config = CaseConfig(batch=len(past), seq_len=21, past_lengths=past, max_cache_len=64, sparse_block_size=16, vert_stride=3)
    check(runner, config, rng, expect)


@pytest.mark.parametrize("route", [TILED, ROWS, SPLIT, "split-one-key", "split-per-lane-query"])
@pytest.mark.parametrize("head_size", [8, 24, 40, 64, 136, 256])
def test_head_sizes(executor, rng, route, head_size):
    # 8 and 24: fewer head vec4s than a depth chunk or an output column block (padding);
    # 256: the largest head, whose tiles shrink their staging to fit workgroup memory.
    runner, expect = forced(executor, route)
    config = CaseConfig(head_size=head_size, seq_len=19, max_cache_len=48, num_heads=4, kv_num_heads=2, sparse_block_size=16)
    check(runner, config, rng, expect)


def test_largest_head_falls_back_where_no_tile_fits(executor, rng):
    # 4 KiB of workgroup memory holds no tile of a 256-wide head: the simple pass serves it
    # (its own tile shrinks to one query).
    runner = executor_for(executor, dict(workgroup_storage_bytes=4096, prefill_min_queries=2, decode_max_queries=0, prefill_pass=TILED))
    config = CaseConfig(head_size=256, seq_len=20, max_cache_len=32, sparse_block_size=16)
    assert runner.tuning.prefill_tiling(build_call(random_inputs(config, rng), OpAttributes.from_mapping(config.node_attributes())).shape) is None
    check(runner, config, rng, SIMPLE)


def test_decode_falls_back_where_the_split_pass_does_not_fit(executor, rng):
    # 6000 bytes of workgroup memory hold no split-K workgroup (about 7 KiB at head size 16):
    # the simple pass serves the decode step, with the same results.
    runner = executor_for(executor, dict(workgroup_storage_bytes=6000))
    config = CaseConfig(seq_len=1, past_lengths=(40,), max_cache_len=48, sparse_block_size=16)
    shape = build_call(random_inputs(config, rng), OpAttributes.from_mapping(config.node_attributes())).shape
    assert runner.tuning.decode_split(shape) is None
    assert executor.tuning.decode_split(shape).workgroup_bytes() > 6000
    check(runner, config, rng, SIMPLE)


@pytest.mark.parametrize("storage", [16384, 32768, 49152])
def test_default_tiles_shrink_to_the_workgroup_memory(executor, rng, storage):
    runner = executor_for(executor, dict(workgroup_storage_bytes=storage, prefill_min_queries=2, decode_max_queries=0, prefill_pass=TILED))
    config = CaseConfig(head_size=128, seq_len=70, max_cache_len=128, sparse_block_size=64, num_heads=2, kv_num_heads=1)
    tiling = runner.tuning.prefill_tiling(build_call(random_inputs(config, rng), OpAttributes.from_mapping(config.node_attributes())).shape)
    assert tiling is not None and tiling.workgroup_bytes() <= storage
    check(runner, config, rng, TILED)


@pytest.mark.parametrize("route", ["tiled-default", ROWS, SPLIT, "split-one-key", "split-tiles"])
@pytest.mark.parametrize("block", [8, 16, 32, 64, 128])
def test_block_sizes(executor, rng, route, block):
    runner, expect = forced(executor, route)
    config = CaseConfig(sparse_block_size=block, max_cache_len=4 * block, seq_len=2 * block + 3, head_size=16, local_blocks=1, vert_stride=2)
    check(runner, config, rng, expect)
    step = dataclasses.replace(config, seq_len=1, past_lengths=(3 * block + 1,))
    check(runner, step, rng, decode_route(route))


@pytest.mark.parametrize("route", [TILED, ROWS, SPLIT])
@pytest.mark.parametrize("num_heads,kv_num_heads,num_layout", [(4, 4, 1), (8, 2, 4), (8, 1, 8), (12, 4, 6)])
def test_gqa_and_layouts(executor, rng, route, num_heads, kv_num_heads, num_layout):
    runner, expect = forced(executor, route)
    config = CaseConfig(num_heads=num_heads, kv_num_heads=kv_num_heads, num_layout=num_layout, seq_len=21, max_cache_len=48, vert_stride=3)
    check(runner, config, rng, expect)


def no_reachable_block_inputs(config, rng):
    """Layout 1's row 2 selects only the future block 3: its queries see no key and must
    average V over their history; layout 0 is plain causal."""
    inputs = random_inputs(config, rng)
    rows = np.array([[0, 1, 3, 6, 10], [0, 1, 3, 4, 6]], np.int32)
    cols = np.array([[0, 0, 1, 0, 1, 2, 0, 1, 2, 3], [0, 1, 1, 3, 3, 0, -1, -1, -1, -1]], np.int32)
    inputs.update(block_row_indices=rows, block_col_indices=cols)
    return inputs


@pytest.mark.parametrize("route", [TILED, ROWS, SPLIT])
def test_rows_with_no_visible_key_average_their_history(executor, rng, route):
    runner, expect = forced(executor, route)
    config = CaseConfig(seq_len=30, max_cache_len=32, sparse_block_size=8, num_layout=2)
    check(runner, config, rng, expect, inputs=no_reachable_block_inputs(config, rng))


@pytest.mark.parametrize("route", [TILED, ROWS, SPLIT, SIMPLE, "split-unfused", "split-merge-pass"])
def test_a_nan_input_makes_the_rows_that_read_it_nan(executor, rng, route):
    """As ORT's kernel and the reference: not the "no visible key" average, which is finite."""
    runner, expect = forced(executor, route)
    decode = route.startswith(SPLIT)
    config = CaseConfig(
        seq_len=1 if decode else 12, past_lengths=(20,) if decode else None, max_cache_len=32, sparse_block_size=8, num_layout=2, do_rotary=True
    )
    inputs = random_inputs(config, rng)
    inputs["query"][0, 0, 3] = np.nan  # token 0, head 0
    if decode:
        inputs["past_key"][0, 1, 5, 2] = np.nan  # a history row of kv head 1
    else:
        inputs["key"][0, 4, config.head_size + 2] = np.inf  # token 4, kv head 1: NaN scores after the max
    shape = build_call(inputs, OpAttributes.from_mapping(config.node_attributes())).shape
    assert runner.tuning.attention_route(shape) == expect
    output = run_executor(runner, inputs, config.node_attributes(), "nan")[0]
    reference = sparse_attention_reference(**inputs, **config.node_attributes())[0]
    assert np.isnan(reference).any() and not np.isnan(reference).all()
    assert np.array_equal(np.isnan(output), np.isnan(reference)), "the NaN rows differ from the reference's"
    finite = ~np.isnan(reference)
    assert np.allclose(output[finite], reference[finite], atol=2e-3)


@pytest.mark.parametrize(
    "route", [SPLIT, "split-unfused", "split-one-key", "split-tiles", "split-merge-pass", "split-per-lane-query", "split-tiles-per-lane-query"]
)
def test_decode_with_no_visible_key(executor, rng, route):
    runner, _ = forced(executor, route)
    config = CaseConfig(seq_len=1, past_lengths=(19,), max_cache_len=32, sparse_block_size=8, num_layout=2)
    inputs = no_reachable_block_inputs(config, rng)  # query at 19: row 2, which sees nothing in layout 1
    check(runner, config, rng, SPLIT, inputs=inputs)


@pytest.mark.parametrize("route", [TILED, ROWS, SPLIT, "split-unfused", "split-one-key", "split-tiles", "split-merge-pass", "split-per-lane-query"])
def test_f16_cache(executor, rng, route):
    if "shader-f16" not in executor.context.features:
        pytest.fail("the f16 cache needs an adapter with shader-f16 (lavapipe has it)")
    runner, expect = forced(executor, route)
    config = CaseConfig(seq_len=23, max_cache_len=48, sparse_block_size=16, do_rotary=True, head_size=32)
    check(runner, config, rng, expect, float16_storage=True, tol=1e-2)
    assert runner.node_state("kernels").cache.dtype == np.float16
    step = dataclasses.replace(config, seq_len=1, past_lengths=(40,))
    check(runner, step, rng, decode_route(route), float16_storage=True, tol=1e-2, node_key="kernels-f16")


@pytest.mark.parametrize("route", [TILED, "tiled-prepared-query", ROWS, SPLIT, "split-unfused", "split-per-lane-query"])
@pytest.mark.parametrize("rotary", [dict(do_rotary=True), dict(do_rotary=True, rotary_interleaved=True), dict(do_rotary=True, rotary_dim=16)])
def test_rotary_queries(executor, rng, route, rotary):
    runner, expect = forced(executor, route)
    config = CaseConfig(seq_len=18, past_lengths=(5,), max_cache_len=32, head_size=32, packed=True, **rotary)
    check(runner, config, rng, expect)


_TILED_ONLY = dict(prefill_min_queries=2, decode_max_queries=1, prefill_pass=TILED)


@pytest.mark.parametrize(
    "tiles,head_size,case",
    [
        ("default", 128, dict(do_rotary=True)),
        ("default", 32, dict(do_rotary=True, rotary_interleaved=True)),
        ("default", 144, dict(do_rotary=True, rotary_dim=64)),
        ("default", 136, dict()),  # 34 head vec4s: the last depth chunk is short
        ("default", 64, dict(do_rotary=True, batch=2, past_lengths=None, prompt_lengths=(75, 50))),
        ("small", 32, dict(do_rotary=True)),  # small tiles: the Q and K staging loops end in partial rounds
    ],
    ids=["rotary", "interleaved", "partial-rotary", "short-chunk", "ragged-batch", "small-tiles"],
)
def test_resident_queries_equal_prepared_queries(executor, rng, tiles, head_size, case):
    # The tiled pass rotating and scaling its queries itself computes what query_prep
    # writes, in the same order, so the outputs are bit-identical: a wrong partner, table
    # row, chunk column, guard or scale in the resident load differs. The history starts
    # the single-row calls mid-tile. (Several batch rows only come as prompts, whose rows
    # share positions, so no call can tell a table row of the wrong batch row.)
    fields = dict(SMALL_TILES) if tiles == "small" else dict(_TILED_ONLY)
    resident, prepared = executor_for(executor, fields), executor_for(executor, dict(fields, prefill_resident_query=False))
    config = CaseConfig(
        **dict(
            dict(
                seq_len=75,
                past_lengths=(21,),
                max_cache_len=160,
                sparse_block_size=64,
                head_size=head_size,
                num_heads=4,
                kv_num_heads=2,
                local_blocks=1,
                vert_stride=2,
                packed=True,
            ),
            **case,
        )
    )
    inputs = random_inputs(config, rng)
    shape = build_call(inputs, OpAttributes.from_mapping(config.node_attributes())).shape
    tiling = resident.tuning.prefill_tiling(shape)
    assert tiling.resident_query and not prepared.tuning.prefill_tiling(shape).resident_query
    if head_size == 136:
        assert tiling.head_vec % tiling.depth_chunk, tiling
    if tiles == "small":
        assert (tiling.query_tile * tiling.depth_chunk) % tiling.workgroup and (tiling.key_tile * tiling.depth_chunk) % tiling.workgroup
    expected = run_executor(prepared, inputs, config.node_attributes(), "prepared")
    output = run_executor(resident, inputs, config.node_attributes(), "resident")[0]
    assert_matches_reference(expected, inputs, config.node_attributes(), what="prepared queries")
    np.testing.assert_array_equal(output, expected[0])
    labels = {
        name: [launch.label for launch in runner.node_state(name).step_plan.launches]
        for name, runner in (("resident", resident), ("prepared", prepared))
    }
    assert labels == {"resident": ["kv_append", "attention_tiled"], "prepared": ["kv_append", "query_prep", "attention_tiled"]}


def test_queries_too_large_for_registers_keep_the_prepared_pass(executor, rng):
    runner = executor_for(executor, dict(prefill_min_queries=2, decode_max_queries=0, prefill_pass=TILED, prefill_resident_query_vec4=8))
    config = CaseConfig(head_size=256, seq_len=20, max_cache_len=32, sparse_block_size=16, do_rotary=True)
    tiling = runner.tuning.prefill_tiling(build_call(random_inputs(config, rng), OpAttributes.from_mapping(config.node_attributes())).shape)
    assert tiling.resident_query_vec4 > 8 and not tiling.resident_query
    check(runner, config, rng, TILED)


@pytest.mark.parametrize("merges", [True, False], ids=["last-slice-merges", "merge-pass"])
def test_split_k_with_more_slices_than_keys(executor, rng, merges):
    # Up to 64 slices of one key each, for queries that see from 1 to 20 keys: most slices
    # are empty and must drop out of the merge (41 slices count themselves in per query).
    runner = executor_for(
        executor, dict(decode_max_queries=16, decode_target_workgroups=1 << 20, decode_min_keys_per_split=1, decode_split_merges=merges)
    )
    config = CaseConfig(batch=3, seq_len=1, past_lengths=(0, 7, 40), max_cache_len=48, sparse_block_size=8, local_blocks=1, vert_stride=4)
    inputs = random_inputs(config, rng)
    shape = build_call(inputs, OpAttributes.from_mapping(config.node_attributes())).shape
    assert runner.tuning.decode_splits(shape) == 41
    check(runner, config, rng, SPLIT, inputs=inputs)


@pytest.mark.parametrize(
    "rotary", [dict(do_rotary=True), dict(do_rotary=True, rotary_interleaved=True), dict()], ids=["rotary", "interleaved", "none"]
)
def test_a_query_shared_in_workgroup_memory_equals_per_lane_queries(executor, rng, rotary):
    # The same rotate() of the same rows, by one invocation instead of every lane group:
    # equal outputs (assert_same_arithmetic: a driver may contract the rotation's
    # multiply-adds differently in the two places).
    # Head size 64: 16 query vec4s, more than one per lane and more than lavapipe's SIMD
    # width, so lanes read vec4s other invocations wrote (a missing barrier shows).
    config = CaseConfig(batch=2, seq_len=1, past_lengths=(120, 33), max_cache_len=128, sparse_block_size=16, head_size=64, **rotary)
    per_lane, shared = executor_for(executor, ROUTES["split-per-lane-query"]), executor_for(executor, ROUTES[SPLIT])
    shape = build_call(random_inputs(config, rng), OpAttributes.from_mapping(config.node_attributes())).shape
    cache = kernels.CacheFormat(rows=128, f16=False, round_keys_to_f16=False)
    for runner, shares in ((shared, True), (per_lane, False)):
        dispatches = kernels.call_dispatches(shape, kernels.route(shape, runner.tuning), cache, _AnyResource())
        (split,) = [d for d in dispatches if d.label == "attention_split"]
        assert ("query_shared" in split.program.render()) == shares
    for call in range(3):
        inputs = random_inputs(config, rng)
        expected = run_executor(per_lane, inputs, config.node_attributes(), "per-lane")[0]
        output = run_executor(shared, inputs, config.node_attributes(), "shared")[0]
        assert_same_arithmetic(per_lane, output, expected, what=f"call {call}")


def test_a_split_pass_that_merges_equals_the_merge_pass_call_after_call(executor, rng):
    # The same arithmetic in the same order (merge_slices.wgsl.jinja, 256 invocations in
    # both): bit-identical outputs, call after call. A merging slice that read another
    # slice's partial before it landed (no coherence, a missing barrier, a count left over
    # from the call before) would differ in some call.
    config = CaseConfig(batch=2, seq_len=1, past_lengths=(300, 117), max_cache_len=320, sparse_block_size=16, do_rotary=True)
    merging, separate = executor_for(executor, ROUTES[SPLIT]), executor_for(executor, ROUTES["split-merge-pass"])
    for call in range(12):
        inputs = random_inputs(config, rng)  # new inputs each call: a stale output cannot pass
        shape = build_call(inputs, OpAttributes.from_mapping(config.node_attributes())).shape
        assert merging.tuning.decode_splits(shape) > 8 and merging.tuning.decode_merges_in_split(shape)
        assert not separate.tuning.decode_merges_in_split(shape)
        expected = run_executor(separate, inputs, config.node_attributes(), "separate")[0]
        output = run_executor(merging, inputs, config.node_attributes(), "merging")[0]
        np.testing.assert_array_equal(output, expected, err_msg=f"call {call}")


@pytest.mark.parametrize("route", [SPLIT, "split-unfused", "split-tiles", "split-merge-pass", "split-per-lane-query", "split-tiles-per-lane-query"])
@pytest.mark.parametrize("past", [(0, 5, 40, 63), (63, 0, 17, 1)])
def test_split_k_ragged_batch(executor, rng, past, route):
    runner, _ = forced(executor, route)
    config = CaseConfig(batch=4, seq_len=1, past_lengths=past, max_cache_len=64)
    check(runner, config, rng, SPLIT)


@pytest.mark.parametrize("route", [TILED, ROWS])
def test_padded_prompt_rows_of_different_lengths(executor, rng, route):
    runner, expect = forced(executor, route)
    config = CaseConfig(batch=3, seq_len=29, prompt_lengths=(29, 1, 17), max_cache_len=32, sparse_block_size=16)
    check(runner, config, rng, expect)


@pytest.mark.parametrize("route", [SPLIT, "split-unfused", "split-tiles", "split-merge-pass", "split-per-lane-query", "split-tiles-per-lane-query"])
def test_split_k_short_chunk_decode_chain(executor, rng, route):
    # Chunks of 3 and single steps through split-K, the presents fed back each time.
    runner, _ = forced(executor, route)
    config = CaseConfig(batch=2, seq_len=5, prompt_lengths=(5, 3), max_cache_len=40, sparse_block_size=8)
    outputs = check(runner, config, rng, SPLIT, node_key="chain")
    lengths = np.array([5, 3])
    for seq_len in (3, 1, 1, 3):
        step = dataclasses.replace(config, seq_len=seq_len, past_lengths=tuple(int(v) for v in lengths), prompt_lengths=None)
        outputs = check(runner, step, rng, SPLIT, past=outputs[1:], node_key="chain")
        lengths = lengths + seq_len


@pytest.mark.parametrize("route", [SPLIT, "split-unfused", "split-tiles", "split-merge-pass", "split-per-lane-query", "split-tiles-per-lane-query"])
def test_chunk_whose_last_slots_hold_history_rows(executor, rng, route):
    # A chunk of 4 at positions 14..17 (blocks of 8) crosses into block row 2, which layout 1
    # lets see blocks 0 and 2 but not 1: query 17's last four slots are rows 6, 7, 16, 17, so
    # the tile of a query's own slots must still read its history rows from the cache.
    runner, _ = forced(executor, route)
    config = CaseConfig(seq_len=4, past_lengths=(14,), max_cache_len=32, sparse_block_size=8, num_layout=2)
    inputs = random_inputs(config, rng)
    rows = np.array([[0, 1, 3, 6, 10], [0, 1, 3, 5, 9]], np.int32)
    cols = np.array([[0, 0, 1, 0, 1, 2, 0, 1, 2, 3], [0, 0, 1, 0, 2, 0, 1, 2, 3, -1]], np.int32)
    inputs.update(block_row_indices=rows, block_col_indices=cols)
    check(runner, config, rng, SPLIT, inputs=inputs)


@pytest.mark.parametrize(
    "fields, passes",
    [
        (dict(decode_fused_append=True), ["attention_split"]),
        (dict(decode_fused_append=False), ["kv_append", "attention_split"]),
        (dict(decode_split_merges=False), ["attention_split", "attention_merge"]),
        (dict(coherent_storage=False), ["attention_split", "attention_merge"]),  # no @coherent: the merge reads stale partials
        # Rotary and packed: a split pass that merges and writes the rows binds 14 buffers, one
        # that merges only 11, the fused passes without it 11 each.
        (dict(max_storage_buffers=13), ["attention_split", "attention_merge"]),
        (dict(max_storage_buffers=11), ["attention_split", "attention_merge"]),
        (dict(max_storage_buffers=10), ["kv_append", "attention_split", "attention_merge"]),
    ],
)
def test_decode_passes_are_as_few_as_the_adapter_binds(executor, rng, fields, passes):
    runner = executor_for(executor, dict(ROUTES[SPLIT], **fields))
    config = CaseConfig(batch=2, seq_len=1, past_lengths=(9, 30), max_cache_len=40, do_rotary=True, packed=True)
    outputs = check(runner, config, rng, SPLIT, node_key="fused")
    assert [launch.label for launch in runner.node_state("fused").step_plan.launches] == passes
    # The next step reads the rows the first one wrote from the resident cache: none re-uploaded.
    check(runner, dataclasses.replace(config, past_lengths=(10, 31)), rng, SPLIT, past=outputs[1:], node_key="fused")
    assert run_executor.last_stats.history_rows_uploaded == 0


class _AnyResource(dict):
    """Every name a dispatch may bind, as one placeholder range (dispatches are only declared here)."""

    def __contains__(self, name):
        return True

    def __missing__(self, name):
        return BufferRange(None, 0, 16)


@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("fused", [False, True])
def test_the_storage_buffers_tuning_counts_are_those_the_decode_passes_declare(rng, fused, rotary):
    # Tuning decides from counts (decode_fuses_append, decode_merges_in_split) before any
    # dispatch exists: the least limit it accepts must be exactly what the passes then bind.
    config = CaseConfig(seq_len=1, past_lengths=(9,), max_cache_len=16, do_rotary=rotary, packed=rotary)
    shape = build_call(random_inputs(config, rng), OpAttributes.from_mapping(config.node_attributes())).shape
    cache = kernels.CacheFormat(rows=16, f16=False, round_keys_to_f16=False)

    def tuning(buffers, merges):
        return Tuning(max_storage_buffers=buffers, coherent_storage=True, decode_fused_append=fused, decode_split_merges=merges)

    def bound(merges):
        least = next(
            n
            for n in range(1, 64)
            if tuning(n, merges).decode_fuses_append(shape) == fused and tuning(n, merges).decode_merges_in_split(shape) == merges
        )
        dispatches = kernels.call_dispatches(shape, kernels.route(shape, tuning(least, merges)), cache, _AnyResource())
        return least, max(len(d.program.bindings) for d in dispatches), [d.label for d in dispatches]

    # (Unfused, unmerged passes have no count of their own to check: tuning decides nothing.)
    for merges in (True, False) if fused else (True,):
        least, declared, labels = bound(merges)
        assert declared == least, (merges, labels)
        assert ("attention_merge" in labels) != merges and ("kv_append" in labels) != fused


def test_split_k_partials_stay_within_one_binding(executor, rng):
    # A binding limit that holds the partials of 3 slices only: the split count obeys it.
    config = CaseConfig(batch=2, seq_len=1, past_lengths=(40, 33), max_cache_len=48, num_heads=4, head_size=16)
    inputs = random_inputs(config, rng)
    shape = build_call(inputs, OpAttributes.from_mapping(config.node_attributes())).shape
    per_slice = 2 * 4 * 16 * 4
    runner = executor_for(
        executor, dict(decode_max_queries=16, decode_target_workgroups=4096, decode_min_keys_per_split=1, max_binding_bytes=3 * per_slice + 100)
    )
    assert runner.tuning.decode_splits(shape) == 3
    assert max(kernels.scratch_bytes(shape, kernels.route(shape, runner.tuning)).values()) <= runner.tuning.max_binding_bytes
    check(runner, config, rng, SPLIT, inputs=inputs)


@pytest.mark.parametrize("lanes", [4, 16])
def test_rows_pass_without_one_whole_subgroup(executor, rng, lanes):
    # Workgroups that are not exactly one subgroup (lavapipe's is 8 lanes) take the path
    # where every lane reads each key itself; blocks of 4 force 4 lanes too.
    runner = executor_for(executor, dict(ROUTES[ROWS], rows_lanes=lanes))
    config = CaseConfig(seq_len=37, max_cache_len=64, sparse_block_size=32, vert_stride=2, local_blocks=1, head_size=24)
    check(runner, config, rng, ROWS)
    check(executor_for(executor, ROUTES[ROWS]), dataclasses.replace(config, sparse_block_size=4, max_cache_len=40), rng, ROWS)


def test_adapter_tuning_routes(executor):
    """What the adapter's own tuning picks: split-K for decode, a prefill pass for prompts."""

    def shape(seq_len, past=None, block=64):
        config = CaseConfig(seq_len=seq_len, past_lengths=past, max_cache_len=256, sparse_block_size=block, head_size=64)
        return build_call(random_inputs(config, np.random.default_rng(0)), OpAttributes.from_mapping(config.node_attributes())).shape

    tuning = executor.tuning
    assert tuning.attention_route(shape(1, (200,))) == SPLIT
    assert tuning.attention_route(shape(200)) in (TILED, ROWS)
    h200 = choose_tuning(
        {"max-compute-workgroup-storage-size": 49152, "max-storage-buffer-binding-size": 2**31 - 4, "max-compute-invocations-per-workgroup": 1024},
        frozenset({"subgroup", "shader-f16"}),
    )
    assert h200.attention_route(shape(200)) == TILED and h200.attention_route(shape(3, (100,))) == SPLIT
    lavapipe = {"max-compute-workgroup-storage-size": 32768, "max-storage-buffer-binding-size": 2**27, "max-compute-invocations-per-workgroup": 1024}
    assert choose_tuning(lavapipe, frozenset({"subgroup"})).attention_route(shape(200)) == ROWS
    assert choose_tuning(lavapipe, frozenset()).attention_route(shape(200)) == TILED  # no shuffles: no rows pass
    assert choose_tuning(lavapipe, frozenset({"subgroup"}), adapter_type="DiscreteGPU").attention_route(shape(200)) == TILED
    # Split-K decode scores one key per lane group and tile on GPUs, two on CPU adapters.
    assert h200.decode_split(shape(1, (200,))).keys_per_group == 1
    assert choose_tuning(lavapipe, frozenset({"subgroup"})).decode_split(shape(1, (200,))).keys_per_group == 2
    default = Tuning(workgroup_storage_bytes=49152)
    assert default.attention_route(shape(200)) == TILED
    assert default.attention_route(shape(200, block=4)) == SIMPLE  # blocks smaller than any tile
    assert default.prefill_tiling(shape(200)).workgroup == 256


def test_rows_and_tiled_agree_with_simple_on_a_long_prompt(executor, rng):
    # The Phi-3-small layout pattern at reduced width: many block rows with vertical stripes.
    config = CaseConfig(
        seq_len=200,
        max_cache_len=256,
        sparse_block_size=16,
        num_heads=4,
        kv_num_heads=2,
        num_layout=4,
        local_blocks=3,
        vert_stride=4,
        head_size=64,
        do_rotary=True,
    )
    inputs = random_inputs(config, rng)
    results = {}
    for route in ("tiled-default", ROWS, SIMPLE):
        runner, expect = forced(executor, route)
        results[route] = check(runner, config, rng, expect, inputs=inputs)[0]
    assert np.abs(results["tiled-default"] - results[SIMPLE]).max() < 1e-4
    assert np.abs(results[ROWS] - results[SIMPLE]).max() < 1e-4


@pytest.mark.parametrize(
    "route", [TILED, "tiled-default", "tiled-prepared-query", SPLIT, "split-one-key", "split-merge-pass", "split-tiles", ROWS, SIMPLE]
)
def test_shaders_without_runtime_checks_compute_what_checked_shaders_compute(executor, rng, route):
    # Naga's index clamps and loop counters never act in these kernels (Tuning.shader_runtime_checks),
    # so leaving them out changes nothing but where the driver contracts multiply-adds
    # (assert_same_arithmetic; the H200 differed by 7e-7 relative in split-tiles' merge). A
    # clamp that acted (an index out of range) would read another element: a difference of
    # the inputs' unit scale here, or a failed reference.
    unchecked, expect = forced(executor, route)
    checked = executor_for(executor, dict(ROUTES[route], shader_runtime_checks=True))
    assert checked.pipelines.runtime_checks and unchecked.pipelines.runtime_checks == (not native.UNCHECKED_SHADERS)
    config = CaseConfig(
        seq_len=1 if expect == SPLIT else 37,
        past_lengths=(45,),
        max_cache_len=96,
        sparse_block_size=16,
        head_size=32,
        num_heads=4,
        kv_num_heads=2,
        local_blocks=2,
        vert_stride=2,
        do_rotary=True,
    )
    inputs = random_inputs(config, rng)
    outputs = check(unchecked, config, rng, expect, inputs=inputs)
    expected = run_executor(checked, inputs, config.node_attributes(), "checked")
    assert len(outputs) == len(expected)
    for got, want in zip(outputs, expected):
        assert_same_arithmetic(unchecked, got, want)


def test_unchecked_shader_modules_report_wgsl_errors_as_checked_ones_do(executor):
    wgsl = "@compute @workgroup_size(1) fn main() { let x: u32 = 1.5; }"
    errors = []
    for create in (
        lambda: executor.context.device.create_shader_module(code=wgsl, label="bad"),
        lambda: native.create_unchecked_shader_module(executor.context.device, wgsl, "bad"),
    ):
        with pytest.raises(wgpu.GPUError) as raised:
            create()
        errors.append(type(raised.value))
    assert errors[0] is errors[1]
    executor.context.device.create_shader_module(code="@compute @workgroup_size(1) fn main() {}")  # the device still works


def test_a_shader_module_wgpu_native_does_not_create_is_a_gpu_execution_error(executor, rng, monkeypatch):
    """wgpu-native may answer a module it refused with no module and no reported error: the
    call fails as the GPU's, and its node starts afresh (a fresh executor: nothing compiled)."""
    from sparse_attention_op.webgpu.executor import GpuExecutionError

    if not native.UNCHECKED_SHADERS:
        pytest.skip("this wgpu-native compiles every module with its runtime checks")
    fresh = WebGPUExecutor(executor.context, executor.tuning)
    assert not fresh.pipelines.runtime_checks

    class NoModule:
        def wgpuDeviceCreateShaderModuleTrusted(self, *arguments):
            return native.ffi.NULL

    config = CaseConfig(seq_len=1, past_lengths=(9,), max_cache_len=16)
    call = build_call(random_inputs(config, rng), OpAttributes.from_mapping(config.node_attributes()))
    with monkeypatch.context() as patch:
        patch.setattr(native, "libf", NoModule())
        with pytest.raises(GpuExecutionError, match="created no shader module") as raised:
            fresh.run(call, "no-module")
    assert isinstance(raised.value.__cause__, wgpu.GPUError)
    assert fresh.node_keys() == [], "the failed node's state was dropped"
    assert fresh.run(call, "no-module").output.shape == call.shape.output_shape


def test_shader_checks_come_back_on_request(monkeypatch):
    limits = {"max-compute-workgroup-storage-size": 32768}
    assert not choose_tuning(limits, frozenset(), "DiscreteGPU").shader_runtime_checks
    monkeypatch.setenv("SAO_SHADER_CHECKS", "1")
    assert choose_tuning(limits, frozenset(), "DiscreteGPU").shader_runtime_checks
