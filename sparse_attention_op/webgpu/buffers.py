"""GPU buffers reused across calls, and the two transfers of a call (one upload, one read-back).

Measured (docs/design.md section 3; ``scripts/measure_platform.py``):

* ``queue.write_buffer`` needs no map round trip, so small uploads use it (a call's small
  inputs go packed in one write: step_plan.py). For large ones wgpu allocates a fresh
  staging buffer per write, which a VM faults in page by page; a staging buffer we keep
  mapped between calls and fill with parallel copies avoids that.
* Reading back through our own MAP_READ buffer avoids the queue's read helper's per-call
  allocation and submit. Maps wait on the calling thread (mapping.py), not through
  wgpu-py's poll thread, and add no empty submit before a read.
* A transfer larger than a chunk (Tuning.transfer_chunk_bytes: 256 MiB, at most the binding
  limit) moves in chunks (:func:`layout_chunks`) through two staging or read-back buffers in
  turn, each chunk's copy submitted as soon as it can run. Two chunk-sized buffers per
  direction then serve a transfer of any size. Smaller chunks, so that the driver copies one
  while the host copies another, measured slower (tuning.py says where): a prompt's
  transfers move whole.

Buffers are named and only grow (by half again, so a slowly growing need does not
reallocate every call). The executor keeps one :class:`BufferPool` for the transient
buffers every call uses (they are shared by all nodes: calls run one at a time) and one
per node for what must survive between calls.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import wgpu

from sparse_attention_op.settings import environment_int
from sparse_attention_op.webgpu import host_threads, recording
from sparse_attention_op.webgpu.mapping import mapped
from sparse_attention_op.webgpu.programs import BufferRange

#: Offsets of sections inside one buffer: storage bindings and copies need 256-byte aligned
#: offsets on every adapter (minStorageBufferOffsetAlignment's largest allowed value).
ALIGNMENT = 256
_MIN_BYTES = 16  # WebGPU refuses zero-sized bindings
#: A call's inputs up to this size are packed on the host and sent in one write_buffer call.
PACK_BYTES = 1 << 18
#: Uploads above this size go through our own mapped staging buffer (measured on the H200
#: host: fresh staging memory faults in at a few GB/s; SAO_STAGING_BYTES overrides, for
#: measuring the two paths).
STAGING_BYTES = environment_int("SAO_STAGING_BYTES", 4 << 20)
#: Staging buffers are kept between calls up to this size; a larger one (an upload moved
#: whole) is made for its call and freed after it.
_KEEP_BYTES = 512 << 20

STORAGE_IN = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST
STORAGE_OUT = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
UNIFORM = wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST


def aligned(nbytes: int) -> int:
    return -(-max(int(nbytes), 1) // ALIGNMENT) * ALIGNMENT


class GpuBufferError(wgpu.GPUError):
    """A buffer the call needs cannot exist on this adapter (a GPU failure, as the device's own
    errors are: the executor reports it as GpuExecutionError)."""


class BufferPool:
    """Named device buffers, grown on demand and otherwise reused."""

    def __init__(self, device, max_binding_bytes: int):
        self._device = device
        self._max_binding = max_binding_bytes
        self._buffers: dict[str, object] = {}
        #: Buffers of one call only, destroyed once its command buffer is submitted.
        self.temporaries: list = []
        #: Counts the named buffers made or freed: what holds on to buffers of the pool
        #: (a node's step plan, step_plan.py) is still good while it has not moved.
        self.generation = 0

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
        self.generation += 1
        return buffer

    def release_temporaries(self) -> None:
        while self.temporaries:
            self.temporaries.pop().destroy()

    def total_bytes(self) -> int:
        return sum(b.size for b in self._buffers.values())

    def release(self) -> None:
        for buffer in self._buffers.values():
            buffer.destroy()
        self._buffers.clear()
        self.generation += 1


class Upload:
    """The host data of one call: sections of one input buffer, and writes into other buffers.

    ``section`` reserves an aligned section of the call's input buffer for an array and
    returns where a kernel binds it; ``write`` targets a range of another buffer (history rows
    into a cache). ``encode`` moves everything before the call's dispatches: small uploads
    through ``queue.write_buffer``, large ones through staging buffers kept between calls
    (two, in turn, for one in chunks), each filled with parallel copies (fresh memory is slow
    to fault in, in VMs above all; a kept buffer is warm). A call whose inputs are small packs
    them itself and uploads only its writes here (step_plan.py).
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

    def sections(self, arrays: list[np.ndarray], layout: StepLayout) -> None:
        """Every section at once, where ``layout`` places them (``arrays`` in its order, each
        of its size): a call's inputs without working out their offsets again."""
        placed = self._sections
        for array, (_, offset, _) in zip(arrays, layout.inputs):
            placed.append((array, offset))
            self.nbytes += array.nbytes
        self.section_bytes = layout.input_bytes

    def write(self, array: np.ndarray, destination, offset: int) -> None:
        array = np.ascontiguousarray(array)
        self._writes.append((array, destination, offset))
        self._write_bytes += aligned(array.nbytes)
        self.nbytes += array.nbytes

    def encode(self, device, commands, pool: BufferPool, inputs, spin_seconds: float = 0.0, chunk_bytes: int = 0) -> None:
        """Record every section into ``inputs`` and every write into its buffer, ahead of the
        dispatches the caller records next (``commands``: a recording.py recording;
        ``spin_seconds``: see mapping.mapped). Through staging, uploads larger than
        ``chunk_bytes`` move in chunks (layout_chunks; 0: whole)."""
        if self.section_bytes + self._write_bytes > STAGING_BYTES:
            self._through_staging(self._items(inputs), device, commands, pool, spin_seconds, chunk_bytes)
        else:
            for array, destination, offset in self._items(inputs):
                _write(commands, destination, offset, array)

    def _items(self, inputs) -> list[tuple[np.ndarray, object, int]]:
        """Every section (into ``inputs``) and every write, as (array, buffer, offset)."""
        return [(array, inputs, offset) for array, offset in self._sections] + self._writes

    @staticmethod
    def _through_staging(items, device, commands, pool: BufferPool, spin_seconds: float, chunk_bytes: int) -> None:
        """Every item through staging buffers filled with parallel copies, chunk by chunk:
        each chunk's copies are submitted once it is filled (the last one's go into
        ``commands``, ahead of the call's dispatches), so that the GPU can move one chunk while
        the host fills the next; a buffer's next map waits for its last chunk's copies."""
        data = [array.reshape(-1).view(np.uint8) for array, _, _ in items]
        chunks = layout_chunks([d.nbytes for d in data], chunk_bytes)
        usage = wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
        for number, pieces in enumerate(chunks):
            nbytes = used_bytes(pieces)
            staging = _staging_buffer(pool, device, f"upload.{number % 2}", nbytes, usage)
            with mapped(device, staging, True, 0, nbytes, spin_seconds) as memory:
                for piece in pieces:
                    host_threads.copy(memory[piece.offset : piece.offset + piece.nbytes], data[piece.item][piece.start : piece.end])

            def copy_chunk(target):  # called within this iteration
                for piece in pieces:
                    _, destination, destination_offset = items[piece.item]
                    target.copy_buffer_to_buffer(staging, piece.offset, destination, destination_offset + piece.start, _words(piece.nbytes))

            if number == len(chunks) - 1:
                copy_chunk(commands)
            else:
                _submit_now(device, copy_chunk)


