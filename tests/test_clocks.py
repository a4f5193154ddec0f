"""The benchmarks' SM clock reader (benchmarking/clocks.py), against a stand-in for NVML."""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest

from sparse_attention_op.benchmarking.clocks import SmClock, median_mhz, sm_clock

#: NVML's three functions with their C signatures (nvml.h), answering for device 0 only.
STAND_IN_NVML = r"""
static int started = 0;
int nvmlInit_v2(void) { started = 1; return 0; }
int nvmlDeviceGetHandleByIndex_v2(unsigned int index, void **device) {
  if (!started || index != 0) return 2;
  *device = (void *)0x1234;
  return 0;
}
int nvmlDeviceGetClockInfo(void *device, int type, unsigned int *clock) {
  if (device != (void *)0x1234 || type != 1) return 2;  /* NVML_CLOCK_SM of device 0 only */
  *clock = 1980;
  return 0;
}
"""


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


def test_the_ctypes_binding_calls_a_library_with_nvmls_signatures(tmp_path):
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("needs a C compiler to build the stand-in NVML library")
    (tmp_path / "nvml.c").write_text(STAND_IN_NVML)
    library = tmp_path / "libstand-in-nvml.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(library), str(tmp_path / "nvml.c")], check=True)
    clock = sm_clock(str(library))
    assert clock.available and clock.read() == 1980
