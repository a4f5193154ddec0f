"""The resident KV cache and its two checks, through both ways users run models.

Ways: ``plain`` feeds numpy pasts and feeds each present back; ``shared`` binds past and
present to one buffer (IO binding, as ORT GenAI runs it), where the presents are written in
place; ``ort_values`` feeds OrtValues (run_with_ort_values). Every step is compared with the
float64 reference; the node's call statistics say how many history rows were compared and
how many went to the GPU (functional checks, not timings)."""

import dataclasses
import logging
import re

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from helpers import assert_close, assert_matches_reference, drop_buffer, run_in_threads

import sparse_attention_op as sao
from sparse_attention_op import GpuExecutionError
from sparse_attention_op.op.reference import sparse_attention_reference
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs
from sparse_attention_op.webgpu.cache_record import RECORD_FRACTION, chunk_rows_for, probe_rows

pytestmark = pytest.mark.gpu

CONFIG = CaseConfig(
    batch=3, seq_len=6, num_heads=4, kv_num_heads=2, head_size=32, max_cache_len=48, sparse_block_size=8, num_layout=2, do_rotary=True
)
LAYOUT = ("block_row_indices", "block_col_indices", "cos_cache", "sin_cache")
MODES = ["exact", "fast"]
WAYS = ["plain", "shared"]


def new_session(rng, kv_check, config=CONFIG, dtype=np.float32):
    inputs = random_inputs(config, rng)
    inputs = {k: (v.astype(dtype) if v.dtype == np.float32 else v) for k, v in inputs.items()}
    return sao.create_session(sparse_attention_model(config.node_attributes(), inputs, constants=LAYOUT, float_dtype=dtype), kv_check=kv_check)


class Generation:
    """A prompt, then decode steps; the past of each step is the cache the last one left."""

    def __init__(self, session, rng, way, config=CONFIG, prompt_lengths=(6, 4, 6), dtype=np.float32):
        self.session, self.rng, self.way, self.dtype = session, rng, way, dtype
        self.config = CaseConfig(**{**config.__dict__, "prompt_lengths": prompt_lengths})
        self.lengths = np.array(prompt_lengths)
        shape = (self.config.batch, self.config.kv_num_heads, self.config.max_cache_len, self.config.head_size)
        self.past = [rng.standard_normal(shape, dtype=np.float32).astype(dtype) for _ in range(2)]
        self.inputs = self._inputs(self.config)
        self.output = None

    def _inputs(self, config):
        inputs = random_inputs(config, self.rng, past=[p.astype(np.float32) for p in self.past])
        return {k: (v.astype(self.dtype) if v.dtype == np.float32 else v) for k, v in inputs.items()}

    def feeds(self):
        return {i.name: self.inputs[i.name] for i in self.session.get_inputs()}

    def step(self, check=True):
        """Run the pending inputs, compare with the reference, prepare the next decode step."""
        expected_inputs = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in self.inputs.items()}
        if self.way == "plain":
            self.output, present_key, present_value = self.session.run(None, self.feeds())
            self.past = [present_key, present_value]
        elif self.way == "ort_values":
            feeds = {name: ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(value)) for name, value in self.feeds().items()}
            self.output, *self.past = (value.numpy() for value in self.session.run_with_ort_values(None, feeds))
        else:
            self.output = run_shared(self.session, self.feeds(), self.past)
        if check:
            tol = 1e-2 if self.dtype == np.float16 else 2e-3
            outputs = [self.output.astype(np.float64)] + [p.astype(np.float64) for p in self.past]
            assert_matches_reference(outputs, expected_inputs, self.config.node_attributes(), f"{self.way} step", tol)
        stats = next(iter(self.session.last_stats().values()))
        if self.config.past_lengths is not None:
            self.lengths = self.lengths + 1
        self.next()
        return stats

    def next(self):
        """Pending inputs: one new token per row, after everything the row holds."""
        self.config = CaseConfig(
            **{**self.config.__dict__, "seq_len": 1, "past_lengths": tuple(int(v) for v in self.lengths), "prompt_lengths": None}
        )
        self.inputs = self._inputs(self.config)


def run_shared(session, feeds, past):
    """IO binding with present_key/present_value bound to the past's own buffers (in place)."""
    values = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in zip(("past_key", "past_value"), past)}
    binding = sao.bind_shared(session, feeds, values)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0]


def test_bind_shared_names_each_mistake(rng):
    """Before anything is bound; no GPU work (binding runs nothing)."""
    session = new_session(rng, "fast")
    inputs = random_inputs(CONFIG, rng)
    feeds = {i.name: inputs[i.name] for i in session.get_inputs()}
    values = {name: ort.OrtValue.ortvalue_from_numpy(inputs[name]) for name in ("past_key", "past_value")}
    for arguments, error, message in [
        (dict(caches=values, outputs="output"), TypeError, "got the string 'output': write ('output',)"),
        (
            dict(caches={"past_key": inputs["past_key"], "past_value": values["past_value"]}),
            TypeError,
            "caches['past_key'] must be an onnxruntime.OrtValue",
        ),
        (dict(caches=values, outputs=("logits",)), KeyError, "'logits' is not an output of the session"),
        (dict(caches={"past_key": values["past_key"]}), KeyError, "maps 'present_value' to 'past_value', which caches lacks"),
    ]:
        with pytest.raises(error, match=re.escape(message)):
            sao.bind_shared(session, feeds, **arguments)
    sao.bind_shared(session, feeds, values)  # the right arguments bind


