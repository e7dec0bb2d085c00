"""The OpenMP runtime setting pagoda wants, applied by the entrypoints (the CLI, the offline
`LLM` module, the server) and at engine start, never by `import pagoda`.

NOTE: torch's OpenMP threads spin at every barrier for a long time by default. On a small
machine where anything else wants a core (the HTTP event loop, a benchmark client, another
process) a spinning thread starves the one it waits for. Measured here, a 32-request decode
step: spinning 40 ms idle but 1,726 ms with one other busy process; fully passive 54 ms in
both cases; a short spin (3,000) 42 ms idle and 77 ms loaded. libgomp reads GOMP_SPINCOUNT
once, when torch loads it (checked: set after `import torch` it changes nothing), so an
entrypoint applies this before it imports torch; an explicit GOMP_SPINCOUNT or
OMP_WAIT_POLICY in the environment wins. This module must not import torch.
"""

from __future__ import annotations

import os
import sys

from pagoda.memory_env import apply_memory_defaults

GOMP_SPINCOUNT = "3000"


def apply_openmp_defaults() -> bool:
    """Set GOMP_SPINCOUNT unless the environment chose a wait policy or spin count.
    Returns whether OpenMP in this process will see the environment's setting, i.e.
    torch was not loaded yet (child processes see it either way)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)
    # NOTE: the GEMM caches' caps, read like this one before first use (pagoda/memory_env.py).
    apply_memory_defaults()
    return "torch" not in sys.modules
