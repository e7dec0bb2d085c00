"""pagoda: a small, measured LLM inference and serving engine on PyTorch."""

from pagoda.llm import LLM
from pagoda.outputs import CompletionOutput, Logprob, RequestOutput
from pagoda.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