@pytest.mark.parametrize("way", WAYS + ["ort_values"])
@pytest.mark.parametrize("kv_check", MODES)
def test_decode_steps_move_no_history(executor, rng, kv_check, way):
    generation = Generation(new_session(rng, kv_check), rng, way)
    first = generation.step()
    assert first.history_rows_compared == 0 and first.history_rows_uploaded == 0, "a prompt reads no history"
    for _ in range(6):
        stats = generation.step()
        assert stats.history_rows_uploaded == 0
        if kv_check == "fast":
            assert stats.history_rows_compared == 0, "the fast check passed: no history row was read"
        else:
            assert stats.history_rows_compared == 2 * CONFIG.kv_num_heads * int((generation.lengths - 1).sum())


@pytest.mark.parametrize("kv_check", MODES)
def test_pasts_are_read_wherever_ort_holds_them(executor, rng, kv_check):
    """Pasts bound through any IOBinding, by OrtValue, by pointer (with the element type as
    a numpy type or an ONNX type number) or as arrays ORT must copy first (Fortran order):
    the node reads them where ORT holds them for the run, so the fast check needs no
    history and the exact check uploads nothing it holds."""
    session = new_session(rng, kv_check)
    generation = Generation(session, rng, "plain")
    generation.step()
    binds = {
        "ortvalue": lambda binding, name, past: binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(past)),
        "pointer": lambda binding, name, past: binding.bind_input(
            name, "cpu", 0, np.float32 if name == "past_key" else onnx.TensorProto.FLOAT, past.shape, past.ctypes.data
        ),
        "fortran": lambda binding, name, past: binding.bind_cpu_input(name, np.asfortranarray(past)),
    }
    for way, bind in binds.items():
        feeds = generation.feeds()
        inputs = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in generation.inputs.items()}
        pasts = {name: np.ascontiguousarray(feeds[name]) for name in ("past_key", "past_value")}
        binding = ort.IOBinding(session)
        for name, value in feeds.items():
            if name in pasts:
                bind(binding, name, pasts[name])
            else:
                binding.bind_cpu_input(name, value)
        for name in ("output", "present_key", "present_value"):
            binding.bind_output(name)
        session.run_with_iobinding(binding)
        stats = next(iter(session.last_stats().values()))
        assert stats.history_rows_uploaded == 0 and not stats.probes_differed, way
        if kv_check == "fast":
            assert stats.history_rows_compared == 0, way
        outputs = binding.copy_outputs_to_cpu()
        assert_matches_reference([o.astype(np.float64) for o in outputs], inputs, CONFIG.node_attributes(), f"pasts bound as {way}")
        generation.past = outputs[1:]
        generation.lengths = generation.lengths + 1
        generation.next()


@pytest.mark.parametrize("way", WAYS)
def test_nothing_keeps_the_fed_pasts_after_the_run(executor, rng, way):
    """The node reads the caller's pasts during the run only: nothing keeps them alive."""
    import gc
    import weakref

    session = new_session(rng, "exact")
    generation = Generation(session, rng, way)
    generation.step()
    fed = [weakref.ref(generation.inputs[name]) for name in ("past_key", "past_value")]
    generation.step()  # fed those arrays, then moved on to new inputs
    if way == "plain":  # (the shared way feeds copies it keeps itself)
        gc.collect()
        assert [ref() for ref in fed] == [None, None], "the arrays the last run was fed are the caller's to free"


def test_shared_buffers_are_written_in_place(executor, rng):
    generation = Generation(new_session(rng, "fast"), rng, "shared")
    generation.step()
    buffers = [p.__array_interface__["data"][0] for p in generation.past]
    before = generation.past[1].copy()
    generation.step()
    assert [p.__array_interface__["data"][0] for p in generation.past] == buffers
    for b, length in enumerate(generation.lengths - 1):
        assert not np.array_equal(generation.past[1][b, :, length], before[b, :, length]), "the new row landed in the caller's buffer"
        assert np.array_equal(np.delete(generation.past[1][b], length, axis=1), np.delete(before[b], length, axis=1)), "nothing else changed"


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kv_check", MODES)
def test_restart_in_the_same_session(executor, rng, kv_check, way):
    session = new_session(rng, kv_check)
    first = Generation(session, rng, way)
    for _ in range(3):
        first.step()
    second = Generation(session, rng, way, prompt_lengths=(2, 6, 5))
    second.step()
    for _ in range(3):
        assert second.step().history_rows_uploaded == 0


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kv_check", MODES)
def test_beam_reorder(executor, rng, kv_check, way):
    generation = Generation(new_session(rng, kv_check), rng, way, prompt_lengths=(6, 6, 6))
    generation.step()
    generation.step()
    order = [0, 0, 2]  # row 1 now continues beam 0; rows 0 and 2 keep their own
    generation.past = [np.ascontiguousarray(p[order]) for p in generation.past]
    generation.next()
    stats = generation.step()
    history = int(generation.lengths[1]) - 1
    # row 1's history differs (both tensors, every kv head); rows 0 and 2 are untouched
    assert 0 < stats.history_rows_uploaded <= 2 * CONFIG.kv_num_heads * history
    assert generation.step().history_rows_uploaded == 0


