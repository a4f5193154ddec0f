"""The benchmarks' host probe (benchmarking/host_speed.py): fixed work, timed."""

from __future__ import annotations

import pytest

from sparse_attention_op.benchmarking.host_speed import HostProbe, median_us


def test_the_work_is_the_same_every_time_and_grows_with_its_rounds():
    one, eight = HostProbe(1), HostProbe(8)
    assert one.work() == one.work() == HostProbe(1).work()  # fixed work: the same checksum each run
    assert eight.work() != one.work()
    # The timer measures the work: eight rounds take longer than one (medians of several,
    # a ratio of 8 in work, so the host's noise cannot reverse it).
    assert median_us(eight.seconds() for _ in range(15)) > median_us(one.seconds() for _ in range(15))


@pytest.mark.parametrize("rounds", [0, -1, 1.5, True, "2"])
def test_rounds_must_be_a_positive_int(rounds):
    with pytest.raises(ValueError, match="rounds must be a positive int"):
        HostProbe(rounds)


def test_median_in_microseconds():
    assert median_us([3e-6, 1e-6, 2e-6]) == pytest.approx(2.0)
    assert median_us([]) is None
