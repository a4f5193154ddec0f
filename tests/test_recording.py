"""A call's commands recorded through wgpu-native directly or through wgpu-py (recording.py)."""

import numpy as np
import pytest
import wgpu
from test_executor import decode_chain

from sparse_attention_op.testing.inputs import CaseConfig
from sparse_attention_op.webgpu import get_executor, recording
from sparse_attention_op.webgpu.executor import Launch
from sparse_attention_op.webgpu.mapping import mapped
from sparse_attention_op.webgpu.recording import NativeRecording, WgpuPyRecording

pytestmark = pytest.mark.gpu

_DOUBLE = """
@group(0) @binding(0) var<storage, read_write> data: array<u32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) id: vec3<u32>) {
  if (id.x < arrayLength(&data)) { data[id.x] = data[id.x] * 2u + 1u; }
}
"""


def _run(make, device, launch, storage, readback, values):
    commands = make(device)
    try:
        commands.write_buffer(storage, 0, values.view(np.uint8))
        commands.compute_pass([launch, launch])  # two dispatches in one pass, in order
        commands.copy_buffer_to_buffer(storage, 0, readback, 0, values.nbytes)
        commands.submit()
    finally:
        commands.release()
    with mapped(device, readback, False, 0, values.nbytes) as memory:
        return memory.view(np.uint32).copy()


@pytest.mark.parametrize("make", [NativeRecording, WgpuPyRecording], ids=["native", "wgpu-py"])
def test_write_dispatch_copy_submit(make):
    device = get_executor().context.device
    pipeline = device.create_compute_pipeline(layout="auto", compute={"module": device.create_shader_module(code=_DOUBLE), "entry_point": "main"})
    storage = device.create_buffer(size=4096, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC)
    readback = device.create_buffer(size=4096, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
    group = device.create_bind_group(layout=pipeline.get_bind_group_layout(0), entries=[{"binding": 0, "resource": {"buffer": storage}}])
    launch = Launch("double", pipeline, group, (16, 1, 1))
    values = np.random.default_rng(0).integers(0, 1 << 20, 1024, dtype=np.uint32)
    for _ in range(2):  # the same objects recorded again
        np.testing.assert_array_equal(_run(make, device, launch, storage, readback, values), (values * 2 + 1) * 2 + 1)


@pytest.mark.parametrize("bad", ["copy", "write"])
def test_a_bad_command_raises_and_the_device_keeps_working(bad):
    """NativeRecording captures wgpu-native's errors for the whole recording: a bad copy is
    reported when the encoder finishes, a bad queue write at once; either raises at the
    submit, which then submits nothing (wgpu-native aborts on an invalid command buffer)."""
    device = get_executor().context.device
    small = device.create_buffer(size=256, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
    commands = NativeRecording(device)
    try:
        with pytest.raises(wgpu.GPUError):
            if bad == "copy":
                commands.copy_buffer_to_buffer(small, 0, small, 128, 256)  # overlapping and out of range
            else:
                commands.write_buffer(small, 128, np.zeros(256, np.uint8))  # past the buffer's end
            commands.submit()
    finally:
        commands.release()
    test_write_dispatch_copy_submit(NativeRecording)


def test_calls_give_the_same_results_through_wgpu_py(monkeypatch, executor, rng):
    monkeypatch.setattr(recording, "NATIVE", False)
    config = CaseConfig(batch=2, seq_len=5, prompt_lengths=(5, 3), max_cache_len=40, sparse_block_size=8)
    decode_chain(executor, config, rng, steps=4, node_key="wgpu-py recording")


def test_profiled_calls_time_every_dispatch_and_keep_their_results(executor, rng):
    """profile=True records through wgpu-py with one timed pass per dispatch."""
    from helpers import assert_matches_reference, run_executor

    from sparse_attention_op.testing.inputs import random_inputs

    if "timestamp-query" not in executor.context.features:
        pytest.skip("the adapter has no timestamp queries")
    for config in (
        CaseConfig(seq_len=40, max_cache_len=64, sparse_block_size=8),  # a prompt: several passes
        CaseConfig(seq_len=1, past_lengths=(40,), max_cache_len=64, sparse_block_size=8),
    ):  # decode
        inputs = random_inputs(config, rng)
        outputs = run_executor(executor, inputs, config.node_attributes(), "profiled", profile="dispatches")
        assert_matches_reference(outputs, inputs, config.node_attributes(), what=str(config))
        launches = executor.node_state("profiled").step_plan.launches
        stats = run_executor.last_stats
        assert list(stats.gpu_seconds) == [launch.label for launch in launches]
        assert all(seconds > 0 for seconds in stats.gpu_seconds.values())
        # The whole call timed as the one pass it records: one time, the same results.
        outputs = run_executor(executor, inputs, config.node_attributes(), "profiled", profile="pass")
        assert_matches_reference(outputs, inputs, config.node_attributes(), what=f"{config}, one timed pass")
        assert list(run_executor.last_stats.gpu_seconds) == ["pass"] and run_executor.last_stats.gpu_seconds["pass"] > 0


def test_an_abandoned_recording_reports_its_own_fault_and_frees_its_temporaries(executor, monkeypatch):
    """An error capture ended without raising (another exception is on its way) logs what it
    caught and leaves wgpu-py's capture stack as it found it; the executor frees a failed
    recording's temporaries and reports the fault that ended it."""
    from sparse_attention_op.webgpu import native

    device = executor.context.device
    small = device.create_buffer(size=256, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
    depth = len(native.error_handler._get_proxy_stack())
    errors = native.ErrorCapture("test")
    data = np.zeros(256, np.uint8)
    native.lib.wgpuQueueWriteBuffer(device.queue._internal, small._internal, 128, native.ffi.from_buffer(data), data.nbytes)
    assert errors.reported()
    errors.discard()  # no raise
    assert len(native.error_handler._get_proxy_stack()) == depth
    freed = []
    monkeypatch.setattr(executor._scratch, "release_temporaries", lambda: freed.append(True))
    monkeypatch.setattr(recording.NativeRecording, "compute_pass", lambda self, launches: (_ for _ in ()).throw(KeyError("host fault")))
    config = CaseConfig(
        batch=1, seq_len=1, num_heads=2, kv_num_heads=1, head_size=16, max_cache_len=32, sparse_block_size=8, num_layout=1, past_lengths=(4,)
    )
    from sparse_attention_op.op.spec import OpAttributes, build_call
    from sparse_attention_op.testing.inputs import random_inputs

    call = build_call(random_inputs(config, np.random.default_rng(0)), OpAttributes.from_mapping(config.node_attributes()))
    with pytest.raises(KeyError):
        executor.run(call, "abandoned-recording")
    assert freed
    monkeypatch.undo()
    test_write_dispatch_copy_submit(NativeRecording)