@pytest.mark.parametrize("kv_check", MODES)
def test_edit_in_the_last_rows_is_caught(executor, rng, kv_check):
    generation = Generation(new_session(rng, kv_check), rng, "plain")
    generation.step()
    generation.step()
    row = int(generation.lengths[2]) - 2  # among the last rows, which the fast check probes
    generation.past[0][2, 1, row] += 1.0
    generation.next()
    stats = generation.step()
    chunk = chunk_rows_for(CONFIG.head_size, 4)
    assert 0 < stats.history_rows_uploaded <= chunk, "only the edited chunk goes up"
    assert generation.step().history_rows_uploaded == 0


def test_exact_check_catches_a_single_bit_in_the_middle(executor, rng):
    generation = Generation(new_session(rng, "exact"), rng, "plain")
    for _ in range(3):
        generation.step()
    key = generation.past[0]
    key[0, 0, 2] = np.nextafter(key[0, 0, 2], np.float32(np.inf))  # one ulp of one row
    generation.next()
    assert generation.step().history_rows_uploaded == chunk_rows_for(CONFIG.head_size, 4)


def test_fast_check_misses_an_unprobed_edit_as_documented(executor, rng):
    # The documented blind spot: a change confined to rows the fast check did not probe.
    # The step then computes with what the GPU holds; the exact check would not miss it.
    config = CaseConfig(**{**CONFIG.__dict__, "batch": 1, "seq_len": 60, "max_cache_len": 128})
    generation = Generation(new_session(rng, "fast", config), rng, "plain", config=config, prompt_lengths=(60,))
    for _ in range(3):
        generation.step()
    past = int(generation.lengths[0])
    probed = {(int(head), int(row)) for head, row in probe_rows((past,), CONFIG.kv_num_heads, past + 1)[0]}
    row = next(r for r in range(past - 8) if (0, r) not in probed)
    held = generation.past[1].copy()
    generation.past[1][0, 0, row] += 5.0
    generation.next()
    generation.inputs["past_value"] = held  # the reference sees what the GPU holds ...
    expected_inputs = dict(generation.inputs)
    generation.inputs["past_value"] = generation.past[1]  # ... the session the edited past
    output = generation.session.run(None, generation.feeds())[0]
    stats = next(iter(generation.session.last_stats().values()))
    assert stats.history_rows_compared == 0 and stats.history_rows_uploaded == 0
    expected = sparse_attention_reference(**expected_inputs, **config.node_attributes())[0]
    assert_close(output, expected, "output with the unprobed edit")


@pytest.mark.parametrize("probe", ["last row", "spread row"])
def test_fast_check_sees_an_edit_at_each_probed_pair(executor, rng, probe):
    # One value changed at a probed (kv head, row) pair of one batch row, in the pair's own
    # head and no other: the GPU must compare that head's row (a kernel that read another
    # head, or the row of another batch row, would miss it).
    config = CaseConfig(**{**CONFIG.__dict__, "seq_len": 60, "kv_num_heads": 4, "num_heads": 8, "max_cache_len": 128})
    generation = Generation(new_session(rng, "fast", config), rng, "plain", config=config, prompt_lengths=(60, 44, 52))
    generation.step()
    assert not generation.step().probes_differed, "an unedited past agrees with the cache at every probed pair"
    b = 1
    past = tuple(int(v) for v in generation.lengths)
    probes = probe_rows(past, config.kv_num_heads, max(past) + 1)[b]
    last = [(int(h), int(r)) for h, r in probes[:-8] if h != 0]  # a last row outside head 0
    spread = [(int(h), int(r)) for h, r in probes[-8:] if h != 0 and r < past[b] - 8]
    head, row = (last if probe == "last row" else spread)[0]
    generation.past[0][b, head, row, 5] += 1.0
    generation.next()
    stats = generation.step()  # against the reference of the edited past
    assert stats.probes_differed and stats.history_rows_uploaded > 0, (probe, head, row)


@pytest.mark.parametrize("kv_check", MODES)
def test_junk_beyond_history_is_neither_read_nor_compared(executor, rng, kv_check):
    generation = Generation(new_session(rng, kv_check), rng, "plain")
    generation.step()
    for b, length in enumerate(generation.lengths):
        generation.past[0][b, :, length + 1 :] = np.nan  # the next step writes row `length`; beyond it is junk
        generation.past[1][b, :, length + 1 :] = np.inf
    generation.next()
    stats = generation.step()
    assert stats.history_rows_uploaded == 0 and not stats.probes_differed, "the GPU's fast check skips the junk its last chunks hold"


