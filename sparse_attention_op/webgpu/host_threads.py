"""A small thread pool for the host's bulk work: copies into and out of mapped GPU memory,
copies that make rows contiguous, and digests of history rows.

numpy releases the GIL inside large copies and matrix products, so a few threads turn a
single-core memcpy (about 10 GB/s, less in a VM that faults fresh pages in) into several
times that. Work below a few MiB stays on the calling thread: handing it out costs more
than it saves.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

#: Bytes below which a copy is not worth splitting.
PARALLEL_BYTES = 4 << 20

_pool: ThreadPoolExecutor | None = None
_scratch = threading.local()


def workers() -> int:
    return min(8, os.cpu_count() or 1)


def pool() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=workers(), thread_name_prefix="sao-host")
    return _pool


def split(count: int, parts: int) -> list[tuple[int, int]]:
    """``parts`` contiguous (start, end) ranges covering [0, count)."""
    bounds = np.linspace(0, count, max(1, min(parts, count)) + 1).astype(int)
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def copy(destination: np.ndarray, source: np.ndarray) -> None:
    """destination[...] = source for arrays of one shape (a float16 source may fill a float32
    destination), split along the first axis over the pool when large."""
    if destination.shape != source.shape:
        raise ValueError(f"copy: destination {destination.shape} and source {source.shape} differ")
    if destination.nbytes < PARALLEL_BYTES or workers() == 1 or destination.ndim == 0 or destination.shape[0] < 2:
        np.copyto(destination, source, casting="same_kind")
        return
    ranges = split(destination.shape[0], workers())
    list(pool().map(lambda r: np.copyto(destination[r[0] : r[1]], source[r[0] : r[1]], casting="same_kind"), ranges))


def copy_flat(destination: np.ndarray, source: np.ndarray) -> None:
    """destination[...] = source for C-contiguous arrays of one shape, split over the pool
    whatever the shape (:func:`copy` splits the first axis, which is often the batch of 1)."""
    if destination.flags.c_contiguous and source.flags.c_contiguous:
        copy(destination.reshape(-1), source.reshape(-1))
    else:
        copy(destination, source)


def reused(name: str, shape: tuple[int, ...], dtype=np.float32) -> np.ndarray:
    """An array of ``shape`` that this thread keeps under ``name`` and hands out again, grown
    when a larger one is asked for: fresh arrays of hundreds of MB are slow to fault in. Its
    content stays until the next request of the same ``name`` on this thread."""
    buffers = _scratch.__dict__.setdefault("buffers", {})
    size = math.prod(shape)  # plain ints: np.prod costs a call microseconds
    array = buffers.get(name)
    if array is None or array.size < size or array.dtype != dtype:
        array = buffers[name] = np.empty(size, dtype)
    return array[:size].reshape(shape)


def as_float32(array: np.ndarray, name: str) -> np.ndarray:
    """``array`` converted to float32. A large one goes into the :func:`reused` array
    ``name``, converted over the pool (numpy converts float16 on one core); it stays valid
    until the next call with the same ``name`` on this thread."""
    if array.nbytes < PARALLEL_BYTES:
        return array.astype(np.float32)
    converted = reused(f"float32 {name}", array.shape)
    copy_flat(converted, array)
    return converted
