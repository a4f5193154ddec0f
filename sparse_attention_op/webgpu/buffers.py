"""GPU buffers reused across calls, and the two transfers of a call (one upload, one read-back).

Measured (docs/design.md section 3; ``scripts/measure_platform.py``):

* ``queue.write_buffer`` needs no map round trip, so small uploads use it: the call's
  small inputs packed into one write. For large ones wgpu allocates a fresh staging buffer
  per write, which a VM faults in page by page; a staging buffer we keep mapped between
  calls and fill with parallel copies avoids that.
* Reading back through our own MAP_READ buffer avoids the queue's read helper's per-call
  allocation and submit. Maps wait on the calling thread (mapping.py), not through
  wgpu-py's poll thread, and add no empty submit before a read.

Buffers are named and only grow (by half again, so a slowly growing need does not
reallocate every call). The executor keeps one :class:`BufferPool` for the transient
buffers every call uses (they are shared by all nodes: calls run one at a time) and one
per node for what must survive between calls.
"""

from __future__ import annotations

import os

import numpy as np
import wgpu

from .. import host_threads
from .mapping import mapped
from .programs import BufferRange

#: Offsets of sections inside one buffer: storage bindings and copies need 256-byte aligned
#: offsets on every adapter (minStorageBufferOffsetAlignment's largest allowed value).
ALIGNMENT = 256
_MIN_BYTES = 16  # WebGPU refuses zero-sized bindings
#: Uploads up to this size are packed into one write_buffer call.
_PACK_BYTES = 1 << 18
#: Uploads above this size go through our own mapped staging buffer (measured on the H200
#: host: fresh staging memory faults in at a few GB/s; SAO_STAGING_BYTES overrides, for
#: measuring the two paths).
STAGING_BYTES = int(os.environ.get("SAO_STAGING_BYTES", 4 << 20))
#: The upload staging buffer is kept between calls up to this size; larger uploads (a long
#: history fetched once) get a buffer of their own, freed after the call.
_KEEP_STAGING_BYTES = 512 << 20

STORAGE_IN = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST
STORAGE_OUT = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
UNIFORM = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST


def aligned(nbytes: int) -> int:
    return -(-max(int(nbytes), 1) // ALIGNMENT) * ALIGNMENT


class GpuBufferError(RuntimeError):
    """A buffer the call needs cannot exist on this adapter."""


class BufferPool:
    """Named device buffers, grown on demand and otherwise reused."""

    def __init__(self, device, max_binding_bytes: int):
        self._device = device
        self._max_binding = max_binding_bytes
        self._buffers: dict[str, object] = {}
        #: Buffers of one call only, destroyed once its command buffer is submitted.
        self.temporaries: list = []

    def get(self, name: str, nbytes: int, usage: int) -> object:
        nbytes = max(int(nbytes), _MIN_BYTES)
        buffer = self._buffers.get(name)
        if buffer is not None and buffer.size >= nbytes and buffer.usage == usage:
            return buffer
        if nbytes > self._max_binding:
            raise GpuBufferError(f"'{name}' needs {nbytes} bytes, more than this adapter binds in one buffer ({self._max_binding} bytes)")
        grown = nbytes if buffer is None else min(self._max_binding, max(nbytes, buffer.size * 3 // 2))
        grown = -(-grown // ALIGNMENT) * ALIGNMENT
        if buffer is not None:
            buffer.destroy()
        buffer = self._device.create_buffer(size=grown, usage=usage, label=name)
        self._buffers[name] = buffer
        return buffer

    def release_temporaries(self) -> None:
        while self.temporaries:
            self.temporaries.pop().destroy()

    def drop(self, name: str) -> None:
        buffer = self._buffers.pop(name, None)
        if buffer is not None:
            buffer.destroy()

    def total_bytes(self) -> int:
        return sum(b.size for b in self._buffers.values())

    def release(self) -> None:
        for buffer in self._buffers.values():
            buffer.destroy()
        self._buffers.clear()


class Upload:
    """The host data of one call: sections of one input buffer, and writes into other buffers.

    ``section`` reserves an aligned section of the call's input buffer for an array and
    returns where a kernel binds it; ``write`` targets a range of another buffer (history rows
    into a cache). ``encode`` moves everything before the call's dispatches: small uploads
    through ``queue.write_buffer`` (one packed write for the sections), large ones through a
    staging buffer we keep mapped-for-write between calls and fill with parallel copies
    (fresh memory is slow to fault in, in VMs above all; a kept buffer is warm).
    """

    def __init__(self):
        self._sections: list[tuple[np.ndarray, int]] = []
        self._writes: list[tuple[np.ndarray, object, int]] = []
        self.section_bytes = 0
        #: Bytes of host data this upload moves.
        self.nbytes = 0
        self._write_bytes = 0  # the writes', each aligned (their room in a staging buffer)

    def section(self, array: np.ndarray) -> int:
        offset = self.section_bytes
        array = np.ascontiguousarray(array)
        self._sections.append((array, offset))
        self.section_bytes += aligned(array.nbytes)
        self.nbytes += array.nbytes
        return offset

    def write(self, array: np.ndarray, destination, offset: int) -> None:
        array = np.ascontiguousarray(array)
        self._writes.append((array, destination, offset))
        self._write_bytes += aligned(array.nbytes)
        self.nbytes += array.nbytes

    def encode(self, device, commands, pool: BufferPool, inputs, spin_seconds: float = 0.0, packing=None) -> None:
        """Record every section into ``inputs`` and every write into its buffer, ahead of the
        dispatches the caller records next (``commands``: a recording.py recording;
        ``spin_seconds``: see mapping.mapped). ``packing(nbytes)`` may lend the uint8 host
        array the small sections are packed in (one kept between calls is warm in the CPU's
        caches; without it a fresh one is allocated and zeroed)."""
        total = self.section_bytes + self._write_bytes
        if total > STAGING_BYTES:
            self._through_staging(self._items(inputs), total, device, commands, pool, spin_seconds)
        elif self._sections and self.section_bytes <= _PACK_BYTES:
            # The padding between sections is never read (a test lends an array of all-ones
            # bytes to prove it), so a lent array's may hold old bytes. Sections hold 4-byte
            # elements (spec.py), so no section ends inside a word of padding.
            packed = np.zeros(self.section_bytes, np.uint8) if packing is None else packing(self.section_bytes)
            for array, offset in self._sections:
                packed[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
            commands.write_buffer(inputs, 0, packed)
            for array, destination, offset in self._writes:
                _write(commands, destination, offset, array)
        else:
            for array, destination, offset in self._items(inputs):
                _write(commands, destination, offset, array)

    def _items(self, inputs) -> list[tuple[np.ndarray, object, int]]:
        """Every section (into ``inputs``) and every write, as (array, buffer, offset)."""
        return [(array, inputs, offset) for array, offset in self._sections] + self._writes

    @staticmethod
    def _through_staging(items, total: int, device, commands, pool: BufferPool, spin_seconds: float) -> None:
        kept = total <= _KEEP_STAGING_BYTES
        usage = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
        staging = pool.get("upload", total, usage) if kept else device.create_buffer(size=aligned(total), usage=usage)
        with mapped(device, staging, True, 0, aligned(total), spin_seconds) as memory:
            offset = 0
            for array, destination, destination_offset in items:
                data = array.reshape(-1).view(np.uint8)
                host_threads.copy(memory[offset : offset + data.nbytes], data)
                offset += aligned(data.nbytes)
        offset = 0
        for array, destination, destination_offset in items:
            commands.copy_buffer_to_buffer(staging, offset, destination, destination_offset, -(-array.nbytes // 4) * 4)
            offset += aligned(array.nbytes)
        if not kept:
            # Destroyed only after the submit that reads it (a destroyed buffer in a submit
            # is a fatal wgpu-native error): the executor calls release_temporaries().
            pool.temporaries.append(staging)


def _write(commands, buffer, offset: int, array: np.ndarray) -> None:
    data = array.reshape(-1).view(np.uint8)
    if data.nbytes % 4:  # copies move whole 4-byte words
        data = np.concatenate([data, np.zeros(4 - data.nbytes % 4, np.uint8)])
    commands.write_buffer(buffer, offset, data)


class Download:
    """GPU ranges copied into one mapped read-back buffer, then straight into host arrays.

    The read-back buffer is kept between calls (a fresh one would fault its pages in on
    every large call), sized by the largest call so far."""

    def __init__(self, pool: BufferPool, device, spin_seconds: float = 0.0):
        self._pool = pool
        self._device = device
        self._spin_seconds = spin_seconds  # see mapping.mapped
        self._items: list[tuple[np.ndarray, BufferRange, int]] = []
        self._size = 0
        self._staging = None

    def add(self, destination: np.ndarray, source: BufferRange) -> None:
        self._items.append((destination, source, self._size))
        self._size += aligned(destination.nbytes)

    def encode(self, commands) -> None:
        if not self._items:
            return
        self._staging = self._pool.get("readback", self._size, wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
        # Ranges laid out in their source buffer as they are in the read-back buffer (the
        # sections of one results buffer) move in one copy.
        runs = []
        for destination, source, offset in self._items:
            end = offset + -(-destination.nbytes // 4) * 4
            if runs and runs[-1][0] is source.buffer and source.offset - runs[-1][1] == offset - runs[-1][2]:
                runs[-1][3] = end
            else:
                runs.append([source.buffer, source.offset, offset, end])
        for buffer, source_offset, offset, end in runs:
            commands.copy_buffer_to_buffer(buffer, source_offset, self._staging, offset, end - offset)

    def read(self) -> None:
        """Wait for the GPU, then copy each range into its host array."""
        if self._staging is None:
            return
        with mapped(self._device, self._staging, False, 0, self._size, self._spin_seconds) as memory:
            for destination, _, offset in self._items:
                host_threads.copy(destination.reshape(-1).view(np.uint8), memory[offset : offset + destination.nbytes])