def test_the_gpu_fast_check_compares_bits(executor, rng):
    """A probed value whose only change is its sign of zero is a change, as for the exact
    check's digests: the call runs again after the exact check, which uploads that chunk."""
    generation = Generation(new_session(rng, "fast"), rng, "plain")
    generation.step()
    generation.inputs["value"][2, 0, 0] = 0.0  # batch row 2, kv head 0, dim 0 of the row this step writes
    generation.step()
    row = int(generation.lengths[2]) - 1  # the last history row: among the probes
    assert generation.past[1][2, 0, row, 0] == 0.0 and not np.signbit(generation.past[1][2, 0, row, 0])
    generation.past[1][2, 0, row, 0] = -0.0
    generation.next()
    stats = generation.step()
    assert stats.probes_differed
    assert 0 < stats.history_rows_uploaded <= chunk_rows_for(CONFIG.head_size, 4)
    stats = generation.step()
    assert not stats.probes_differed and stats.history_rows_compared == 0


@pytest.mark.parametrize("way", WAYS)
def test_replayed_decode_steps_equal_the_general_call_bit_for_bit(executor, rng, monkeypatch, way):
    """From the second decode step on, a fast check's steps replay the node's step plan
    straight from the operator's tensors (webgpu/step_plan.py). A second session of the same
    model, whose calls all go the general way, gets the same inputs: outputs and presents
    agree to the bit."""
    from sparse_attention_op.webgpu.executor import WebGPUExecutor

    model = sparse_attention_model(CONFIG.node_attributes(), random_inputs(CONFIG, rng), constants=LAYOUT)
    general = sao.create_session(model, kv_check="fast")
    generation = Generation(sao.create_session(model, kv_check="fast"), rng, way)
    for step in range(6):
        feeds = {name: np.array(value, copy=True) for name, value in generation.feeds().items()}
        with monkeypatch.context() as patch:
            patch.setattr(WebGPUExecutor, "replay", lambda *arguments, **keywords: None)
            expected = general.run(None, feeds)
        general_stats = next(iter(general.last_stats().values()))
        assert not general_stats.replayed
        stats = generation.step()
        assert stats.replayed == (step >= 2), f"step {step}: the prompt and the first decode step go the general way"
        assert stats.upload_bytes == general_stats.upload_bytes, f"step {step}: the same bytes go to the GPU"
        for actual, wanted, name in zip([generation.output, *generation.past], expected, ("output", "present_key", "present_value")):
            np.testing.assert_array_equal(actual, wanted, err_msg=f"step {step}: {name}")


def test_a_replayed_step_whose_probes_differ_runs_once_more_after_the_exact_check(executor, rng, monkeypatch):
    """A replay whose probed row differs from the cache (here: an edit at the last history
    row) is run again at once after the exact check, once, as the general call's fast check
    does: the presents' rows and the past's copy are written once, and the record learns
    the row once."""
    from sparse_attention_op.ort import presents
    from sparse_attention_op.webgpu.executor import WebGPUExecutor

    generation = Generation(new_session(rng, "fast"), rng, "plain")
    generation.step()
    generation.step()
    assert generation.step().replayed
    row = int(generation.lengths[1]) - 1
    generation.past[0][1, 1, row, 3] += 1.0  # batch row 1, kv head 1: one of the probed last rows
    generation.next()
    executed, copies, run_call, copy_past = [], [], WebGPUExecutor._run_call, presents.copy_past

    def spy_run_call(self, call, *arguments, **keywords):
        executed.append(call.fast_check)
        return run_call(self, call, *arguments, **keywords)

    def spy_copy_past(*arguments):
        copies.append(1)
        return copy_past(*arguments)

    with monkeypatch.context() as patch:
        patch.setattr(WebGPUExecutor, "_run_call", spy_run_call)
        patch.setattr("sparse_attention_op.ort.bridge.copy_past", spy_copy_past)
        stats = generation.step()  # against the reference of the edited past
    assert stats.probes_differed and not stats.replayed and 0 < stats.history_rows_uploaded
    assert executed == [False], "after the replay, one call with the exact check"
    assert len(copies) == 2, "each present gets the past's copy once"
    assert not generation.step().replayed, "the exact call leaves no replay behind"
    assert generation.step().replayed


def test_a_plain_session_over_a_prepared_model_replays_too(executor, rng, monkeypatch):
    """ORT GenAI runs prepared models in sessions of its own, whose nodes run under the
    default settings: its decode steps replay as create_session's do (a spy on the
    executor's replay counts the calls it served)."""
    from sparse_attention_op.ort.session import session_options
    from sparse_attention_op.webgpu.executor import WebGPUExecutor

    served, replay = [], WebGPUExecutor.replay

    def spy(*arguments, **keywords):
        result = replay(*arguments, **keywords)
        served.append(result is not None)
        return result

    monkeypatch.setattr(WebGPUExecutor, "replay", spy)
    model = sparse_attention_model(CONFIG.node_attributes(), random_inputs(CONFIG, rng), constants=LAYOUT)
    session = ort.InferenceSession(
        sao.prepare_model(model, kv_check="fast").SerializeToString(), session_options(), providers=["CPUExecutionProvider"]
    )
    generation = Generation(session, rng, "shared")
    for _ in range(5):
        inputs = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in generation.inputs.items()}
        generation.output = run_shared(session, generation.feeds(), generation.past)
        assert_matches_reference([generation.output, *generation.past], inputs, generation.config.node_attributes(), "plain session step", 2e-3)
        generation.lengths = generation.lengths + (generation.config.past_lengths is not None)
        generation.next()
    assert served == [False, True, True, True], "the first decode step goes the general way, the next ones replay it"


