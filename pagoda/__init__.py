"""pagoda: a small, measured LLM inference and serving engine on PyTorch."""

import os

# NOTE: torch's OpenMP threads spin at every barrier by default. On a small machine where
# anything else wants a core (the HTTP event loop, a benchmark client, a second process)
# a spinning thread starves the one it waits for, and steps get 10-30x slower (measured:
# a 32-request decode step 1,726 ms spinning vs 55 ms passive under load). Passive waiting
# must be chosen before torch loads its OpenMP runtime, so it is set here, before any
# torch import; an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pagoda.llm import LLM
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
