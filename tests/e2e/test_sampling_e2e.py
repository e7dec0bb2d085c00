"""Random sampling through the whole engine: a seeded request is reproducible and does not
depend on what else is in its batch; seeds and unseeded runs vary."""

from __future__ import annotations

import random

import pytest

from pagoda import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [101, 2024, 77, 9000, 345, 12, 4242]}
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model("LlamaForCausalLM")), dtype="float32",
               kv_cache_memory_bytes=1 << 20, max_model_len=256)


@pytest.fixture(autouse=True)
def engine_left_clean(llm: LLM):
    yield
    engine = llm.llm_engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache_manager.usage == 0.0


def seeded(seed: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.9, seed=seed, max_tokens=MAX_TOKENS, **kwargs)


def tokens(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def others(n: int, seed: int) -> tuple[list, list[SamplingParams]]:
    """`n` random requests exercising every sampler path: greedy, unseeded, other seeds,
    top-k / top-p / min-p, penalties, logprobs, and prompts long and short."""
    rng = random.Random(seed)
    prompts, params = [], []
    for i in range(n):
        prompts.append({"prompt_token_ids": [rng.randrange(3, 49152)
                                             for _ in range(rng.randint(2, 60))]})
        params.append(SamplingParams(
            temperature=[0.0, 0.7, 1.3][i % 3],
            seed=rng.randrange(1000) if i % 2 else None,
            top_k=[0, 5, 50][i % 3],
            top_p=[1.0, 0.9][i % 2],
            min_p=[0.0, 0.05][i % 2],
            repetition_penalty=[1.0, 1.2][i % 2],
            frequency_penalty=[0.0, 0.5][i % 2],
            logprobs=[None, 2][i % 2],
            max_tokens=rng.randint(1, 2 * MAX_TOKENS),
        ))
    return prompts, params


def test_seeded_sampling_is_reproducible(llm: LLM) -> None:
    first = tokens(llm, [PROMPT], [seeded(123)])
    assert tokens(llm, [PROMPT], [seeded(123)]) == first
    assert len(first[0]) == MAX_TOKENS


def test_seeded_sampling_is_independent_of_the_batch(llm: LLM) -> None:
    alone = tokens(llm, [PROMPT], [seeded(123)])[0]
    prompts, params = others(10, seed=0)
    # In the middle of the batch, so it is neither the first nor the last row.
    prompts.insert(5, PROMPT)
    params.insert(5, seeded(123))
    assert tokens(llm, prompts, params)[5] == alone
    # Also when its prefill is split into chunks between other requests' decodes.
    chunked = LLM(llm.llm_engine.model_path, dtype="float32", kv_cache_memory_bytes=1 << 20,
                  max_model_len=256, max_num_batched_tokens=5)
    assert tokens(chunked, prompts, params)[5] == alone


def test_different_seeds_differ(llm: LLM) -> None:
    outs = tokens(llm, [PROMPT] * 3, [seeded(1), seeded(2), seeded(3)])
    assert len({tuple(t) for t in outs}) == 3


def test_unseeded_sampling_varies(llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS)
    runs = tokens(llm, [PROMPT] * 2, [params] * 2) + tokens(llm, [PROMPT], [params])
    assert len({tuple(t) for t in runs}) == 3


def test_top_k_one_is_greedy(llm: LLM) -> None:
    greedy = tokens(llm, [PROMPT], [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)])
    assert tokens(llm, [PROMPT], [seeded(5, top_k=1)]) == greedy