def test_a_replay_gives_way_where_the_gpu_cache_grows(executor, rng):
    """The GPU cache holds 256 rows first and grows by doubling: the decode step whose row
    falls beyond them grows it the general way, and the steps after it replay again. (64
    query heads: split-K's slice count is at its cap on every adapter, so the growth alone
    stops the replay.)"""
    config = CaseConfig(
        batch=1, seq_len=254, num_heads=64, kv_num_heads=2, head_size=16, max_cache_len=272, sparse_block_size=16, num_layout=1, do_rotary=True
    )
    generation = Generation(new_session(rng, "fast", config), rng, "shared", config=config, prompt_lengths=(254,))
    generation.step()
    replayed = []
    for _ in range(6):  # rows 254 .. 259: row 256 is the first beyond the first 256
        past = int(generation.lengths[0])
        replayed.append((past, generation.step().replayed))
    assert replayed == [(254, False), (255, True), (256, False), (257, True), (258, True), (259, True)], replayed


@pytest.mark.parametrize("moved", ["inputs", "results", "readback.0"])
def test_a_replay_gives_way_when_the_shared_buffers_move(executor, rng, moved):
    """The executor's shared buffers (the call's inputs, results and read-back) are replaced
    when a call of any node needs them larger, which frees the old ones: the next step of a
    replaying node goes the general way (on the new buffers), then replays again."""
    generation = Generation(new_session(rng, "fast"), rng, "shared")
    generation.step()
    generation.step()
    assert generation.step().replayed
    drop_buffer(executor._scratch, moved)  # what growing it for another node's call does to the old one
    assert not generation.step().replayed
    assert generation.step().replayed


@pytest.mark.parametrize("kv_check", MODES)
def test_sequences_in_threads_and_handed_between_threads(executor, rng, kv_check):
    session = new_session(rng, kv_check)
    failures = []
    generations = [Generation(session, np.random.default_rng(seed), "shared", prompt_lengths=(6, 3 + seed, 5)) for seed in range(3)]

    def advance(generation, steps):
        try:
            for _ in range(steps):
                generation.step()
        except Exception as error:  # pytest does not see thread exceptions
            failures.append(error)

    run_in_threads([lambda g=g: advance(g, 4) for g in generations])
    assert not failures, failures[0]
    # Each sequence continues on another thread than the one that started it.
    run_in_threads([lambda g=g: advance(g, 3) for g in reversed(generations)])
    assert not failures, failures[0]


@pytest.mark.parametrize("kv_check", MODES)
def test_two_sessions_of_one_model_interleave(executor, rng, kv_check):
    model = sparse_attention_model(CONFIG.node_attributes(), random_inputs(CONFIG, rng), constants=LAYOUT)
    first = Generation(sao.create_session(model, kv_check=kv_check), rng, "plain")
    second = Generation(sao.create_session(model, kv_check=kv_check), rng, "shared", prompt_lengths=(1, 2, 3))
    for _ in range(5):
        first.step()
        assert second.step().history_rows_uploaded == 0


@pytest.mark.parametrize("kv_check", MODES)
def test_gpu_failure_raises_clearly_and_the_node_starts_afresh(executor, rng, monkeypatch, kv_check):
    import wgpu

    from sparse_attention_op.webgpu import recording

    generation = Generation(new_session(rng, kv_check), rng, "plain")
    generation.step()
    generation.step()  # (a fast check's decode steps from here on are replayed: the loss hits a replay)

    def lost(*args, **kwargs):
        raise wgpu.GPUInternalError("simulated device loss")

    with monkeypatch.context() as patch:
        for kind in (recording.NativeRecording, recording.WgpuPyRecording):
            patch.setattr(kind, "submit", lost)
        with pytest.raises(GpuExecutionError, match="simulated device loss"):
            generation.session.run(None, generation.feeds())
    # The failed node's GPU state was dropped: the next call re-uploads the history and is exact.
    assert generation.step().history_rows_uploaded > 0
    assert generation.step().history_rows_uploaded == 0


