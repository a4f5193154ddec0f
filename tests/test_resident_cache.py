"""The GPU-resident KV cache: exact whatever past the caller feeds, and only what changed moves.

Every step is compared with the float64 reference; the executor's call statistics say how
many history rows went to the GPU (a functional check, not a timing)."""

import numpy as np
import pytest

import sparse_attention_op as sao
from helpers import assert_matches_reference, graph_feeds, run_in_threads
from sparse_attention_op.graphs import sparse_attention_model
from sparse_attention_op.inputs import CaseConfig, random_inputs
from sparse_attention_op.webgpu import get_executor

pytestmark = pytest.mark.gpu

CONFIG = CaseConfig(batch=3, seq_len=6, num_heads=4, kv_num_heads=2, head_size=32, max_cache_len=48,
                    sparse_block_size=8, num_layout=2, do_rotary=True)
LAYOUT = ("block_row_indices", "block_col_indices", "cos_cache", "sin_cache")


class Sequence:
    """One generation: a prompt, then decode steps that feed each present back."""

    def __init__(self, session, rng, config=CONFIG, prompt_lengths=(6, 4, 6)):
        self.session, self.rng, self.config = session, rng, config
        self.lengths = np.array(prompt_lengths)
        self.inputs = random_inputs(CaseConfig(**{**config.__dict__, "prompt_lengths": prompt_lengths}), rng)
        self.outputs = None

    def step(self, past=None):
        """Run the pending inputs, check them, and prepare the next decode step."""
        outputs = self.session.run(None, graph_feeds(self.session, self.inputs))
        assert_matches_reference(outputs, self.inputs, self.config.node_attributes())
        if self.outputs is not None:
            self.lengths = self.lengths + 1
        self.outputs = outputs
        self.next(past)
        return get_executor().last_stats

    def next(self, past=None):
        past = past if past is not None else (self.outputs[1], self.outputs[2])
        step = CaseConfig(**{**self.config.__dict__, "seq_len": 1, "past_lengths": tuple(int(v) for v in self.lengths)})
        self.inputs = random_inputs(step, self.rng, past=past)


def new_session(rng):
    model = sparse_attention_model(CONFIG.node_attributes(), random_inputs(CONFIG, rng), constants=LAYOUT)
    return sao.create_session(model)


def test_decode_steps_upload_no_history(executor, rng):
    sequence = Sequence(new_session(rng), rng)
    first = sequence.step()
    assert first.cache.rows_uploaded == 0, "a prompt reads no history"
    cache_bytes = 2 * int(np.prod(sequence.inputs["past_key"].shape)) * 4
    for _ in range(8):
        stats = sequence.step()
        assert stats.cache.rows_uploaded == 0
        assert stats.upload_bytes < cache_bytes / 20, f"a decode step moved {stats.upload_bytes} bytes"


def test_restarted_sequence_in_the_same_session(executor, rng):
    session = new_session(rng)
    first = Sequence(session, rng)
    for _ in range(3):
        first.step()
    second = Sequence(session, rng, prompt_lengths=(2, 6, 5))
    assert second.step().cache.rows_uploaded == 0
    for _ in range(3):
        assert second.step().cache.rows_uploaded == 0


def test_beam_reorder_uploads_only_the_rows_that_moved(executor, rng):
    sequence = Sequence(new_session(rng), rng, prompt_lengths=(6, 6, 6))
    sequence.step()
    sequence.step()
    order = [0, 0, 2]  # row 1 now continues beam 0; rows 0 and 2 keep their own
    past = tuple(np.ascontiguousarray(p[order]) for p in sequence.outputs[1:])
    sequence.next(past)
    stats = sequence.step()
    history = int(sequence.lengths[1]) - 1
    # row 1's history differs (both tensors, every kv head); rows 0 and 2 are untouched
    assert 0 < stats.cache.rows_uploaded <= 2 * CONFIG.kv_num_heads * history
    assert sequence.step().cache.rows_uploaded == 0


def test_edited_cache_row_is_resynchronised_exactly(executor, rng):
    sequence = Sequence(new_session(rng), rng)
    sequence.step()
    sequence.step()
    edited_key = sequence.outputs[1].copy()
    edited_key[2, 1, 3] += 1.0  # batch row 2, kv head 1, cache row 3
    sequence.next((edited_key, sequence.outputs[2]))
    stats = sequence.step()
    assert stats.cache.rows_uploaded == 1
    assert sequence.step().cache.rows_uploaded == 0


def test_junk_beyond_history_is_neither_read_nor_compared(executor, rng):
    sequence = Sequence(new_session(rng), rng)
    sequence.step()
    key, value = (p.copy() for p in sequence.outputs[1:])
    for b, length in enumerate(sequence.lengths):
        key[b, :, length + 1 :] = np.nan  # the decode step writes row `length`; beyond it is junk
        value[b, :, length + 1 :] = np.inf
    sequence.next((key, value))
    assert sequence.step().cache.rows_uploaded == 0


