"""The KV cache of one node, resident on the GPU between calls.

In a generation loop ONNX Runtime hands the op a copy of the cache it returned last time
(past = previous present). The GPU already holds that cache, so a decode step only has to
move the new rows, the query and the output. But correctness must not depend on the caller
behaving: a new sequence, a reordered beam, an edited cache or another thread's sequence
all arrive as a past that differs from what the GPU holds.

So the cache keeps a *mirror*: the host arrays it last returned as presents (the op owns
them: they are the bridge's own copies, completed in place). The invariant is

    for every batch row b, GPU rows [0, valid_rows[b]) == mirror[b, :, :valid_rows[b]]

Before a call, :meth:`ResidentCache.sync` compares the incoming past with the mirror over
each row's history (the rows the call reads), bit for bit, and uploads only the
(head, row range) spans that differ, plus the history rows the GPU never had. After the
call, :meth:`ResidentCache.commit` makes the returned presents the new mirror; the GPU then
holds them up to each row's new end (the KV-append pass wrote the new rows from the very
values the host used, or the host read the rotated keys back from the GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import wgpu

from ..spec import SparseAttentionCall
from .buffers import Upload

_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC


@dataclass
class SyncStats:
    """What one sync uploaded, for tests and benchmarks."""

    rows_compared: int = 0
    rows_uploaded: int = 0
    bytes_uploaded: int = 0


class ResidentCache:
    """``dtype`` float16 halves the cache's memory and bandwidth; it serves only nodes whose
    values are all float16 values (float16-storage nodes), where it loses nothing."""

    def __init__(self, device, shape: tuple[int, int, int, int], dtype=np.float32):
        self.shape = shape
        self.dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * self.dtype.itemsize
        self.key = device.create_buffer(size=nbytes, usage=_USAGE, label="key_cache")
        self.value = device.create_buffer(size=nbytes, usage=_USAGE, label="value_cache")
        self.nbytes = 2 * nbytes
        self._mirror: tuple[np.ndarray, np.ndarray] | None = None
        self._valid_rows = np.zeros(shape[0], dtype=np.int64)

    def release(self) -> None:
        self.key.destroy()
        self.value.destroy()
        self._mirror = None

    def sync(self, call: SparseAttentionCall, upload: Upload) -> SyncStats:
        """Queue uploads so that the GPU holds the incoming past over every row's history."""
        stats = SyncStats()
        incoming = (call.tensors["past_key"], call.tensors["past_value"])
        mirrors = self._mirror if self._mirror is not None else (None, None)
        for b, needed in enumerate(call.past_lengths):
            known = min(needed, int(self._valid_rows[b])) if self._mirror is not None else 0
            for tensor, buffer, mirror in zip(incoming, (self.key, self.value), mirrors):
                spans = [] if mirror is None else self._differing_spans(tensor[b], mirror[b], known)
                # History rows the GPU never held (or holds for another sequence) go up whole.
                if needed > known:
                    spans += [(head, known, needed) for head in range(tensor.shape[1])]
                stats.rows_compared += known * tensor.shape[1]
                for head, first, last in spans:
                    self._upload_rows(upload, tensor, buffer, b, head, first, last)
                    stats.rows_uploaded += last - first
                    stats.bytes_uploaded += (last - first) * tensor.shape[3] * self.dtype.itemsize
        return stats

    def commit(self, call: SparseAttentionCall, present_key: np.ndarray, present_value: np.ndarray) -> None:
        """The returned presents become the mirror; the GPU holds each row up to its new end."""
        self._mirror = (present_key, present_value)
        self._valid_rows = np.asarray(call.past_lengths, dtype=np.int64) + call.seq_len

    def invalidate(self) -> None:
        """Forget what the GPU holds (after a failed call, its content is unknown)."""
        self._mirror = None
        self._valid_rows[:] = 0

    @staticmethod
    def _differing_spans(incoming: np.ndarray, mirror: np.ndarray, rows: int) -> list[tuple[int, int, int]]:
        """(head, first, end) row spans where incoming[:, :rows] differs from the mirror, bit for bit."""
        if rows == 0:
            return []
        new = incoming[:, :rows].view(np.uint32)
        old = mirror[:, :rows].view(np.uint32)
        if np.array_equal(new, old):  # the common case: one pass over the history, no temporaries kept
            return []
        spans = []
        for head in range(new.shape[0]):
            changed = np.flatnonzero((new[head] != old[head]).any(axis=1))
            if changed.size:
                spans.append((head, int(changed[0]), int(changed[-1]) + 1))
        return spans

    def _upload_rows(self, upload: Upload, tensor: np.ndarray, buffer, b: int, head: int, first: int, last: int) -> None:
        _, heads, rows, head_size = self.shape
        offset = ((b * heads + head) * rows + first) * head_size * self.dtype.itemsize
        upload.add(tensor[b, head, first:last].astype(self.dtype, copy=False), buffer, offset)
