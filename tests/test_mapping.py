"""Buffer maps on the calling thread (webgpu/mapping.py) against wgpu-py's public maps."""

import numpy as np
import pytest
import wgpu

from sparse_attention_op.webgpu import get_executor
from sparse_attention_op.webgpu import mapping
from sparse_attention_op.webgpu.mapping import mapped

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("maps", ["native", "native, spinning", "public"])
def test_write_then_read_back_through_the_gpu(monkeypatch, maps):
    # Spinning: non-blocking polls first (GPUs' setting), for longer than the copies take.
    spin = 0.05 if maps == "native, spinning" else 0.0
    if maps == "public":
        monkeypatch.setattr(mapping, "NATIVE", False)
    device = get_executor().context.device
    upload = device.create_buffer(size=4096, usage=wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC)
    middle = device.create_buffer(size=4096, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
    readback = device.create_buffer(size=4096, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
    data = np.random.default_rng(0).integers(0, 256, 2048, dtype=np.uint8)
    for round_trip in range(3):  # the same buffers mapped again: every map was undone
        with mapped(device, upload, True, 0, 4096, spin) as memory:
            memory[1024:3072] = data + round_trip
        encoder = device.create_command_encoder()
        encoder.copy_buffer_to_buffer(upload, 1024, middle, 0, 2048)
        encoder.copy_buffer_to_buffer(middle, 0, readback, 2048, 2048)
        device.queue.submit([encoder.finish()])
        with mapped(device, readback, False, 2048, 2048, spin) as memory:
            got = memory.copy()
            assert not memory.flags.writeable
        np.testing.assert_array_equal(got, data + round_trip)


def test_only_gpu_adapters_spin_while_they_wait():
    from sparse_attention_op.webgpu.tuning import choose_tuning

    limits = {"max-storage-buffer-binding-size": 1 << 31, "max-compute-workgroup-storage-size": 49152}
    assert choose_tuning(limits, frozenset(), "DiscreteGPU").map_spin_seconds > 0
    assert choose_tuning(limits, frozenset({"subgroup"}), "CPU").map_spin_seconds == 0
    assert choose_tuning(limits, frozenset(), "CPU").map_spin_seconds == 0
