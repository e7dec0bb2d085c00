"""Speculative decoding with sampling and the output-side contracts, on real models: the
distribution of the first and second generated token equals the target's (transformers
as the oracle) on a tiny-vocabulary model, and a broken acceptance rule fails that check;
seeded requests are reproducible; logprobs and stop strings match speculation off."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagoda import LLM, SamplingParams
from pagoda.layers import rejection_sampler as rs

VOCAB = 8
# NOTE: after either likely first token (3 or 7) the prompt holds a match: a draft.
PROMPT = [3] * 8 + [7] * 8
NUM_SAMPLES = 3000
# NOTE: the tolerance on the total variation distance between the sampled and the exact
# marginal of each token (8 cells): with 3000 samples a correct sampler's expected TV is
# at most 0.4 * sum sqrt(p / N) <= 0.021; measured 0.011, the broken rules 0.13 and 0.19.
TV_TOLERANCE = 0.05
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "adaptive": False}


def exact_marginals(path) -> tuple[torch.Tensor, torch.Tensor]:
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        p1 = model(torch.tensor([PROMPT])).logits[0, -1].softmax(-1)
        seqs = torch.tensor([[*PROMPT, t] for t in range(VOCAB)])
        p2_given = model(seqs).logits[:, -1].softmax(-1)  # [t1, t2]
    return p1, p1 @ p2_given


def sampled_marginals(path, **engine_kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    llm = LLM(str(path), dtype="float32", max_num_seqs=256, **engine_kwargs)
    # NOTE: 3 tokens, so that the second one comes from verifying a draft (with 2, the
    # scheduler cuts k to 0: the step may emit only one more token).
    params = SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_SAMPLES, params, use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outs])
    llm.llm_engine.check_integrity()
    stats = llm.llm_engine.get_stats()
    if "speculative_config" in engine_kwargs:
        assert stats.spec_decode_num_draft_tokens > NUM_SAMPLES / 3
    return tuple(torch.bincount(tokens[:, i], minlength=VOCAB) / NUM_SAMPLES for i in (0, 1))


def tv(p: torch.Tensor, q: torch.Tensor) -> float:
    return float((p - q).abs().sum() / 2)


@pytest.fixture(scope="module")
def tiny_vocab(tiny_model):
    path = tiny_model("LlamaForCausalLM", vocab_size=VOCAB, bos_token_id=0, eos_token_id=1,
                      pad_token_id=1)
    return path, exact_marginals(path)


def test_first_and_second_token_follow_the_target(tiny_vocab) -> None:
    path, (p1, p2) = tiny_vocab
    s1, s2 = sampled_marginals(path, speculative_config=NGRAM)
    assert tv(s1, p1) < TV_TOLERANCE and tv(s2, p2) < TV_TOLERANCE, (tv(s1, p1), tv(s2, p2))


def _always_accept(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(p)


def _accept_half_as_often(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p / q).clamp(max=1.0) / 2


@pytest.mark.parametrize("broken", [_always_accept, _accept_half_as_often])
def test_a_broken_acceptance_rule_fails_the_check(tiny_vocab, monkeypatch, broken) -> None:
    path, (_, p2) = tiny_vocab
    monkeypatch.setattr(rs, "acceptance_probs", broken)
    _, s2 = sampled_marginals(path, speculative_config=NGRAM)
    assert tv(s2, p2) > TV_TOLERANCE, tv(s2, p2)


def test_seeded_requests_reproducible_with_speculation(tiny_vocab) -> None:
    path, _ = tiny_vocab
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=20,
                             ignore_eos=True) for s in range(6)]
    runs = []
    for _ in range(2):
        llm = LLM(str(path), dtype="float32", speculative_config=NGRAM)
        outs = llm.generate([{"prompt_token_ids": PROMPT}] * 6, params, use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
    assert runs[0] == runs[1]
    # Alone, the seeded request draws the same stream as in the batch.
    alone = llm.generate({"prompt_token_ids": PROMPT}, params[3], use_tqdm=False)
    assert alone[0].outputs[0].token_ids == runs[0][3]


def test_logprobs_and_stop_strings_match_speculation_off() -> None:
    prompt = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, "
              "grape. Again: apple, banana,")
    params = [SamplingParams(temperature=0.0, max_tokens=24, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=24, stop=["elderberry"]),
              SamplingParams(temperature=0.0, max_tokens=5)]
    results = []
    for spec in (None, NGRAM):
        llm = LLM(dtype="float32", speculative_config=spec)
        results.append(llm.generate([prompt] * 3, params, use_tqdm=False))
        stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    off, on = results
    for a, b in zip(off, on):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        assert a.outputs[0].finish_reason == b.outputs[0].finish_reason
    assert on[1].outputs[0].finish_reason == "stop" and "elderberry" not in on[1].outputs[0].text
    assert len(on[2].outputs[0].token_ids) == 5
    for lp_off, lp_on in zip(off[0].outputs[0].logprobs, on[0].outputs[0].logprobs):
        assert lp_off.keys() == lp_on.keys()
        for t in lp_off:
            assert lp_on[t].logprob == pytest.approx(lp_off[t].logprob, abs=1e-4)
            assert lp_on[t].rank == lp_off[t].rank
