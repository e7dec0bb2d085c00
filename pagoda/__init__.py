"""pagoda: a small, measured LLM inference and serving engine on PyTorch.

Importing the package loads nothing heavy and leaves the process environment alone: the
names below are imported on first use (the entrypoints set OpenMP up before torch loads,
see pagoda/omp_env.py).
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "pagoda.llm",
    "CompletionOutput": "pagoda.outputs",
    "Logprob": "pagoda.outputs",
    "RequestOutput": "pagoda.outputs",
    "SamplingParams": "pagoda.sampling_params",
    "EngineArgs": "pagoda.config",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'pagoda' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
