"""Randomized differential tests: sessions against the float64 reference over random shapes,
layouts, lengths and call sequences (hypothesis; reproducible, the failing example is printed).

A sequence is a padded prompt followed by operations a generation loop performs: decode
steps, chunks of several tokens, beam reorders, restarts, and (with the exact check, or in
rows the fast check probes) edits of the cache. Both cache checks, both ways of running
(numpy feeds, or past and present bound to one buffer). Bounded to about a minute on
lavapipe by the example count.
"""

import numpy as np
import onnxruntime as ort
import pytest
from helpers import assert_matches_reference
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import sparse_attention_op as sao
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs

pytestmark = pytest.mark.gpu

LAYOUT = ("block_row_indices", "block_col_indices", "cos_cache", "sin_cache")


@st.composite
def configs(draw):
    kv_num_heads = draw(st.sampled_from([1, 2]))
    num_heads = kv_num_heads * draw(st.sampled_from([1, 2, 3]))
    num_layout = draw(st.sampled_from([d for d in (1, 2, 3, 6) if num_heads % d == 0]))
    head_size = draw(st.sampled_from([16, 32, 64]))
    # partial rotary: rotary_dim / 2 must stay a multiple of 8
    rotary = draw(st.sampled_from(["none", "half", "interleaved"] + (["partial"] if head_size >= 32 else [])))
    block = draw(st.sampled_from([8, 16]))
    return CaseConfig(
        batch=draw(st.integers(1, 3)),
        num_heads=num_heads,
        kv_num_heads=kv_num_heads,
        head_size=head_size,
        max_cache_len=draw(st.sampled_from([32, 48, 64])),
        sparse_block_size=block,
        num_layout=num_layout,
        local_blocks=draw(st.integers(1, 3)),
        vert_stride=draw(st.integers(1, 4)),
        packed=draw(st.booleans()),
        do_rotary=rotary != "none",
        rotary_interleaved=rotary == "interleaved",
        rotary_dim=head_size // 2 if rotary == "partial" else None,
        scale=draw(st.sampled_from([0.0, 0.3])),
    )


OPERATIONS = st.lists(st.sampled_from(["decode", "decode", "chunk", "reorder", "restart", "edit"]), min_size=2, max_size=6)


def run(session, way, feeds, past):
    if way == "plain":
        output, present_key, present_value = session.run(None, feeds)
        return output, [present_key, present_value]
    values = {name: ort.OrtValue.ortvalue_from_numpy(p) for name, p in zip(("past_key", "past_value"), past)}
    binding = sao.bind_shared(session, feeds, values)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0], past


@settings(max_examples=200, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(config=configs(), kv_check=st.sampled_from(["exact", "fast"]), way=st.sampled_from(["plain", "shared"]), operations=OPERATIONS, data=st.data())
def test_sequences_match_the_reference(executor, config, kv_check, way, operations, data):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16), label="seed"))
    capacity, b = config.max_cache_len, config.batch
    session = sao.create_session(sparse_attention_model(config.node_attributes(), random_inputs(config, rng), constants=LAYOUT), kv_check=kv_check)
    names = [i.name for i in session.get_inputs()]
    shape = (b, config.kv_num_heads, capacity, config.head_size)
    past = [rng.standard_normal(shape, dtype=np.float32) for _ in range(2)]

    def prompt():
        length = data.draw(st.integers(1, capacity // 2), label="prompt length")
        lengths = tuple(data.draw(st.integers(1, length), label="row length") for _ in range(b - 1)) + (length,)
        return CaseConfig(**{**config.__dict__, "seq_len": length, "prompt_lengths": lengths}), np.array(lengths)

    step, lengths = prompt()
    for operation in ["prompt"] + operations:
        if operation == "restart":
            step, lengths = prompt()
        elif operation in ("decode", "chunk"):
            tokens = 1 if operation == "decode" else data.draw(st.integers(2, 4), label="chunk")
            if lengths.max() + tokens > capacity:
                continue
            step = CaseConfig(**{**config.__dict__, "seq_len": tokens, "past_lengths": tuple(int(v) for v in lengths), "prompt_lengths": None})
        elif operation == "reorder":
            order = data.draw(st.lists(st.integers(0, b - 1), min_size=b, max_size=b), label="beam order")
            past = [np.ascontiguousarray(p[order]) for p in past]
            lengths = lengths[order]
            continue
        elif operation == "edit":
            row = data.draw(st.integers(0, b - 1), label="edited batch row")
            # The exact check sees any edit; the fast check is only promised the last rows.
            first = 0 if kv_check == "exact" else max(0, int(lengths[row]) - 4)
            position = data.draw(st.integers(first, int(lengths[row]) - 1), label="edited cache row")
            past[data.draw(st.integers(0, 1), label="key or value")][row, :, position] += np.float32(0.5)
            continue
        inputs = random_inputs(step, rng, past=past)
        feeds = {name: inputs[name] for name in names}
        # In shared mode the run writes the new rows into the past in place; the reference
        # reads only rows [0, past) of it and writes the same rows itself, so either works.
        output, presents = run(session, way, feeds, [inputs["past_key"], inputs["past_value"]])
        assert_matches_reference([output] + presents, inputs, step.node_attributes(), f"{operation} {step}")
        past = presents
        lengths = np.asarray(step.prompt_lengths) if step.past_lengths is None else lengths + step.seq_len
