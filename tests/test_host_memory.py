"""glibc's heap settings for the bridge's large copies (host_memory.py)."""

import ctypes
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the settings are glibc's")

_PROBE = """
import ctypes, json
from sparse_attention_op import host_memory
applied = host_memory.keep_large_blocks()
class Info(ctypes.Structure):  # glibc's struct mallinfo2: hblkhd is the bytes in mmap'd blocks
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
block = libc.malloc(64 << 20)
mmapped = libc.mallinfo2().hblkhd
libc.free(block)
print(json.dumps({"applied": applied, "mmapped": mmapped}))
"""


def _probe(env_extra: dict) -> dict:
    import json
    import os

    env = dict(os.environ, **env_extra)
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out)


@pytest.mark.skipif(not hasattr(ctypes.CDLL("libc.so.6"), "mallinfo2"), reason="mallinfo2 is glibc >= 2.33")
def test_large_blocks_come_from_the_heap_unless_opted_out():
    kept = _probe({})
    assert kept["applied"] and kept["mmapped"] < 64 << 20  # a 64 MiB block from the heap, not mmap
    system = _probe({"SAO_HOST_HEAP": "system"})
    assert not system["applied"] and system["mmapped"] >= 64 << 20