@pytest.mark.parametrize("failure", ["buffer", "map"])
@pytest.mark.parametrize("kv_check", MODES)
def test_the_packages_own_gpu_failures_reach_the_caller_as_gpu_execution_errors(executor, rng, monkeypatch, kv_check, failure):
    """A buffer the adapter cannot hold (buffers.GpuBufferError) and a map that fails
    (mapping.MapError) are the GPU's failures as much as the device's own errors: a session's
    run raises GpuExecutionError, which names the node and the failure, and the node starts
    afresh."""
    from sparse_attention_op.webgpu import buffers, mapping, step_plan

    generation = Generation(new_session(rng, kv_check), rng, "plain")
    generation.step()

    def refused(*arguments, **keywords):
        if failure == "buffer":
            raise buffers.GpuBufferError("'inputs' needs more bytes than this adapter binds in one buffer (simulated)")
        raise mapping.MapError("mapping buffer 'readback.0' failed: status 1 (simulated)")

    with monkeypatch.context() as patch:
        if failure == "buffer":  # (the first decode step builds its node's plan, which gets its buffers)
            patch.setattr(buffers.BufferPool, "get", refused)
        else:
            patch.setattr(step_plan, "mapped", refused)
        with pytest.raises(GpuExecutionError, match=r"SparseAttention node '.+' failed on .+: (GpuBufferError|MapError): .*simulated"):
            generation.session.run(None, generation.feeds())
    assert generation.step().history_rows_uploaded > 0, "the node started afresh"
    assert generation.step().history_rows_uploaded == 0


def test_a_host_fault_is_not_reported_as_a_gpu_failure(executor, rng, monkeypatch):
    from sparse_attention_op.webgpu import buffers

    generation = Generation(new_session(rng, "fast"), rng, "plain")
    generation.step()

    def bug(*args, **kwargs):
        raise ZeroDivisionError("a host-side bug")

    with monkeypatch.context() as patch:
        patch.setattr(buffers.Upload, "encode", bug)
        with pytest.raises(ZeroDivisionError, match="host-side bug"):
            generation.session.run(None, generation.feeds())
    generation.step()  # the node starts afresh and is exact


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("kv_check", MODES)
def test_float16_chain_needs_no_reupload(executor, rng, kv_check, way):
    # The graph stores the presents as float16 and the next past crosses as float32: the op
    # produces float16 values for the rotated keys, or every step would re-upload history.
    generation = Generation(new_session(rng, kv_check, dtype=np.float16), rng, way, dtype=np.float16)
    generation.step()
    for _ in range(4):
        assert generation.step().history_rows_uploaded == 0


def test_record_stays_within_one_percent_and_the_gpu_cache_follows_history(executor, rng):
    config = CaseConfig(**{**CONFIG.__dict__, "max_cache_len": 4096, "sparse_block_size": 64})
    for head_size, dtype in ((32, np.float32), (8 * 2, np.float16), (256, np.float32)):
        config = CaseConfig(**{**config.__dict__, "head_size": head_size, "do_rotary": head_size % 16 == 0})
        session = new_session(rng, "exact", config, dtype)
        generation = Generation(session, rng, "shared", config=config, dtype=dtype)
        for _ in range(3):
            generation.step(check=False)
        (node_key,) = [k for k in executor.node_keys() if k.startswith(session.sparse_attention_token)]
        cache = executor.node_state(node_key).cache
        cache_bytes = 2 * generation.past[0].nbytes  # the model's cache: past_key + past_value
        assert cache.record.nbytes <= RECORD_FRACTION * cache_bytes, (head_size, dtype, cache.record.nbytes, cache_bytes)
        assert cache.rows < 4096 // 4, "the GPU cache holds about the history, not the capacity"


@pytest.mark.parametrize("dtype, head_size", [(np.float32, 32), (np.float16, 64)])  # room for rows beside the table
def test_rows_the_record_keeps_back_are_digested_as_the_cache_holds_them(executor, rng, dtype, head_size):
    """Decode steps that never read the record (the GPU's fast check) leave their rows'
    digests for later; read, the record describes exactly the rows the cache holds."""
    config = CaseConfig(**{**CONFIG.__dict__, "max_cache_len": 4096, "sparse_block_size": 64, "head_size": head_size})
    session = new_session(rng, "fast", config, dtype)
    generation = Generation(session, rng, "shared", config=config, dtype=dtype)
    for _ in range(8):
        generation.step()
    (node_key,) = [k for k in executor.node_keys() if k.startswith(session.sparse_attention_token)]
    record = executor.node_state(node_key).cache.record
    assert 2 <= record._pending_capacity < 8 and record._pending_rows > 0, "steps were kept back, and (8 of them) flushed on the way"
    assert record.valid.tolist() == generation.lengths.tolist()
    for name, past in zip(("key", "value"), generation.past):
        table = record.chunk_digests(name)
        for b, length in enumerate(generation.lengths):
            expected = record.digests.of(past[b, :, :length].astype(np.float32))
            assert np.array_equal(table[b, :, : expected.shape[1]], expected), (name, b)