def test_interleaved_sequences_from_threads_share_one_node(executor, rng):
    session = new_session(rng)
    failures = []

    def generate(seed):
        try:
            sequence = Sequence(session, np.random.default_rng(seed), prompt_lengths=(6, 3 + seed, 5))
            for _ in range(6):
                sequence.step()
        except Exception as error:  # pytest does not see thread exceptions
            failures.append(error)

    run_in_threads([lambda seed=seed: generate(seed) for seed in range(3)])
    assert not failures, failures[0]


def test_two_sessions_of_one_model_interleave_exactly(executor, rng):
    model = sparse_attention_model(CONFIG.node_attributes(), random_inputs(CONFIG, rng), constants=LAYOUT)
    first = Sequence(sao.create_session(model), rng)
    second = Sequence(sao.create_session(model), rng, prompt_lengths=(1, 2, 3))
    for _ in range(5):
        first.step()
        assert second.step().cache.rows_uploaded == 0


def test_gpu_failure_raises_clearly_and_the_node_starts_afresh(executor, rng, monkeypatch):
    from sparse_attention_op.webgpu import buffers
    from sparse_attention_op.webgpu.executor import GpuExecutionError

    sequence = Sequence(new_session(rng), rng)
    sequence.step()
    sequence.step()
    pending = sequence.inputs

    def lost(self, encoder):
        raise RuntimeError("simulated device loss")

    with monkeypatch.context() as patch:
        patch.setattr(buffers.Upload, "encode", lost)
        with pytest.raises(GpuExecutionError, match="simulated device loss"):
            sequence.session.run(None, graph_feeds(sequence.session, pending))
    # The failed node's GPU state was dropped: the next call re-uploads the history and is exact.
    sequence.inputs = pending
    stats = sequence.step()
    assert stats.cache.rows_uploaded > 0
    assert sequence.step().cache.rows_uploaded == 0


def test_float16_rotary_chain_needs_no_reupload(executor, rng):
    # The graph casts presents to float16 and the next past back to float32: the op must
    # produce float16 values for the rotated keys, or every step would re-upload history.
    config = CaseConfig(batch=2, seq_len=5, num_heads=4, kv_num_heads=2, head_size=32, max_cache_len=24, do_rotary=True)
    half = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in random_inputs(config, rng).items()}
    session = sao.create_session(sparse_attention_model(config.node_attributes(), half, float_dtype=np.float16, constants=LAYOUT))
    names = [i.name for i in session.get_inputs()]
    outputs = session.run(None, {n: half[n] for n in names})
    for step in range(4):
        past = (outputs[1].astype(np.float32), outputs[2].astype(np.float32))
        step_config = CaseConfig(**{**config.__dict__, "seq_len": 1, "past_lengths": (5 + step,) * 2})
        inputs = {k: (v.astype(np.float16) if v.dtype == np.float32 else v) for k, v in random_inputs(step_config, rng, past=past).items()}
        outputs = session.run(None, {n: inputs[n] for n in names})
        assert get_executor().last_stats.cache.rows_uploaded == 0
        as64 = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in inputs.items()}
        assert_matches_reference([o.astype(np.float64) for o in outputs], as64, config.node_attributes(), f"step {step}", tol=1e-2)


@pytest.mark.parametrize("f16_cache", [True, False])
def test_float16_storage_cache_on_gpu(executor, rng, f16_cache):
    from sparse_attention_op.spec import OpAttributes, build_call

    if f16_cache and "shader-f16" not in executor.context.features:
        pytest.fail("this test needs an adapter with shader-f16 (lavapipe has it)")
    config = CaseConfig(batch=2, seq_len=7, prompt_lengths=(7, 5), head_size=64, max_cache_len=32, do_rotary=True, rotary_interleaved=True)
    executor.f16_cache = f16_cache
    try:
        outputs = None
        lengths = np.array([7, 5])
        for step in range(4):
            step_config = config if step == 0 else CaseConfig(**{**config.__dict__, "seq_len": 1, "past_lengths": tuple(int(v) for v in lengths), "prompt_lengths": None})
            inputs = random_inputs(step_config, rng, past=None if outputs is None else outputs[1:])
            # float16-storage values: everything the graph would hand over is a float16 value
            inputs = {k: (v.astype(np.float16).astype(np.float32) if v.dtype == np.float32 else v) for k, v in inputs.items()}
            call = build_call(inputs, OpAttributes.from_mapping(step_config.node_attributes()), float16_storage=True)
            outputs = executor.run(call, node_key=f"f16-cache-{f16_cache}")
            assert executor._nodes[f"f16-cache-{f16_cache}"].cache.dtype == (np.float16 if f16_cache else np.float32)
            assert_matches_reference(outputs, inputs, step_config.node_attributes(), f"step {step}", tol=1e-2)
            assert np.array_equal(outputs[1], outputs[1].astype(np.float16).astype(np.float32)), "presents must be float16 values"
            if step:
                assert executor.last_stats.cache.rows_uploaded == 0
                lengths = lengths + 1
    finally:
        executor.f16_cache = True
