"""Where a call's new rows go in the presents: row ``past + t`` of each (batch row, kv head).

In a session, native ScatterND nodes write the new rows into the caller's past (model.py),
with the indices :func:`scatter_indices` gives; bound to one buffer with the past (IO
binding) they write in place. :func:`scatter_presents` does the same on the host, for tests
and for direct users of the executor.
"""

from __future__ import annotations

import functools

import numpy as np

from .spec import CallShape


def scatter_indices(shape: CallShape) -> np.ndarray:
    """ScatterND indices (batch, kv heads, sequence, 3): [b, head, past_b + t] for every new row."""
    b, heads, s, _ = shape.new_rows_shape
    index = _index_template(b, heads, s).copy()  # a decode step's path: two numpy calls
    index[..., 2] += np.asarray(shape.past_lengths, np.int64)[:, None, None]
    return index


@functools.lru_cache(maxsize=64)
def _index_template(batch: int, heads: int, sequence: int) -> np.ndarray:
    """scatter_indices with every past length 0 (read-only; copied per call)."""
    index = np.empty((batch, heads, sequence, 3), np.int64)
    index[..., 0] = np.arange(batch)[:, None, None]
    index[..., 1] = np.arange(heads)[None, :, None]
    index[..., 2] = np.arange(sequence)[None, None, :]
    index.flags.writeable = False
    return index


def scatter_presents(past_key: np.ndarray, past_value: np.ndarray, shape: CallShape, new_key: np.ndarray, new_value: np.ndarray):
    """present_key, present_value: copies of the past with the new rows written in."""
    present_key, present_value = np.array(past_key, copy=True), np.array(past_value, copy=True)
    for b, past in enumerate(shape.past_lengths):
        present_key[b, :, past : past + shape.seq_len] = new_key[b]
        present_value[b, :, past : past + shape.seq_len] = new_value[b]
    return present_key, present_value
