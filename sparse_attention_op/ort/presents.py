"""Where a call's new rows go in the presents: row ``past + t`` of each (batch row, kv head).

The bridge writes them into the buffers ORT gives it for ``present_key``/``present_value``
(:func:`write_rows`); :func:`scatter_presents` builds both presents on the host, for tests
and for direct users of the executor.
"""

from __future__ import annotations

import numpy as np

from sparse_attention_op.op.spec import CallShape
from sparse_attention_op.webgpu import host_threads


def write_rows(present: np.ndarray, shape: CallShape, rows: np.ndarray) -> None:
    """Write ``rows`` (batch, kv heads, sequence, head) at rows ``[past_b, past_b + sequence)``
    of each batch row ``b`` of ``present``; nothing else changes. A prompt's rows are copied
    over the host's threads (kv heads split among them)."""
    for b, start in enumerate(shape.past_lengths):  # plain ints: a decode step's path
        host_threads.copy(present[b, :, start : start + shape.seq_len], rows[b])


def copy_past(present: np.ndarray, past: np.ndarray) -> None:
    """present[...] = past (both C-contiguous, as ORT's tensors are), over the host's threads."""
    host_threads.copy(present.reshape(-1), past.reshape(-1))


def scatter_presents(past_key: np.ndarray, past_value: np.ndarray, shape: CallShape, new_key: np.ndarray, new_value: np.ndarray):
    """present_key, present_value: copies of the past with the new rows written in."""
    present_key, present_value = np.array(past_key, copy=True), np.array(past_value, copy=True)
    write_rows(present_key, shape, new_key)
    write_rows(present_value, shape, new_value)
    return present_key, present_value