@pytest.mark.parametrize("wrong", ["output", "present_key"])
def test_wrongly_bound_output_raises_before_any_gpu_work(executor, rng, wrong):
    # IO binding whose output keeps the previous step's shape once killed the process.
    session = new_session(rng, "fast")
    generation = Generation(session, rng, "shared")
    generation.step()
    (node_key,) = [k for k in executor.node_keys() if k.startswith(session.sparse_attention_token)]
    held = executor.node_state(node_key).cache.record.valid.copy()
    binding = session.io_binding()
    for name, value in generation.feeds().items():
        binding.bind_cpu_input(name, np.ascontiguousarray(value))
    shapes = {"output": (3, 6, CONFIG.num_heads * CONFIG.head_size), "present_key": generation.past[0][:, :, :-1].shape}
    for name in ("output", "present_key", "present_value"):
        if name == wrong:
            binding.bind_ortvalue_output(name, ort.OrtValue.ortvalue_from_numpy(np.zeros(shapes[name], np.float32)))
        else:
            binding.bind_output(name)
    with pytest.raises(Exception, match=re.escape(str(list(shapes[wrong])).replace("[", "{").replace("]", "}").replace(" ", ""))):
        session.run_with_iobinding(binding)
    assert np.array_equal(executor.node_state(node_key).cache.record.valid, held), "no GPU work before the outputs are known"
    generation.step()  # the session keeps working


def test_refused_call_under_a_plain_session_raises_and_logs(executor, rng, caplog):
    model = sparse_attention_model(CONFIG.node_attributes(), random_inputs(CONFIG, rng), constants=LAYOUT)
    sao.register()
    session = ort.InferenceSession(sao.prepare_model(model).SerializeToString(), sao.session_options(), providers=["CPUExecutionProvider"])
    inputs = random_inputs(CONFIG, rng)
    feeds = {i.name: inputs[i.name] for i in session.get_inputs()}
    feeds["key_total_sequence_lengths"] = np.array([99, 6, 6], np.int32)
    with caplog.at_level(logging.ERROR, logger="sparse_attention_op.ort.bridge"):
        with pytest.raises(Exception):
            session.run(None, feeds)
    assert any("key_total_sequence_lengths" in r.getMessage() and "sparse_attention" in r.getMessage() for r in caplog.records)


def test_ort_reads_a_broken_rule_as_it_is_and_an_internal_fault_by_its_type(executor, rng, monkeypatch):
    """Through a plain InferenceSession (ORT's own message): a call that breaks the operator's
    rules reads as the rule; a fault inside the op (here a ValueError of the executor's)
    keeps its type name, so that it never reads as a broken rule."""
    from sparse_attention_op.webgpu.executor import WebGPUExecutor

    model = sparse_attention_model(CONFIG.node_attributes(), random_inputs(CONFIG, rng), constants=LAYOUT)
    sao.register()
    session = ort.InferenceSession(sao.prepare_model(model).SerializeToString(), sao.session_options(), providers=["CPUExecutionProvider"])
    inputs = random_inputs(CONFIG, rng)
    feeds = {i.name: inputs[i.name] for i in session.get_inputs()}
    options = ort.RunOptions()
    options.log_severity_level = 4
    broken = dict(feeds, key_total_sequence_lengths=np.array([99, 6, 6], np.int32))
    with pytest.raises(Exception, match=r"Status Message: SparseAttention input 'key_total_sequence_lengths': entry 0 = 99"):
        session.run(None, broken, options)

    def fault(*arguments, **keywords):
        raise ValueError("an internal fault")

    with monkeypatch.context() as patch:
        patch.setattr(WebGPUExecutor, "run", fault)
        with pytest.raises(Exception, match=r"Status Message: ValueError: an internal fault"):
            session.run(None, feeds, options)
    session.run(None, feeds)  # the session keeps working


@pytest.mark.parametrize("chunk_bytes", [0, 1024])
@pytest.mark.parametrize("kv_check", MODES)
def test_uploads_through_the_staging_buffer(executor, rng, monkeypatch, kv_check, chunk_bytes):
    # Large uploads (a prefill, a long history) go through kept staging buffers filled with
    # parallel copies, and large transfers both ways move in chunks; force both on small
    # calls (whole, and in chunks of 1 KiB), over a restart and a reorder.
    from sparse_attention_op.webgpu import buffers, host_threads

    monkeypatch.setattr(buffers, "STAGING_BYTES", 0)
    monkeypatch.setattr(executor, "tuning", dataclasses.replace(executor.tuning, transfer_chunk_bytes=chunk_bytes))
    monkeypatch.setattr(host_threads, "PARALLEL_BYTES", 1024)
    generation = Generation(new_session(rng, kv_check), rng, "shared")
    for _ in range(3):
        generation.step()
    generation.past = [np.ascontiguousarray(p[[2, 0, 1]]) for p in generation.past]
    generation.lengths = generation.lengths[[2, 0, 1]]
    generation.next()
    assert generation.step().history_rows_uploaded > 0
    generation.step()


@pytest.mark.parametrize("kv_check", MODES)
def test_no_kernel_reads_the_padding_between_input_sections(executor, rng, monkeypatch, kv_check):
    # A call's small inputs are packed into a host array kept between calls, so the padding
    # between its sections holds whatever an earlier call left there. Lend one of all-ones
    # bytes instead (NaN as float32, 2**32 - 1 as an index or length): a kernel that read past
    # a section would spoil an output, or set a fast check's flag for a past that agrees.
    monkeypatch.setattr(executor, "_packing", lambda nbytes: np.full(nbytes, 0xFF, np.uint8))
    generation = Generation(new_session(rng, kv_check), rng, "shared")
    for _ in range(4):
        stats = generation.step()
        assert not stats.probes_differed, "the pasts agree with the cache: no probe may differ"


