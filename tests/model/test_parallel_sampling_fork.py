"""n > 1 samples fork the first sample's prompt KV (copy-on-write of its partly filled last
block): outputs are those of separate requests (greedy, and seeded sampling with seed + i),
with prefix caching off, where nothing else could share. Tiny float32 model."""

from __future__ import annotations

import pytest

from pagoda import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_model) -> LLM:
    return LLM(str(tiny_model("LlamaForCausalLM")), dtype="float32", max_model_len=256,
               enable_prefix_caching=False)


# 37 tokens: two full blocks of 16 shared, the third (5 tokens) copied by each fork.
PROMPT = {"prompt_token_ids": list(range(300, 337))}


def test_greedy_samples_equal_one_request(llm: LLM) -> None:
    one = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12,
                                                ignore_eos=True), use_tqdm=False)[0]
    three = llm.generate([PROMPT], SamplingParams(n=3, temperature=0, max_tokens=12,
                                                  ignore_eos=True), use_tqdm=False)[0]
    want = one.outputs[0].token_ids
    assert len(want) == 12
    assert [c.token_ids for c in three.outputs] == [want] * 3
    llm.llm_engine.scheduler.check_integrity()
    assert llm.llm_engine.scheduler.kv.usage == 0.0


def test_seeded_samples_equal_separate_seeded_requests(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    together = llm.generate([PROMPT], params, use_tqdm=False)[0]
    separate = llm.generate(
        [PROMPT] * 3,
        [SamplingParams(temperature=1.0, seed=11 + i, max_tokens=10, ignore_eos=True)
         for i in range(3)],
        use_tqdm=False,
    )
    assert [c.token_ids for c in together.outputs] == [s.outputs[0].token_ids
                                                      for s in separate]
    assert len({tuple(c.token_ids) for c in together.outputs}) == 3  # really sampled


def test_forks_hold_fewer_blocks(llm: LLM) -> None:
    """Peak KV blocks: each sequence stores 37 + 11 = 48 tokens (3 blocks of 16); n = 4
    forks share the first 2: 2 + 4 x 1 = 6, against 4 x 3 = 12 for four separate requests
    (no prefix caching)."""
    kv = llm.llm_engine.scheduler.kv
    sp = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
    kv.reset_peak_num_used_blocks()
    llm.generate([PROMPT], SamplingParams(n=4, **sp), use_tqdm=False)
    peak_n = kv.peak_num_used_blocks
    kv.reset_peak_num_used_blocks()
    llm.generate([PROMPT] * 4, SamplingParams(**sp), use_tqdm=False)
    assert (peak_n, kv.peak_num_used_blocks) == (6, 12)
