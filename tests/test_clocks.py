"""The benchmarks' SM clock reader (benchmarking/clocks.py), against a stand-in for NVML."""

from __future__ import annotations

import ctypes

from sparse_attention_op.benchmarking.clocks import SmClock, median_mhz, sm_clock


class FakeNvml:
    """NVML's three calls as the reader makes them (pointers as ctypes.byref objects)."""

    def __init__(self, mhz=(345,), init_status=0, handle_status=0, clock_status=0):
        self.mhz, self.init_status, self.handle_status, self.clock_status = list(mhz), init_status, handle_status, clock_status
        self.asked = []

    def nvmlInit_v2(self):
        return self.init_status

    def nvmlDeviceGetHandleByIndex_v2(self, index, device):
        ctypes.cast(device, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1234
        return self.handle_status

    def nvmlDeviceGetClockInfo(self, device, clock_type, mhz):
        self.asked.append((device.value, clock_type))
        if self.clock_status:
            return self.clock_status
        ctypes.cast(mhz, ctypes.POINTER(ctypes.c_uint))[0] = self.mhz.pop(0)
        return 0


def test_reads_the_sm_clock_of_the_device_it_was_handed():
    fake = FakeNvml(mhz=(345, 1980))
    clock = SmClock(fake)
    assert clock.available and clock.read() == 345 and clock.read() == 1980
    assert fake.asked == [(0x1234, 1), (0x1234, 1)]  # NVML_CLOCK_SM of the handle NVML gave


def test_a_library_that_fails_gives_no_readings():
    assert not SmClock(FakeNvml(init_status=1)).available  # NVML_ERROR_UNINITIALIZED, say
    assert not SmClock(FakeNvml(handle_status=2)).available  # no device 0
    assert SmClock(FakeNvml(clock_status=3)).read() is None
    assert SmClock(None).read() is None


def test_without_nvml_the_reader_answers_none():
    clock = sm_clock("libno-such-nvml.so.1")
    assert not clock.available and clock.read() is None


def test_median_skips_missing_readings():
    assert median_mhz([None, 345, 1980, 345]) == 345.0
    assert median_mhz([None, None]) is None and median_mhz([]) is None
