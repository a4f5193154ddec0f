"""How fast the host runs right now: a fixed piece of host work, timed next to a benchmark's steps.

A decode step's host time is Python, numpy and driver calls, and the hosts it was measured
on do not run them at one speed. On the H100 host of 2026-12-06 (docs/benchmarks-archive.md)
every phase of the op took about twice as long for seconds at a time (0.44-0.59 ms of host
work per step against 0.26-0.31), ORT's own CPU kernel slowing with it, under ORT's default
thread settings, without spinning threads and with one intra-op thread alike. A step timed
in that state is not comparable with one timed outside it, and the step's own phases
cannot tell the state from a change of code.

The probe is the same small mix of that kind of work every time (interpreter work, small
numpy operations, a copy of 256 KiB, twice), about 25 us on a 2-core CPU machine. The benchmarks time it
once after each timed step, outside the step's timing, and report the median next to the
step's: a row whose probe took much longer than the others' ran on a slower host.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

#: The memory one round copies: the size of a decode step's small arrays together, and more
#: than a core's L1 cache, so that the round's time includes some of the memory system's.
_COPY_BYTES = 256 << 10


class HostProbe:
    """A fixed piece of host work (``rounds`` rounds of it) and its timer."""

    def __init__(self, rounds: int = 2):
        if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1:
            raise ValueError(f"rounds must be a positive int, got {rounds!r}")
        self.rounds = rounds
        self._source = np.arange(_COPY_BYTES // 4, dtype=np.float32)
        self._target = np.empty_like(self._source)
        self._table = {i: i * 3 for i in range(64)}

    def work(self) -> float:
        """Run the work once; its result is the same every time (a checksum, so that no part
        of the work can be skipped)."""
        total = 0
        table = self._table
        for r in range(self.rounds):
            for i in range(64):  # dict lookups and integer arithmetic, as the interpreter runs a step's Python
                total += table[(i + r) & 63]
            small = np.full(16, r, dtype=np.int32)  # small arrays made and written, as a step's inputs are
            small[3:9] = small[:6] + 1
            total += int(small.sum())
            self._target[...] = self._source  # a copy through the caches
            total += int(self._target[r])
        return float(total)

    def seconds(self) -> float:
        """The work's wall time, once."""
        start = time.perf_counter()
        self.work()
        return time.perf_counter() - start


def median_us(seconds) -> float | None:
    """The median of probe times in microseconds; None for none."""
    values = list(seconds)
    return statistics.median(values) * 1e6 if values else None
