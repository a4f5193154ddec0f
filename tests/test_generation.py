"""sparse_attention_op.generate on the bundled decoders: tokens, padding, stops, sampling, errors.

Oracles: ONNX Runtime's own CPU kernels in a plain session (row by row where rows differ in
length: ORT's SparseAttention kernel gets ragged batches wrong, docs/design.md section 1),
and the float64 decoder reference for the prompt's logits.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import sparse_attention_op as sao
from sparse_attention_op.generation.loop import GenerationError, Sampling, _DecoderIO, _Loop, divergences, generate, prompt_logits
from sparse_attention_op.testing.decoder_models import decoder_reference
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs

pytestmark = pytest.mark.gpu

MODELS = Path(__file__).resolve().parent.parent / "models"
BUNDLED = ["phi3-small-tiny", "phi3-small-tiny-f16"]
NEW_TOKENS = 24
VOCAB = 512


@pytest.fixture(scope="module", params=BUNDLED)
def bundled(request):
    """(model path, a fast-check session of it, ORT's own kernels on it)."""
    path = MODELS / request.param / "model.onnx"
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return path, sao.create_session(str(path), kv_check="fast"), plain


def prompts_of(rng, lengths) -> list[list[int]]:
    return [rng.integers(2, VOCAB, n).tolist() for n in lengths]


def assert_same_greedy(path: Path, plain, prompts, ours, theirs, what: str) -> None:
    """float32: identical tokens. float16: identical until a near-tie, if any (ORT's float16
    kernel rounds differently from this op, and float16 logits tie often; docs/genai.md)."""
    if "f16" not in path.parent.name:
        assert ours == theirs, what
        return
    real = [d for d in divergences(plain, prompts, ours, theirs) if not d.near_tie]
    assert not real, f"{what}: " + "; ".join(d.describe() for d in real)


def test_ragged_batch_matches_ort_row_by_row(bundled, rng):
    path, session, plain = bundled
    prompts = prompts_of(rng, (37, 21, 5))  # past two 16-token blocks: the layout is sparse
    ours = generate(session, prompts, NEW_TOKENS)
    assert ours.prompt_lengths == [37, 21, 5] and ours.finish_reasons == ["length"] * 3
    for b, prompt in enumerate(prompts):
        theirs = generate(plain, [prompt], NEW_TOKENS).tokens
        assert_same_greedy(path, plain, [prompt], [ours.tokens[b]], theirs, f"{path.parent.name} row {b}: in a batch against ORT alone")
    assert len(ours.step_seconds) == NEW_TOKENS - 1 and ours.ms_per_token > 0 and ours.tokens_per_second > 0


def test_equal_rows_match_ort_batched_and_exact_check(bundled, rng):
    path, _, plain = bundled
    prompts = prompts_of(rng, (30, 30))
    theirs = generate(plain, prompts, NEW_TOKENS).tokens
    ours = generate(str(path), prompts, NEW_TOKENS, kv_check="exact").tokens
    assert_same_greedy(path, plain, prompts, ours, theirs, f"{path.parent.name}: exact check against ORT")


def test_prompt_logits_match_the_float64_reference(bundled, rng):
    path, session, _ = bundled
    lengths = [40, 19]
    logits, ids, got_lengths = prompt_logits(session, prompts_of(rng, lengths))
    assert [int(n) for n in got_lengths] == lengths and ids.shape == (2, 40)
    expected = decoder_reference(onnx.load(str(path)), ids, lengths)
    tolerance = 5e-2 if _DecoderIO.of(session).cache_dtype == np.float16 else 2e-3
    scale = max(1.0, float(np.abs(expected).max()))
    for b, n in enumerate(lengths):
        error = float(np.abs(logits[b, :n].astype(np.float64) - expected[b, :n]).max())
        assert error <= tolerance * scale, f"row {b}: max error {error:.3g} against the float64 reference (scale {scale:.1f})"


def test_left_and_right_padded_arrays_equal_ragged_lists(bundled, rng):
    _, session, _ = bundled
    prompts = prompts_of(rng, (12, 7))
    expected = generate(session, prompts, 8).tokens
    width = 12
    right = np.zeros((2, width), np.int64)
    left = np.zeros((2, width), np.int64)
    right_mask, left_mask = np.zeros_like(right), np.zeros_like(left)
    for b, row in enumerate(prompts):
        right[b, : len(row)], right_mask[b, : len(row)] = row, 1
        left[b, width - len(row) :], left_mask[b, width - len(row) :] = row, 1
    assert generate(session, right, 8, attention_mask=right_mask).tokens == expected
    assert generate(session, left, 8, attention_mask=left_mask).tokens == expected


def test_stop_tokens_end_a_row_and_the_others_go_on(bundled, rng):
    _, session, _ = bundled
    prompts = prompts_of(rng, (10, 14))
    free = generate(session, prompts, 12).tokens
    stop = free[0][3]
    # Row 0 stops at its 4th token (or earlier, where that id came up before).
    cut = free[0].index(stop) + 1
    stopped = generate(session, prompts, 12, stop_tokens=[stop])
    assert stopped.tokens[0] == free[0][:cut] and stopped.finish_reasons[0] == "stop"
    if stop in free[1]:
        assert stopped.tokens[1] == free[1][: free[1].index(stop) + 1]
    else:
        assert stopped.tokens[1] == free[1] and stopped.finish_reasons[1] == "length"


def test_sampling_is_seeded_and_top_k_1_is_greedy(bundled, rng):
    _, session, _ = bundled
    prompts = prompts_of(rng, (9,))
    greedy = generate(session, prompts, 10).tokens
    assert generate(session, prompts, 10, sampling=Sampling(do_sample=True, top_k=1, seed=3)).tokens == greedy
    hot = Sampling(do_sample=True, temperature=3.0, top_p=0.95, seed=11)
    first, second = generate(session, prompts, 10, sampling=hot).tokens, generate(session, prompts, 10, sampling=hot).tokens
    assert first == second, "the same seed draws the same tokens"
    assert all(0 <= t < VOCAB for t in first[0])
    # At temperature 3 over 512 tokens, ten draws that all hit the argmax would be a bug.
    assert first != greedy


def test_on_step_sees_every_token(bundled, rng):
    _, session, _ = bundled
    seen = []
    result = generate(session, prompts_of(rng, (6, 6)), 5, on_step=lambda step, tokens: seen.append((step, tokens)))
    assert [step for step, _ in seen] == list(range(5))
    assert [[tokens[b] for _, tokens in seen] for b in range(2)] == result.tokens


def test_kv_buffers_are_written_in_place(rng):
    """past and present share one buffer: the present ORT returns is the array generate allocated."""
    path = MODELS / "phi3-small-tiny" / "model.onnx"
    session = sao.create_session(str(path), kv_check="fast")
    io = _DecoderIO.of(session)
    loop = _Loop(session, io, batch=1, capacity=64)
    ids = np.array([prompts_of(rng, (20,))[0]], np.int64)
    loop.step(ids, np.array([20]))
    key0 = loop._arrays[0, "key"]
    assert np.abs(key0[0, :, :20]).max() > 0.1, "the prompt's keys are in the buffer generate owns"
    assert not key0[0, :, 20:].any(), "rows beyond the history are untouched"
    before = key0.copy()
    loop.step(np.array([[7]], np.int64), np.array([21]))
    assert np.array_equal(key0[0, :, :20], before[0, :, :20]) and np.abs(key0[0, :, 20]).max() > 0.1
    assert not key0[0, :, 21:].any()


def test_argument_errors_name_the_argument(rng):
    path = MODELS / "phi3-small-tiny" / "model.onnx"
    session = sao.create_session(str(path), kv_check="fast")
    cases = [
        (dict(prompts=[[1, 2]], max_new_tokens=0), "max_new_tokens must be an int >= 1"),
        (dict(prompts=[], max_new_tokens=2), "prompts must be a non-empty list"),
        (dict(prompts=[1, 2, 3], max_new_tokens=2), "wrap a single prompt as [[...]]"),
        (dict(prompts=[[1, 2], []], max_new_tokens=2), "prompt row 1 must be a non-empty list"),
        (dict(prompts=[[1, 2, VOCAB]], max_new_tokens=2), f"prompt row 0: token id(s) [{VOCAB}] outside the vocabulary [0, {VOCAB})"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, stop_tokens=[VOCAB + 3]), "stop_tokens"),
        (dict(prompts=[[1, 2, 3]], max_new_tokens=4, capacity=6), "holds the longest prompt plus max_new_tokens = 7 rows, got 6"),
        (dict(prompts=np.array([[1, 2, 3]]), max_new_tokens=2, attention_mask=np.array([[1, 0, 1]])), "padding between tokens"),
        (dict(prompts=np.array([[1, 2, 3]]), max_new_tokens=2, attention_mask=np.array([[1, 1]])), "attention_mask must have the prompts' shape"),
        (dict(prompts=np.array([[1, 2, 3]]), max_new_tokens=2, attention_mask=np.array([[1, 2, 1]])), "must hold only 0 (padding) and 1"),
        (dict(prompts=[[1, 2, 3], [4]], max_new_tokens=2, attention_mask=np.ones((2, 3))), "one padded 2-D array"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, sampling=Sampling(do_sample=True, temperature=0)), "temperature must be > 0"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, sampling=Sampling(do_sample=True, top_p=1.5)), "top_p must lie in (0, 1]"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, sampling=Sampling(do_sample=True, temperature="1")), "temperature must be a number"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, sampling=Sampling(do_sample=True, seed=-1)), "seed must be None or an int >= 0"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, sampling=None), "sampling must be a Sampling, got NoneType"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, pad_token_id="0"), "pad_token_id must be an int >= 0"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, on_step=5), "on_step must be callable"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, cache_dims=(3,)), "cache_dims must be (kv_heads, head_size)"),
        (dict(prompts=[[1, 2]], max_new_tokens=2, kv_check="quick"), "kv_check must be one of ('exact', 'fast'), got 'quick'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(GenerationError) as raised:
            generate(session, **kwargs)
        assert message in str(raised.value), (kwargs, str(raised.value))
    # Given the model (not a session), its context bounds the generation before any work.
    with pytest.raises(GenerationError, match="more than the model's context of 512 tokens"):
        generate(path, [[1, 2, 3]], 600)
    # A buffer larger than the context is fine: only the positions reached must lie in it.
    assert len(generate(path, [[1, 2, 3]], 2, capacity=600).tokens[0]) == 2
    # numpy integers are integers; greedy decoding ignores the sampling fields.
    greedy = generate(session, [[3, 4, 5]], np.int64(3), capacity=np.int64(8), sampling=Sampling(temperature=0.0, seed=-1)).tokens
    # The session still generates afterwards, the same tokens.
    assert generate(session, [[3, 4, 5]], 3).tokens == greedy and len(greedy[0]) == 3


def test_a_model_outside_the_convention_is_refused(rng):
    config = CaseConfig(seq_len=4, max_cache_len=32)
    model = sparse_attention_model(config.node_attributes(), random_inputs(config, rng))
    with pytest.raises(GenerationError, match="has no input 'input_ids'"):
        generate(model, [[1, 2]], 2)


def test_divergences_judge_every_row_and_tell_a_near_tie_from_a_real_difference(rng):
    path = MODELS / "phi3-small-tiny" / "model.onnx"
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    prompts = prompts_of(rng, (11, 7))
    # Row by row: ORT's kernel reads uninitialised memory for the shorter row of a ragged batch.
    theirs = [generate(plain, [prompt], 6).tokens[0] for prompt in prompts]
    assert divergences(plain, prompts, theirs, theirs) == []
    # Row 1 takes a token the model scores far below its choice: a real difference, found
    # where it is, even though row 0 differs too (only at its end: it stopped early).
    context = _Loop(plain, _DecoderIO.of(plain), 1, 7 + 2)
    logits = context.step(np.array([prompts[1] + theirs[1][:2]], np.int64), np.array([9]))[0, -1]
    worst = int(np.argmin(logits))
    ours = [theirs[0][:4], theirs[1][:2] + [worst] + theirs[1][3:]]
    stopped, changed = divergences(plain, prompts, ours, theirs)
    assert (stopped.row, stopped.step, stopped.ours) == (0, 4, None) and not stopped.near_tie
    assert (changed.row, changed.step, changed.ours, changed.theirs) == (1, 2, worst, theirs[1][2])
    assert not changed.near_tie and changed.gap > 1 and "a real difference" in changed.describe()


def test_symbolic_cache_dims_int32_ids_and_position_ids(rng, tmp_path, capsys):
    """A decoder exported differently: int32 ids and mask, caches whose kv heads and head size
    are symbolic, a position_ids input. generate reads the dims from the graph's attention nodes."""
    from onnx import TensorProto, helper

    from sparse_attention_op.cli import parser as cli

    path = MODELS / "phi3-small-tiny" / "model.onnx"
    model = onnx.load(str(path))
    for value in list(model.graph.input) + list(model.graph.output):
        tensor = value.type.tensor_type
        if value.name in ("input_ids", "attention_mask"):
            tensor.elem_type = TensorProto.INT32  # Gather and ReduceSum take int32 as they are
        elif value.name.startswith(("past_key_values.", "present.")):
            tensor.shape.dim[1].dim_param, tensor.shape.dim[3].dim_param = "kv_heads", "head_size"
    model.graph.input.append(helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"]))
    exported = tmp_path / "exported.onnx"
    onnx.save(model, str(exported))
    prompts = prompts_of(rng, (13, 6))
    expected = generate(str(path), prompts, 10).tokens
    assert generate(str(exported), prompts, 10).tokens == expected
    plain = ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"])
    with pytest.raises(GenerationError, match="fixed kv_heads and head_size"):
        generate(plain, prompts, 10)
    assert generate(plain, prompts[:1], 10, cache_dims=(2, 16)).tokens == expected[:1]
    code = cli.main(
        ["generate", str(exported), "--prompt-ids", ",".join(map(str, prompts[0])), "--max-new-tokens", "10", "--compare-ort", "--no-progress"]
    )
    out = capsys.readouterr().out
    assert code == 0 and "identical tokens" in out, out


@pytest.mark.parametrize("name", ["phi3-small-tiny", "phi3-small-tiny-f16"])
def test_last_logits_are_the_rows_generate_reads(rng, name):
    """create_session(last_logits=True): the logits head sees each row's last token only,
    and gives that row's logits as the whole head does (a ragged batch: rows end apart)."""
    path = MODELS / name / "model.onnx"
    whole = sao.create_session(str(path), kv_check="fast")
    trimmed = sao.create_session(str(path), kv_check="fast", last_logits=True)
    assert "sao_logits_positions" in {i.name for i in trimmed.get_inputs()}
    prompts = prompts_of(rng, (37, 20))
    full, _, lengths = prompt_logits(whole, prompts)
    io = _DecoderIO.of(trimmed)
    assert io.last_logits
    ids = np.array([p + [0] * (37 - len(p)) for p in prompts], np.int64)
    last = _Loop(trimmed, io, 2, 64).last(ids, lengths)
    expected = full[np.arange(2), lengths - 1]
    np.testing.assert_allclose(last, expected, rtol=1e-3, atol=1e-2 if name.endswith("f16") else 1e-4)
    step = _Loop(trimmed, io, 2, 64)
    step.step(ids, lengths)
    assert step.step(np.array([[5], [6]], np.int64), lengths + 1).shape[:2] == (2, 1), "a decode step computes one row per sequence"
    assert generate(trimmed, prompts, 12).tokens == generate(whole, prompts, 12).tokens
    with pytest.raises(GenerationError, match="one position per row"):
        prompt_logits(trimmed, prompts)


def test_last_logits_needs_a_logits_head(rng):
    config = CaseConfig(seq_len=4, max_cache_len=32)
    model = sparse_attention_model(config.node_attributes(), random_inputs(config, rng))
    with pytest.raises(ValueError, match="last_logits: the model has no output 'logits'"):
        sao.create_session(model, last_logits=True)