def _write(commands, buffer, offset: int, array: np.ndarray) -> None:
    data = array.reshape(-1).view(np.uint8)
    if data.nbytes % 4:  # copies move whole 4-byte words
        data = np.concatenate([data, np.zeros(4 - data.nbytes % 4, np.uint8)])
    commands.write_buffer(buffer, offset, data)


class StepLayout:
    """Where a call's inputs lie in its one input buffer and its results in its one results
    buffer (each at an aligned offset, in the order given): a function of their names and
    sizes alone, so a decode loop works it out on its first step (:func:`step_layout`) and
    every later step has it at hand. Compared by identity: one object per distinct layout."""

    __slots__ = ("inputs", "input_bytes", "results", "result_bytes")

    def __init__(self, inputs: tuple[tuple[str, int], ...], results: tuple[tuple[str, int], ...]):
        #: (name, offset, nbytes) of each input; an input binding reaches the buffer's end.
        self.inputs = _placed(inputs)
        self.input_bytes = self.inputs[-1][1] + aligned(self.inputs[-1][2]) if self.inputs else 0
        placed = _placed(results)
        #: (name, offset, binding bytes) of each result: bindings reach the next result's offset.
        self.results = tuple((name, offset, aligned(nbytes)) for name, offset, nbytes in placed)
        self.result_bytes = placed[-1][1] + placed[-1][2] if placed else 0


def _placed(items: tuple[tuple[str, int], ...]) -> tuple[tuple[str, int, int], ...]:
    placed, offset = [], 0
    for name, nbytes in items:
        placed.append((name, offset, nbytes))
        offset += aligned(nbytes)
    return tuple(placed)


@functools.lru_cache(maxsize=256)
def step_layout(inputs: tuple[tuple[str, int], ...], results: tuple[tuple[str, int], ...]) -> StepLayout:
    """The layout of inputs and results of these (name, nbytes), one object per distinct one."""
    return StepLayout(inputs, results)


