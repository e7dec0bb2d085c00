"""OutputProcessor with a step that returns several tokens per request (the runner's list
contract): logprobs stay aligned one-to-one with the tokens, and a stop string that
completes in the middle of the step cuts the tokens (and logprobs) after it."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import transformers

from pagoda.core.scheduler_output import EngineCoreOutput
from pagoda.engine.output_processor import OutputKind, OutputProcessor
from pagoda.sampling_params import SamplingParams


def run_one_step(tokenizer_dir: Path, params: SamplingParams, text: str):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, [1], params, ["r"], OutputKind.FINAL_ONLY, 0.0)
    ids = tokenizer.encode(text, add_special_tokens=False)
    lps = [([t], [-0.5 * (i + 1)], 1) for i, t in enumerate(ids)]
    core = [EngineCoreOutput("r", ids, new_logprobs=lps)]
    outputs, stopped = processor.process(core, SimpleNamespace(requests={}))
    return ids, outputs, stopped, processor


def test_several_tokens_with_aligned_logprobs(tokenizer_dir: Path) -> None:
    params = SamplingParams(max_tokens=10, logprobs=0)
    ids, outputs, stopped, processor = run_one_step(tokenizer_dir, params, " one two three")
    assert not outputs and not stopped  # not finished (FINAL_ONLY)
    sample = processor.requests["r"].samples[0]
    assert sample.token_ids == ids and len(ids) >= 3
    assert [next(iter(d)) for d in sample.logprobs] == ids
    assert sample.cumulative_logprob == sum(-0.5 * (i + 1) for i in range(len(ids)))


def test_stop_string_mid_step_cuts_the_later_tokens(tokenizer_dir: Path) -> None:
    params = SamplingParams(max_tokens=10, logprobs=0, stop=["two"])
    ids, outputs, stopped, _ = run_one_step(tokenizer_dir, params, " one two three four")
    assert stopped == ["r"]
    (out,) = outputs
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == "two"
    assert completion.text == " one "
    # " one", " two" are kept; " three", " four" came in the same step after the stop.
    assert completion.token_ids == ids[:2]
    assert [next(iter(d)) for d in completion.logprobs] == ids[:2]
