"""GPU buffers that live across calls, and the owned staging buffers of every transfer.

A node's buffers are reused from call to call and only grow (by half again, so a slowly
growing cache does not reallocate every step). Host<->GPU traffic goes through buffers we
own and map ourselves: measured in DESIGN.md section 3, a mapped staging buffer plus a copy
is 2-3x faster than the queue's own write_buffer and read_buffer helpers, which allocate
a staging buffer and submit on every call.
"""

from __future__ import annotations

import numpy as np
import wgpu

#: Offsets inside a staging buffer: copy_buffer_to_buffer needs multiples of 4 and mapping
#: offsets multiples of 8; 256 also keeps every section on its own cache lines.
ALIGNMENT = 256
_MIN_BYTES = 16  # WebGPU refuses zero-sized bindings


def _aligned(nbytes: int) -> int:
    return -(-max(nbytes, 1) // ALIGNMENT) * ALIGNMENT


class GpuBufferError(RuntimeError):
    """A buffer the call needs cannot exist on this adapter."""


class BufferSet:
    """Named device buffers of one node, grown on demand and otherwise reused."""

    def __init__(self, device, max_binding_bytes: int):
        self._device = device
        self._max_binding = max_binding_bytes
        self._buffers: dict[str, object] = {}

    def get(self, name: str, nbytes: int, usage: int) -> object:
        nbytes = max(int(nbytes), _MIN_BYTES)
        buffer = self._buffers.get(name)
        if buffer is not None and buffer.size >= nbytes and buffer.usage == usage:
            return buffer
        if nbytes > self._max_binding:
            raise GpuBufferError(
                f"'{name}' needs {nbytes} bytes, more than this adapter binds in one buffer ({self._max_binding} bytes)"
            )
        grown = nbytes if buffer is None else min(self._max_binding, max(nbytes, buffer.size * 3 // 2))
        grown = -(-grown // 4) * 4
        if buffer is not None:
            buffer.destroy()
        buffer = self._device.create_buffer(size=grown, usage=usage, label=name)
        self._buffers[name] = buffer
        return buffer

    def total_bytes(self) -> int:
        return sum(b.size for b in self._buffers.values())

    def release(self) -> None:
        for buffer in self._buffers.values():
            buffer.destroy()
        self._buffers.clear()


class Upload:
    """Host arrays packed into one mapped staging buffer, then copied to their destinations.

    Usage: ``add`` every array with its destination, then ``encode`` the copies into the
    call's command encoder (which writes the staging buffer and unmaps it).
    """

    def __init__(self, buffers: BufferSet):
        self._buffers = buffers
        self._items: list[tuple[np.ndarray, object, int]] = []
        self._size = 0

    def add(self, array: np.ndarray, destination, destination_offset: int = 0) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes == 0:
            return
        self._items.append((array, destination, destination_offset))
        self._size += _aligned(array.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes of host data this upload moves."""
        return sum(array.nbytes for array, _, _ in self._items)

    def encode(self, encoder) -> None:
        if not self._items:
            return
        staging = self._buffers.get("upload_staging", self._size, wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC)
        staging.map_sync(wgpu.MapMode.WRITE, 0, self._size)
        offset = 0
        copies = []
        for array, destination, destination_offset in self._items:
            staging.write_mapped(array.reshape(-1).view(np.uint8), offset)
            copies.append((offset, destination, destination_offset, -(-array.nbytes // 4) * 4))
            offset += _aligned(array.nbytes)
        staging.unmap()
        for source_offset, destination, destination_offset, nbytes in copies:
            encoder.copy_buffer_to_buffer(staging, source_offset, destination, destination_offset, nbytes)


class Download:
    """GPU ranges copied into one mapped read-back buffer and read without an extra copy."""

    def __init__(self, buffers: BufferSet):
        self._buffers = buffers
        self._items: list[tuple[str, object, int, int, int]] = []
        self._size = 0
        self._staging = None

    def add(self, name: str, source, nbytes: int, source_offset: int = 0) -> None:
        self._items.append((name, source, source_offset, nbytes, self._size))
        self._size += _aligned(nbytes)

    def encode(self, encoder) -> None:
        if not self._items:
            return
        self._staging = self._buffers.get("download_staging", self._size, wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        for _, source, source_offset, nbytes, offset in self._items:
            encoder.copy_buffer_to_buffer(source, source_offset, self._staging, offset, -(-nbytes // 4) * 4)

    def read_into(self, destinations: dict[str, np.ndarray]) -> None:
        """Wait for the GPU, then copy each named range straight into its host array."""
        if self._staging is None:
            return
        self._staging.map_sync(wgpu.MapMode.READ, 0, self._size)
        try:
            for name, _, _, nbytes, offset in self._items:
                view = self._staging.read_mapped(offset, -(-nbytes // 4) * 4, copy=False)
                target = destinations[name]
                np.copyto(target.reshape(-1).view(np.uint8), np.frombuffer(view, dtype=np.uint8, count=nbytes))
        finally:
            self._staging.unmap()
