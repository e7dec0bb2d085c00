"""Process memory settings pagoda wants, applied with the OpenMP ones (`omp_env.py`: the
entrypoints before torch loads, and engine start), never by `import pagoda`.

NOTE (docs/memory.md has the measurements): a server's steps have ever-new token counts,
and every new GEMM shape makes oneDNN and torch's ideep layer each cache a primitive
(~0.4 MB apiece, 1,024 entries each by default); their churn, interleaved with large
short-lived activations, also fragments glibc's heaps once its mmap threshold has risen to
the activations' size (its default: it follows the largest freed mmapped chunk up to
32 MiB). Measured: 300 new token counts grew RSS by ~700 MB (+370 MB even after
malloc_trim), the next 300 by another ~4 GB; with these settings +42 MB and then nothing.
A setting in the environment wins; glibc reads its own variables at process start, so
the mmap threshold is set through mallopt, which applies at once.
"""

from __future__ import annotations

import ctypes
import os

# Entries per cache: a decode-heavy server repeats ~5 shapes per batch size (the four
# per-layer GEMMs and the LM head), so this keeps ~25 recent batch sizes.
GEMM_CACHE_CAPACITY = "128"
CACHE_CAPACITY_VARS = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
# NOTE: fixed at the top of glibc's own dynamic range (it raises the threshold to each freed
# mmapped block up to 32 MiB), but from the first step on, and without the trim threshold
# falling back to 128 KiB (below). Above it a block is mmapped at every allocation and
# every page is faulted in and zeroed again: at 4 MiB a 2,048-token step's GEMM outputs
# (SmolLM2's gate_up: 12 MiB) and a 64-row step's logits (12 MiB) were, which cost a
# third of the short offline workload's time (docs/memory.md).
MMAP_THRESHOLD_BYTES = 32 << 20
# NOTE: a fixed mmap threshold also stops glibc's dynamic trim threshold, which then stays
# at 128 KiB: every free that leaves more than that at the heap's top gives the pages back,
# and the next step faults them in again (a served c=1 prefill: ~14,000 minor faults a
# request, +10-15% time to first token). Keeping up to 256 MiB of free top bounds RSS the
# same way and ends the churn (docs/memory.md).
TRIM_THRESHOLD_BYTES = 256 << 20
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
_M_MMAP_THRESHOLD = -3
_mallopt_done = False


def apply_memory_defaults() -> None:
    """Cap the GEMM primitive caches (unless the environment sets them) for oneDNN and
    ideep, which read them at their first primitive, and fix glibc's mmap and trim
    thresholds (each unless MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_ or
    GLIBC_TUNABLES chose it; no-op off glibc)."""
    global _mallopt_done
    for var in CACHE_CAPACITY_VARS:
        os.environ.setdefault(var, GEMM_CACHE_CAPACITY)
    if _mallopt_done:
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    tunables = os.environ.get("GLIBC_TUNABLES", "")
    for env, tunable, param, value in (
            ("MALLOC_MMAP_THRESHOLD_", "mmap_threshold", _M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
            ("MALLOC_TRIM_THRESHOLD_", "trim_threshold", _M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        if env not in os.environ and tunable not in tunables:
            libc.mallopt(param, value)
    _mallopt_done = True
