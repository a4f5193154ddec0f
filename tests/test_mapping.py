"""Buffer maps on the calling thread (webgpu/mapping.py) against wgpu-py's public maps."""

import numpy as np
import pytest
import wgpu

from sparse_attention_op.webgpu import get_executor, mapping
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


def test_prompts_move_whole_and_chunks_fit_a_binding(monkeypatch):
    from sparse_attention_op.webgpu.tuning import choose_tuning

    monkeypatch.delenv("SAO_TRANSFER_CHUNK_BYTES", raising=False)
    limits = {"max-storage-buffer-binding-size": 1 << 31, "max-compute-workgroup-storage-size": 49152}
    assert choose_tuning(limits, frozenset(), "DiscreteGPU").transfer_chunk_bytes == 256 << 20
    small = {**limits, "max-storage-buffer-binding-size": 128 << 20}
    assert choose_tuning(small, frozenset(), "CPU").transfer_chunk_bytes == 128 << 20, "a chunk's buffers must fit a binding"
    monkeypatch.setenv("SAO_TRANSFER_CHUNK_BYTES", "0")
    assert choose_tuning(limits, frozenset(), "DiscreteGPU").transfer_chunk_bytes == 0


# -- transfers in chunks (webgpu/buffers.py) ------------------------------------------------
@pytest.mark.parametrize("chunk_bytes", [0, 256, 1000, 4096, 1 << 20])
def test_layout_chunks_place_every_byte_once_in_order(chunk_bytes):
    # Pure host code: each item's pieces cover it in order, cut only at aligned offsets;
    # each chunk's pieces sit back to back at aligned offsets within the chunk's room.
    from sparse_attention_op.webgpu.buffers import ALIGNMENT, aligned, layout_chunks, used_bytes

    sizes = [1, 3, 0, 255, 256, 257, 4000, 12, 70000, 1024]
    chunks = layout_chunks(sizes, chunk_bytes)
    room = max(ALIGNMENT, aligned(chunk_bytes)) if chunk_bytes else None
    if room is None or room >= sum(aligned(s) for s in sizes):
        assert len(chunks) == 1
    pieces = [piece for chunk in chunks for piece in chunk]
    assert [p.item for p in pieces] == sorted(p.item for p in pieces), "items in order"
    for item, size in enumerate(sizes):
        mine = [p for p in pieces if p.item == item]
        assert mine[0].start == 0 and mine[-1].end == size
        assert all(a.end == b.start for a, b in zip(mine, mine[1:])), f"item {item} covered without gaps or overlaps"
        assert all(p.start % ALIGNMENT == 0 for p in mine)
    for chunk in chunks:
        assert chunk[0].offset == 0
        assert all(b.offset == a.offset + aligned(a.nbytes) for a, b in zip(chunk, chunk[1:]))
        if room is not None:
            assert used_bytes(chunk) <= room


@pytest.mark.parametrize("chunk_bytes", [0, 1000, 4096])
def test_an_upload_and_a_read_back_in_chunks_move_every_byte(monkeypatch, chunk_bytes):
    # Through the GPU: items cut across chunks, two staging and two read-back buffers taking
    # turns (about 16 chunks of 1024 bytes), twice, so that the second round reuses them.
    from sparse_attention_op.webgpu import buffers, recording
    from sparse_attention_op.webgpu.buffers import BufferPool, Download, Upload, aligned
    from sparse_attention_op.webgpu.programs import BufferRange

    monkeypatch.setattr(buffers, "STAGING_BYTES", 0)  # every upload through the staging buffers
    context = get_executor().context
    device, pool = context.device, BufferPool(context.device, context.max_binding_bytes)
    rng = np.random.default_rng(1)
    for round_trip in range(2):
        arrays = [rng.standard_normal(n).astype(np.float32) for n in (1, 700, 64, 0, 3001, 257)]
        upload = Upload()
        offsets = [upload.section(array) for array in arrays]
        middle = device.create_buffer(
            size=upload.section_bytes, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
        )
        commands = recording.begin(device, False)
        upload.encode(device, commands, pool, middle, chunk_bytes=chunk_bytes)
        results = [np.full_like(array, np.nan) for array in arrays]
        download = Download(pool, device, chunk_bytes=chunk_bytes)
        for result, offset in zip(results, offsets):
            download.add(result, BufferRange(middle, offset, aligned(result.nbytes)))
        download.encode(commands)
        commands.submit()
        download.read()
        for array, result in zip(arrays, results):
            np.testing.assert_array_equal(result, array)
    pool.release()
