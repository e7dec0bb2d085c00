"""pagoda/memory_env.py: the GEMM primitive caches capped (unless the environment chose)
and glibc's mmap threshold fixed, so it no longer follows the largest freed block up."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagoda.memory_env import CACHE_CAPACITY_VARS, GEMM_CACHE_CAPACITY

ROOT = Path(__file__).resolve().parents[2]

# NOTE: mallinfo2().hblks counts the chunks glibc has mmapped. glibc's own threshold starts
# at 128 KiB, so a first 12 MiB block (a 2,048-token step's GEMM output) is mmapped, and
# faulted in afresh at every step; under the fixed 32 MiB threshold it comes from the heap.
# A 40 MiB block is mmapped either way.
_PROBE = """
import ctypes, json, os, sys
import pagoda.omp_env as o
from pagoda.memory_env import CACHE_CAPACITY_VARS
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
if sys.argv[1] == "apply":
    o.apply_openmp_defaults()
before = libc.mallinfo2().hblks
block = libc.malloc(12 << 20)
mmapped = libc.mallinfo2().hblks - before
libc.free(block)
before = libc.mallinfo2().hblks
big = libc.malloc(40 << 20)
big_mmapped = libc.mallinfo2().hblks - before
libc.free(big)
top = libc.malloc(2 << 20)  # from the heap's top
arena = libc.mallinfo2().arena
libc.free(top)
trimmed = libc.mallinfo2().arena < arena
print(json.dumps({"mmapped": mmapped, "big_mmapped": big_mmapped, "trimmed": trimmed,
                  "caps": [os.environ.get(v) for v in CACHE_CAPACITY_VARS]}))
"""


def _probe(mode: str, **env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if k not in (*CACHE_CAPACITY_VARS, "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                          "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", _PROBE, mode], cwd=ROOT,
                         env={**clean, **env}, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_entrypoint_defaults_cap_the_caches_and_fix_the_mmap_threshold() -> None:
    glibc = _probe("none")  # glibc's own behaviour
    assert glibc["mmapped"] == 1 and glibc["big_mmapped"] == 1 and glibc["caps"] == [None, None]
    cap = GEMM_CACHE_CAPACITY
    # The freed 2 MiB at the heap's top stays: a fixed mmap threshold alone would leave
    # glibc's trim threshold at 128 KiB and give it back (the next step faults it in).
    assert _probe("apply") == {"mmapped": 0, "big_mmapped": 1, "trimmed": False,
                               "caps": [cap, cap]}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_an_explicit_environment_wins() -> None:
    got = _probe("apply", MALLOC_MMAP_THRESHOLD_=str(4 << 20),
                 **dict.fromkeys(CACHE_CAPACITY_VARS, "9"))
    assert got == {"mmapped": 1, "big_mmapped": 1, "trimmed": False, "caps": ["9", "9"]}
    # An explicit trim threshold wins too; 128 KiB is glibc's default, and then it trims.
    got = _probe("apply", MALLOC_TRIM_THRESHOLD_=str(128 << 10))
    assert got["mmapped"] == 0 and got["trimmed"] is True
