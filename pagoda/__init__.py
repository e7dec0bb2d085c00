"""pagoda: a small, measured LLM inference and serving engine on PyTorch."""

import os

# NOTE: torch's OpenMP threads spin at every barrier for a long time by default. On a small
# machine where anything else wants a core (the HTTP event loop, a benchmark client, another
# process) a spinning thread starves the one it waits for. Measured here, a 32-request decode
# step: spinning 40 ms idle but 1,726 ms with one other busy process; fully passive 54 ms in
# both cases; a short spin (3,000) 42 ms idle and 77 ms loaded. The spin count must be set
# before torch loads its OpenMP runtime, so it is set here, before any torch import; an
# explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY in the environment wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "3000")

from pagoda.llm import LLM
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