class Download:
    """GPU ranges copied into mapped read-back buffers, then straight into host arrays.

    A transfer of one chunk (every decode step's and prompt's) is one copy into one
    read-back buffer, mapped once. A larger one alternates between two: the call's command
    buffer copies the first chunk, the next chunk's copy is submitted before the first is
    read, and each read chunk's buffer takes the chunk after next, so that the GPU can copy
    while the host reads. The read-back buffers are kept between calls (fresh ones would
    fault their pages in on every large call), sized by the largest chunk so far."""

    def __init__(self, pool: BufferPool, device, spin_seconds: float = 0.0, chunk_bytes: int = 0):
        self._pool = pool
        self._device = device
        self._spin_seconds = spin_seconds  # see mapping.mapped
        self._chunk_bytes = chunk_bytes  # see layout_chunks (0: one chunk)
        self._items: list[tuple[np.ndarray, BufferRange]] = []
        self._chunks: tuple[tuple[Piece, ...], ...] = ()
        self._buffers = [None, None]

    def add(self, destination: np.ndarray, source: BufferRange) -> None:
        self._items.append((destination, source))

    def encode(self, commands) -> None:
        """Record the first chunk's copies into the call's command buffer."""
        if self._items:
            self._chunks = layout_chunks([destination.nbytes for destination, _ in self._items], self._chunk_bytes)
            self._copy_chunk(commands, 0)

    def read(self) -> None:
        """Wait for the GPU, then copy each range into its host array, chunk by chunk."""
        if len(self._chunks) > 1:
            self._submit_chunk(1)
        for number, pieces in enumerate(self._chunks):
            with mapped(self._device, self._buffers[number % 2], False, 0, used_bytes(pieces), self._spin_seconds) as memory:
                for piece in pieces:
                    destination = self._items[piece.item][0].reshape(-1).view(np.uint8)
                    host_threads.copy(destination[piece.start : piece.end], memory[piece.offset : piece.offset + piece.nbytes])
            if number + 2 < len(self._chunks):
                self._submit_chunk(number + 2)

    def _copy_chunk(self, commands, number: int) -> None:
        pieces = self._chunks[number]
        buffer = self._buffers[number % 2] = self._pool.get(
            f"readback.{number % 2}", used_bytes(pieces), wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
        )
        # Pieces laid out in their source buffer as they are in the read-back buffer (the
        # sections of one results buffer) move in one copy.
        runs = []
        for piece in pieces:
            source = self._items[piece.item][1]
            start, end = source.offset + piece.start, piece.offset + _words(piece.nbytes)
            if runs and runs[-1][0] is source.buffer and start - runs[-1][1] == piece.offset - runs[-1][2]:
                runs[-1][3] = end
            else:
                runs.append([source.buffer, start, piece.offset, end])
        for source_buffer, source_offset, offset, end in runs:
            commands.copy_buffer_to_buffer(source_buffer, source_offset, buffer, offset, end - offset)

    def _submit_chunk(self, number: int) -> None:
        _submit_now(self._device, lambda commands: self._copy_chunk(commands, number))


class Piece(NamedTuple):
    """Bytes [start, end) of a transfer's item, at ``offset`` in its chunk's buffer (a tuple:
    a decode step lays out three)."""

    item: int
    start: int
    end: int
    offset: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def layout_chunks(sizes, chunk_bytes: int) -> tuple[tuple[Piece, ...], ...]:
    """Items of these byte sizes laid out, in order, in buffers ("chunks") of at most
    ``chunk_bytes`` each (0: one buffer for all), every piece at an aligned offset. An item
    longer than its chunk's room is cut at aligned byte offsets and goes on in the next.
    Worked out once per distinct sizes (a decode step reads back the step before's)."""
    return _layout_chunks(tuple(sizes), chunk_bytes)


@functools.lru_cache(maxsize=256)
def _layout_chunks(sizes: tuple[int, ...], chunk_bytes: int) -> tuple[tuple[Piece, ...], ...]:
    room = max(ALIGNMENT, aligned(chunk_bytes)) if chunk_bytes > 0 else None
    chunks, pieces, used = [], [], 0
    for item, size in enumerate(sizes):
        start = 0
        while True:
            if room is not None and used >= room:
                chunks.append(pieces)
                pieces, used = [], 0
            end = size if room is None else min(size, start + room - used)
            pieces.append(Piece(item, start, end, used))
            used += aligned(end - start)
            start = end
            if start >= size:
                break
    if pieces:
        chunks.append(pieces)
    return tuple(tuple(chunk) for chunk in chunks)


def used_bytes(pieces: tuple[Piece, ...]) -> int:
    """The buffer bytes a chunk's pieces take."""
    return pieces[-1].offset + aligned(pieces[-1].nbytes)


def _submit_now(device, record) -> None:
    """``record(commands)`` into a recording of its own, submitted at once (a chunk's copies,
    ahead of the call's command buffer or after it)."""
    commands = recording.begin(device, False)
    try:
        record(commands)
        commands.submit()
    finally:
        commands.release()  # never raises: after a submit it has nothing left to free


def _words(nbytes: int) -> int:
    """Copies move whole 4-byte words (room for the last one's padding is always there)."""
    return -(-nbytes // 4) * 4


def _staging_buffer(pool: BufferPool, device, name: str, nbytes: int, usage: int):
    """A kept staging buffer of the pool, or (beyond _KEEP_BYTES: an upload moved whole) one
    freed after the call's submit: a destroyed buffer in a submit is a fatal wgpu-native
    error, so the executor calls release_temporaries() only then."""
    if nbytes <= _KEEP_BYTES:
        return pool.get(name, nbytes, usage)
    buffer = device.create_buffer(size=aligned(nbytes), usage=usage)
    pool.temporaries.append(buffer)
    return buffer
