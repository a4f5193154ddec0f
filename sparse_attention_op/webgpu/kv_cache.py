"""The KV cache of one node, resident on the GPU between calls, and what the host knows of it.

Layout (batch, kv head, row, head) like the operator's past, but with ``rows`` of the GPU's
own choosing: enough for the longest history seen, grown by doubling up to the model's
max_cache_len. A model that allocates 131072 rows for a 1000-token conversation spends GPU
memory on 1000 (well, 1024). The :class:`~sparse_attention_op.webgpu.cache_record.CacheRecord`
says which rows hold what; this class moves rows in (``upload_spans``) and keeps them when
it grows.
"""

from __future__ import annotations

import numpy as np
import wgpu

from sparse_attention_op.webgpu.buffers import Upload
from sparse_attention_op.webgpu.cache_record import CacheRecord, SyncPlan

_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST | wgpu.BufferUsage.COPY_SRC
_FIRST_ROWS = 256


class ResidentCache:
    """``dtype`` float16 halves the cache's memory and bandwidth; it serves only nodes whose
    values are all float16 values (float16-storage nodes), where it loses nothing."""

    def __init__(
        self,
        device,
        batch: int,
        kv_heads: int,
        head_size: int,
        max_rows: int,
        dtype=np.float32,
        max_binding_bytes: int = 2**31,
        *,
        record_itemsize: int,
    ):
        self.device = device
        self.max_binding_bytes = max_binding_bytes
        self.batch, self.kv_heads, self.head_size, self.max_rows = batch, kv_heads, head_size, max_rows
        self.dtype = np.dtype(dtype)
        # The record's 1% is of the model's cache (``record_itemsize``, cache_record.model_itemsize):
        # float16 models may keep an f32 GPU cache.
        self.record = CacheRecord(batch, kv_heads, head_size, record_itemsize, max_rows)
        self.rows = 0
        self.key = self.value = None

    @property
    def nbytes(self) -> int:
        return 2 * self.batch * self.kv_heads * self.rows * self.head_size * self.dtype.itemsize

    def bytes_for(self, rows: int) -> int:
        """Bytes of one of the two buffers at ``rows`` rows (what must fit a binding)."""
        return self.batch * self.kv_heads * rows * self.head_size * self.dtype.itemsize

    def rows_for(self, needed: int) -> int:
        """The capacity this cache grows to for ``needed`` rows (it never shrinks)."""
        if needed <= self.rows:
            return self.rows
        bindable = self.max_binding_bytes // self.bytes_for(1)
        return max(needed, min(self.max_rows, bindable, max(needed, _FIRST_ROWS, 2 * self.rows)))

    def reserve(self, needed: int) -> None:
        """Grow to hold ``needed`` rows, keeping the rows the GPU holds.

        The copies are submitted at once, in a submit of their own: the call's uploads
        (queue writes) run before its command buffer, and must land after these copies."""
        rows = self.rows_for(needed)
        if rows == self.rows:
            return
        old = (self.key, self.value)
        encoder = self.device.create_command_encoder()
        self.key, self.value = (
            self.device.create_buffer(size=self.bytes_for(rows), usage=_USAGE, label=f"{name}_cache") for name in ("key", "value")
        )
        if old[0] is not None:
            row_bytes = self.head_size * self.dtype.itemsize
            for b, held in enumerate(self.record.valid):
                if held == 0:
                    continue
                for head in range(self.kv_heads):
                    for source, target in zip(old, (self.key, self.value)):
                        encoder.copy_buffer_to_buffer(
                            source,
                            ((b * self.kv_heads + head) * self.rows) * row_bytes,
                            target,
                            ((b * self.kv_heads + head) * rows) * row_bytes,
                            int(held) * row_bytes,
                        )
            self.device.queue.submit([encoder.finish()])
            # Destroying after the submit is safe: the submitted copies still complete.
            for buffer in old:
                buffer.destroy()
        self.rows = rows

    def upload_spans(self, upload: Upload, plans: dict[str, SyncPlan], history_key: np.ndarray, history_value: np.ndarray) -> None:
        """Queue the history rows each plan names for writing into the cache."""
        row_bytes = self.head_size * self.dtype.itemsize
        for name, buffer, history in (("key", self.key, history_key), ("value", self.value, history_value)):
            for b, head, first, end in plans[name].spans:
                offset = ((b * self.kv_heads + head) * self.rows + first) * row_bytes
                upload.write(history[b, head, first:end].astype(self.dtype, copy=False), buffer, offset)

    def release(self) -> None:
        for buffer in (self.key, self.value):
            if buffer is not None:
                buffer.destroy()
        self.key = self.value = None
        self.rows = 0
        self.record.forget()
