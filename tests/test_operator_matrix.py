"""The whole operator through sessions: packed/unpacked x rotary variants x dtypes, with GQA
ratios and layout counts cycled across the cases, each over a prompt and a decode chain."""

import itertools

import numpy as np
import pytest
from helpers import assert_matches_reference

import sparse_attention_op as sao
from sparse_attention_op.testing.graphs import sparse_attention_model
from sparse_attention_op.testing.inputs import CaseConfig, random_inputs

ROTARY = {
    "none": dict(do_rotary=False),
    "half": dict(do_rotary=True),
    "interleaved": dict(do_rotary=True, rotary_interleaved=True),
    "partial-half": dict(do_rotary=True, rotary_dim=32),
    "partial-interleaved": dict(do_rotary=True, rotary_interleaved=True, rotary_dim=16),
}
HEADS = [(4, 4, 1), (8, 2, 2), (8, 2, 4), (8, 1, 8), (6, 3, 3)]  # (num_heads, kv_num_heads, num_layout)
CASES = list(itertools.product([False, True], sorted(ROTARY), ["float32", "float16"]))
TOLERANCE = {"float32": 2e-3, "float16": 1e-2}


def as_dtype(inputs, dtype):
    """Float inputs in the model's dtype; the reference sees exactly those values."""
    return {k: (v.astype(dtype) if v.dtype == np.float32 else v) for k, v in inputs.items()}


def as_float64(inputs):
    return {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in inputs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("packed,rotary,dtype", CASES, ids=[f"{'packed' if p else 'separate'}-{r}-{d}" for p, r, d in CASES])
def test_prompt_then_decode_chain(executor, packed, rotary, dtype):
    index = CASES.index((packed, rotary, dtype))
    num_heads, kv_num_heads, num_layout = HEADS[index % len(HEADS)]
    rng = np.random.default_rng(index)
    config = CaseConfig(
        batch=2,
        seq_len=9,
        prompt_lengths=(9, 6),
        num_heads=num_heads,
        kv_num_heads=kv_num_heads,
        num_layout=num_layout,
        head_size=64,
        max_cache_len=32,
        sparse_block_size=8,
        packed=packed,
        **ROTARY[rotary],
    )
    np_dtype = np.dtype(dtype)
    inputs = as_dtype(random_inputs(config, rng), np_dtype)
    model = sparse_attention_model(config.node_attributes(), inputs, float_dtype=np_dtype, constants=("block_row_indices", "block_col_indices"))
    session = sao.create_session(model)
    names = [i.name for i in session.get_inputs()]
    attributes = config.node_attributes()
    lengths = np.array(config.prompt_lengths)
    for step in range(4):
        outputs = session.run(None, {name: inputs[name] for name in names})
        assert all(o.dtype == np_dtype for o in outputs)
        assert_matches_reference([o.astype(np.float64) for o in outputs], as_float64(inputs), attributes, f"step {step}", TOLERANCE[dtype])
        if step:
            lengths = lengths + 1
        # Next: one token per row after everything the row holds, the presents fed back.
        step_config = CaseConfig(**{**config.__dict__, "seq_len": 1, "past_lengths": tuple(int(v) for v in lengths), "prompt_lengths": None})
        inputs = as_dtype(random_inputs(step_config, rng, past=(outputs[1].astype(np.float32), outputs[2].astype(np.float32))), np_dtype)
