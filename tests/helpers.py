"""Comparisons against the float64 reference and ONNX Runtime's own CPU kernel."""

from __future__ import annotations

import threading

import numpy as np
import onnxruntime as ort

from sparse_attention_op.op.reference import sparse_attention_reference
from sparse_attention_op.op.spec import OpAttributes, build_call
from sparse_attention_op.ort.presents import scatter_presents
from sparse_attention_op.testing.decoder_models import DecoderConfig

#: A two-layer decoder (one SparseAttention layer, one GroupQueryAttention) small enough for
#: tests of whole models to run in milliseconds; tests vary it with dataclasses.replace.
SMALL_DECODER = DecoderConfig(
    vocab_size=96,
    hidden=64,
    layers=2,
    num_heads=4,
    kv_num_heads=2,
    head_size=16,
    local_blocks=2,
    vert_stride=2,
    max_position=128,
    dense_every=2,
    seed=7,
    intermediate=96,
)

TOLERANCE = 2e-3  # absolute and relative, float32 (the acceptance bound)


def assert_close(actual, expected, what, tol=TOLERANCE):
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: non-finite values"
    error = np.abs(actual - expected)
    bound = tol + tol * np.abs(expected)
    worst = np.unravel_index(np.argmax(error - bound), error.shape)
    assert np.all(error <= bound), f"{what}: max error {error.max():.3g} at {worst} (got {actual[worst]}, want {expected[worst]})"


def live_rows(call_inputs) -> list[int]:
    """Per batch row, how many cache rows are history after the call (the live part)."""
    return [int(v) for v in np.asarray(call_inputs["key_total_sequence_lengths"]).reshape(-1)]


def assert_matches_reference(outputs, inputs, attributes, what="", tol=TOLERANCE):
    """Output and the live part of each present match the float64 reference."""
    ref = sparse_attention_reference(**inputs, **attributes)
    assert_close(outputs[0], ref[0], f"{what} output", tol)
    seq_len = inputs["query"].shape[1]
    total = int(np.asarray(inputs["total_sequence_length"]).reshape(-1)[0])
    for index, name in ((1, "present_key"), (2, "present_value")):
        for b, live in enumerate(live_rows(inputs)):
            # In a prompt, padding rows land in the cache too: all S new rows are live data.
            rows = seq_len if total == seq_len else live
            assert_close(outputs[index][b, :, :rows], ref[index][b, :, :rows], f"{what} {name}[{b}]", tol)
    return ref


def run_executor(executor, inputs, attributes, node_key="test", float16_storage=False, **settings):
    """(output, present_key, present_value) of one executor call, presents built on the host
    as the bridge builds them; the call's stats as ``run_executor.last_stats``."""
    from sparse_attention_op.settings import SessionSettings

    call = build_call(inputs, OpAttributes.from_mapping(attributes), float16_storage=float16_storage)
    result = executor.run(call, node_key, SessionSettings(**settings))
    new_key = result.new_key if result.new_key is not None else call.new_rows("key")
    presents = scatter_presents(inputs["past_key"], inputs["past_value"], call.shape, new_key, call.new_rows("value"))
    run_executor.last_stats = result.stats
    return (result.output,) + presents


def run_ort_cpu(model, feeds):
    """ORT's own CPU kernel. It needs past and present bound to one buffer (IO binding)."""
    from sparse_attention_op import bind_shared

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    # ortvalue_from_numpy wraps the array's memory without owning it: keep the arrays alive.
    arrays = {name: np.array(feeds[name], copy=True) for name in ("past_key", "past_value")}
    past = {name: ort.OrtValue.ortvalue_from_numpy(array) for name, array in arrays.items()}
    binding = bind_shared(session, feeds, past)
    session.run_with_iobinding(binding)
    return binding.copy_outputs_to_cpu()[0], arrays["past_key"], arrays["past_value"]


def graph_feeds(session, inputs):
    return {i.name: inputs[i.name] for i in session.get_inputs()}


def run_in_threads(targets, timeout=300):
    """Start every target in a daemon thread (a hang cannot block the suite's exit) and join.

    Targets collect their own failures: pytest does not see exceptions raised in threads.
    """
    threads = [threading.Thread(target=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), f"a thread did not finish in {timeout} s"


def node_kernels() -> list:
    """(kernel, constant inputs) of every live session's bridge nodes (custom_op.kernels)."""
    from sparse_attention_op.ort import custom_op
    from sparse_attention_op.ort.bridge import OP_TYPES

    return [entry for op_type in OP_TYPES.values() for entry in custom_op.kernels(op_type)]


def drop_buffer(pool, name: str) -> None:
    """Free one named buffer of a BufferPool, as growing it for a larger need frees the old
    one: whatever holds on to the old buffer must see that it moved (the pool's generation)."""
    buffer = pool._buffers.pop(name)
    buffer.destroy()
    pool.generation += 1
