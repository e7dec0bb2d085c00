"""The offline API, with vLLM's names: `LLM(model=...).generate(prompts, sampling_params)`."""

from __future__ import annotations

from pagoda.omp_env import apply_openmp_defaults

# NOTE: this module is the offline API's entrypoint: OpenMP's setting must be in the
# environment before torch loads (see pagoda/omp_env.py).
apply_openmp_defaults()

import itertools
from collections.abc import Sequence
from typing import Any

from tqdm.auto import tqdm

from pagoda.config import EngineArgs
from pagoda.core.request import DEFAULT_SLA_CLASS
from pagoda.engine.gc_heap import frozen_heap
from pagoda.engine.llm_engine import LLMEngine, PromptType
from pagoda.engine.output_processor import OutputKind
from pagoda.entrypoints.chat_template import Message, apply_chat_template
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams


class LLM:
    """Loads a model and generates for batches of prompts with continuous batching."""

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """`kwargs` are EngineArgs fields (vLLM's names); their defaults are EngineArgs'.
        An unknown name raises TypeError naming it."""
        config = EngineArgs(model=model, **kwargs).create_engine_config()
        self.llm_engine = LLMEngine(config)
        self._counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
        sla_class: str | Sequence[str] = DEFAULT_SLA_CLASS,
    ) -> list[RequestOutput]:
        """Generates for every prompt; returns outputs in input order. `priority` (one per
        prompt, lower first) and `sla_class` (one, or one per prompt) matter under the
        "priority" scheduling policy."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError(
                    f"got {len(params_list)} sampling_params for {len(prompts)} prompts"
                )
        priorities = [0] * len(prompts) if priority is None else list(priority)
        classes = [sla_class] * len(prompts) if isinstance(sla_class, str) else list(sla_class)
        if len(priorities) != len(prompts) or len(classes) != len(prompts):
            raise ValueError("priority and sla_class need one entry per prompt")
        return self._run(prompts, params_list, use_tqdm, priorities, classes)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Applies the model's chat template to one conversation or a list of them."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [
            {"prompt_token_ids": apply_chat_template(
                self.get_tokenizer(), conv, chat_template, add_generation_prompt)}
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(
        self,
        prompts: list[PromptType],
        params_list: list[SamplingParams],
        use_tqdm: bool,
        priorities: list[int] | None = None,
        classes: list[str] | None = None,
    ) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list)):
                req_id = str(next(self._counter))
                engine.add_request(
                    req_id, prompt, params, output_kind=OutputKind.FINAL_ONLY,
                    priority=priorities[i] if priorities else 0,
                    sla_class=classes[i] if classes else DEFAULT_SLA_CLASS,
                )
                order[req_id] = i
        except BaseException:
            engine.abort_request(list(order))
            raise
        results: list[RequestOutput | None] = [None] * len(prompts)
        bar = tqdm(total=len(prompts), desc="Processed prompts", disable=not use_tqdm)
        try:
            with frozen_heap():
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            results[order[out.request_id]] = out
                            bar.update(1)
        except BaseException:
            # NOTE: an error or Ctrl-C (KeyboardInterrupt) mid-step leaves the step rolled
            # back (LLMEngine.step); aborting frees every block of this call's requests, so
            # the same LLM serves the next call correctly.
            engine.abort_request(list(order))
            raise
        finally:
            bar.close()
        return results  # type: ignore[return-value]

