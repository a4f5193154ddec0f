"""A call's commands recorded through wgpu-native directly or through wgpu-py (recording.py)."""

import dataclasses

import numpy as np
import pytest
import wgpu

from sparse_attention_op.inputs import CaseConfig
from sparse_attention_op.webgpu import get_executor, recording
from sparse_attention_op.webgpu.mapping import mapped
from sparse_attention_op.webgpu.recording import NativeRecording, WgpuPyRecording
from test_executor import decode_chain

pytestmark = pytest.mark.gpu

_DOUBLE = """
@group(0) @binding(0) var<storage, read_write> data: array<u32>;
@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) id: vec3<u32>) {
  if (id.x < arrayLength(&data)) { data[id.x] = data[id.x] * 2u + 1u; }
}
"""


@dataclasses.dataclass
class _Launch:  # what the executor's Launch carries
    pipeline: object
    bind_group: object
    workgroups: tuple


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
    launch = _Launch(pipeline, group, (16, 1, 1))
    values = np.random.default_rng(0).integers(0, 1 << 20, 1024, dtype=np.uint32)
    for _ in range(2):  # the same objects recorded again
        np.testing.assert_array_equal(_run(make, device, launch, storage, readback, values), (values * 2 + 1) * 2 + 1)


def test_a_bad_command_raises_and_the_device_keeps_working():
    device = get_executor().context.device
    small = device.create_buffer(size=256, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
    commands = NativeRecording(device)
    try:
        with pytest.raises(wgpu.GPUError):
            commands.copy_buffer_to_buffer(small, 0, small, 128, 256)  # overlapping and out of range
            commands.submit()
    finally:
        commands.release()
    test_write_dispatch_copy_submit(NativeRecording)


def test_calls_give_the_same_results_through_wgpu_py(monkeypatch, executor, rng):
    monkeypatch.setattr(recording, "NATIVE", False)
    config = CaseConfig(batch=2, seq_len=5, prompt_lengths=(5, 3), max_cache_len=40, sparse_block_size=8)
    decode_chain(executor, config, rng, steps=4, node_key="wgpu-py recording")