# -- the record's fast paths against its general ones (pure host code) -------------------------
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("head_size, itemsize", [(128, 4), (16, 2), (64, 4)])
def test_record_fast_paths_equal_the_general_ones(rng, head_size, itemsize, batch):
    """Whole-chunk digests, one-row appends (digested at once, or kept back and digested
    together later) and the probe list: the decode step's short cuts give what the general
    code gives (a wrong short cut would pass the fast check wrongly)."""
    from sparse_attention_op.webgpu.cache_record import LAST_ROWS, SPREAD_ROWS, CacheRecord

    heads = 2
    general = CacheRecord(batch, heads, head_size, itemsize, max_rows=8192)
    fast = CacheRecord(batch, heads, head_size, itemsize, max_rows=8192, max_pending_rows=0)
    # Rows kept back three steps at most, so it flushes on the way (at head size 16 the
    # table alone takes the 1%: nothing is kept back there).
    kept = CacheRecord(batch, heads, head_size, itemsize, max_rows=8192, max_pending_rows=3)
    c = general.chunk_rows
    rows = rng.standard_normal((batch, heads, 5 * c, head_size), dtype=np.float32)
    assert np.array_equal(general.digests.of_chunks(rows, 5), general.digests.of(rows))
    # A prompt of different lengths per row, then decode steps: one-row appends (fast)
    # against appends of the same rows one call at a time through the general path.
    lengths = [7, 2 * c, 1][:batch]
    # Keys and values differ throughout, so a mix-up of the table's halves would show.
    prompt_key, prompt_value = (rng.standard_normal((batch, heads, max(lengths), head_size), dtype=np.float32) for _ in range(2))
    for record in (general, fast, kept):
        record.append((0,) * batch, tuple(lengths), prompt_key, prompt_value)
    assert fast._pending_capacity == 0 and kept._pending_capacity == (0 if head_size == 16 else 3)
    for _ in range(2 * c + 4):
        new_key, new_value = (rng.standard_normal((batch, heads, 1, head_size), dtype=np.float32) for _ in range(2))
        past = tuple(int(v) for v in fast.valid)
        fast.append(past, tuple(p + 1 for p in past), new_key, new_value)
        kept.append(past, tuple(p + 1 for p in past), new_key, new_value)
        # A second, unused row sends the same append down the general path (one row of two).
        padded = [np.concatenate([new, np.full_like(new, np.nan)], axis=2) for new in (new_key, new_value)]
        general.append(past, tuple(p + 1 for p in past), *padded)
    assert kept._pending_rows == (0 if head_size == 16 else (2 * c + 4) % 3 or 3) and np.array_equal(kept.valid, general.valid)
    for name in ("key", "value"):
        assert np.array_equal(fast.chunk_digests(name), general.chunk_digests(name)), name
        assert np.array_equal(kept.chunk_digests(name), general.chunk_digests(name)), name
    # Probes: the last LAST_ROWS rows in every head and SPREAD_ROWS spread rows, one head
    # each, clipped to the history, as plain Python computes them.
    for past_lengths, total in (((0, 5, 300), 301), ((1,), 2), ((4097, 64), 4098)):
        probes = probe_rows(past_lengths, heads, total)
        phase = (total * (np.sqrt(5) - 1) / 2) % 1.0
        for b, past in enumerate(past_lengths):
            if past == 0:
                assert not probes[b].any()
                continue
            expected = [(h, max(past - LAST_ROWS + r, 0)) for h in range(heads) for r in range(LAST_ROWS)]
            expected += [((i + total) % heads, min(int((i + phase) * past / SPREAD_ROWS), past - 1)) for i in range(SPREAD_ROWS)]
            assert [tuple(p) for p in probes[b].tolist()] == expected, (past_lengths, b)


def test_large_float16_conversions_go_through_reused_buffers():
    """A float16 prompt's tensors are converted over the host's threads into a buffer kept per
    name and thread: the same values as numpy's, and no fresh array per call."""
    from sparse_attention_op.webgpu import host_threads

    rng = np.random.default_rng(7)
    query = rng.standard_normal((1, 600, 6144)).astype(np.float16)  # 7 MB: above the parallel threshold
    first = host_threads.as_float32(query, "query")
    np.testing.assert_array_equal(first, query.astype(np.float32))
    again = host_threads.as_float32(query[:, :400], "query")
    assert np.shares_memory(first, again), "the second conversion reuses the first one's buffer"
    np.testing.assert_array_equal(again, query[:, :400].astype(np.float32))
    small = rng.standard_normal((1, 1, 6144)).astype(np.float16)
    assert not np.shares_memory(host_threads.as_float32(small, "query"), first)
    output = np.empty((1, 600, 6144), np.float16)
    host_threads.copy_flat(output, first)
    np.testing.assert_array_equal(output, first.astype(np.float16))
