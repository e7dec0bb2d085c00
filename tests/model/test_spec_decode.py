"""Speculative decoding on real models, greedy float32: output identical with speculation
on and off (tiny Llama built with transformers, the embedded SmolLM2 GGUF), alone and
batched with requests that do not speculate, with prefix caching, chunked prefill, forced
preemption and n > 1; with proposers that are always right, always wrong and half right
(every rollback path through the real runner); check_integrity after every step."""

from __future__ import annotations

import random
from typing import ClassVar

import numpy as np
import pytest

from pagoda import LLM, SamplingParams
from pagoda.spec_decode import proposer as proposer_mod
from pagoda.spec_decode.proposer import Proposer
from pagoda.worker.input_batch import InputBatch

MAX_TOKENS = 24
SMALL_VOCAB = 64  # NOTE: greedy output of a random model soon cycles: ngram drafts hit
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
         "prompt_lookup_min": 1, "adaptive": False}


def prompts_for(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        span = [rng.randrange(3, vocab) for _ in range(rng.randint(2, 6))]
        out.append(span * rng.randint(1, 4) + [rng.randrange(3, vocab)
                                               for _ in range(rng.randint(0, 20))])
    return out


def run(path, prompts, params=None, **engine_kwargs):
    """Step by step with check_integrity after every step; token ids per prompt (per
    sample), and the engine's stats."""
    llm = LLM(str(path), dtype="float32", **engine_kwargs)
    engine = llm.llm_engine
    params = params or SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": p}, params)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = [c.token_ids for c in out.outputs]
        engine.check_integrity()
    assert engine.kv_cache_manager.usage == 0.0
    return [finished[str(i)] for i in range(len(prompts))], engine.get_stats()


@pytest.fixture(scope="module")
def small(tiny_model):
    path = tiny_model("LlamaForCausalLM", vocab_size=SMALL_VOCAB)
    prompts = prompts_for(SMALL_VOCAB, 12, seed=3)
    expected, _ = run(path, prompts)
    return path, prompts, expected


def test_ngram_greedy_identical_and_drafts_accepted(small) -> None:
    path, prompts, expected = small
    got, stats = run(path, prompts, speculative_config=NGRAM)
    assert got == expected
    assert stats.spec_decode_num_accepted_tokens > 0
    assert stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_ngram_alone(small) -> None:
    path, prompts, expected = small
    for p, e in zip(prompts[:3], expected[:3]):
        assert run(path, [p], speculative_config=NGRAM)[0] == [e]


@pytest.mark.parametrize("engine_kwargs", [
    {"enable_prefix_caching": False},
    {"max_num_batched_tokens": 7},  # chunked prefill; the budget also cuts k
    {"num_gpu_blocks_override": 10, "max_model_len": 96},  # forced preemption
    {"num_gpu_blocks_override": 10, "max_model_len": 96, "preemption_mode": "swap"},
])
def test_ngram_greedy_identical_under_engine_options(small, engine_kwargs) -> None:
    path, prompts, expected = small
    got, stats = run(path, prompts, speculative_config=NGRAM, **engine_kwargs)
    assert got == expected
    if "num_gpu_blocks_override" in engine_kwargs:
        assert stats.num_preemptions > 0


def test_shared_prefixes_with_prefix_caching(small) -> None:
    path, prompts, _ = small
    shared = [prompts[0] * 3 + p for p in prompts[:6]]
    # NOTE: two at a time, so that later requests find the earlier ones' registered blocks.
    expected, _ = run(path, shared, max_num_seqs=2)
    got, stats = run(path, shared, speculative_config=NGRAM, max_num_seqs=2)
    assert got == expected
    assert stats.prefix_cache_hits > 0


def test_n_greater_than_one(small) -> None:
    path, prompts, _ = small
    params = SamplingParams(n=3, temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected, _ = run(path, prompts[:4], params)
    got, _ = run(path, prompts[:4], params, speculative_config=NGRAM)
    assert got == expected


def test_batched_with_requests_that_do_not_speculate(tiny_model) -> None:
    """Full vocabulary: these random prompts rarely repeat, so most rows never get a
    draft while the repeating ones do."""
    path = tiny_model("LlamaForCausalLM")
    rng = random.Random(9)
    plain = [[rng.randrange(3, 49152) for _ in range(rng.randint(3, 40))] for _ in range(6)]
    looping = [[5, 6, 7, 8] * 6]
    expected, _ = run(path, plain + looping)
    got, stats = run(path, plain + looping, speculative_config=NGRAM)
    assert got == expected
    assert stats.spec_decode_num_drafts > 0


class _Oracle(Proposer):
    """Proposes from known greedy continuations: `mode` right (all accepted), wrong (all
    rejected) or half (the first draft right, the rest wrong)."""

    continuations: ClassVar[dict[tuple[int, ...], list[int]]] = {}
    mode = "right"

    def propose(self, batch: InputBatch, slots: np.ndarray, num_tokens: int) -> list[list[int]]:
        out = []
        for slot in slots.tolist():
            history = batch.token_ids[slot, : batch.num_tokens[slot]].tolist()
            full = next(c for p, c in self.continuations.items()
                        if history[: len(p)] == list(p))
            nxt = full[len(history) : len(history) + num_tokens]
            if self.mode == "wrong":
                nxt = [(t + 1) % SMALL_VOCAB for t in nxt]
            elif self.mode == "half":
                nxt = nxt[:1] + [(t + 1) % SMALL_VOCAB for t in nxt[1:]]
            out.append(nxt)
        return out


@pytest.mark.parametrize("mode", ["right", "wrong", "half"])
@pytest.mark.parametrize("engine_kwargs", [{}, {"num_gpu_blocks_override": 10,
                                                "max_model_len": 96}])
def test_rollback_paths_through_the_runner(small, monkeypatch, mode, engine_kwargs) -> None:
    path, prompts, expected = small
    monkeypatch.setitem(proposer_mod.PROPOSERS, "oracle", _Oracle)
    monkeypatch.setattr(_Oracle, "continuations",
                        {tuple(p): p + e[0] for p, e in zip(prompts, expected)})
    monkeypatch.setattr(_Oracle, "mode", mode)
    got, stats = run(path, prompts, speculative_config={
        "method": "oracle", "num_speculative_tokens": 3, "adaptive": False}, **engine_kwargs)
    assert got == expected
    accepted, drafted = stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_draft_tokens
    assert drafted > 0
    if mode == "right" and not engine_kwargs:
        assert accepted == drafted
    elif mode == "wrong":
        assert accepted == 0
    elif mode == "half":
        assert 0 < accepted < drafted


@pytest.fixture(scope="module")
def smollm2_expected() -> list[int]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return LLM(dtype="float32").generate(SMOLLM2_PROMPT, params,
                                         use_tqdm=False)[0].outputs[0].token_ids


SMOLLM2_PROMPT = ("Repeat this list exactly: apple, banana, cherry, date, elderberry, fig, "
                  "grape. Again: apple, banana, cherry, date,")


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_smollm2_gguf_greedy_identical(smollm2_expected, method) -> None:
    from pagoda.models.loader import default_model_path

    # NOTE: the embedded GGUF is the only small model at hand: as its own draft.
    spec = NGRAM if method == "ngram" else draft_config(default_model_path())
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(dtype="float32", speculative_config=spec)
    got = llm.generate(SMOLLM2_PROMPT, params, use_tqdm=False)[0].outputs[0].token_ids
    assert got == smollm2_expected
    stats = llm.llm_engine.get_stats()
    assert stats.spec_decode_num_accepted_tokens > 0
    llm.llm_engine.check_integrity()


def draft_config(path) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3,
            "adaptive": False}


@pytest.mark.parametrize("draft", ["itself", "one_layer"])
def test_draft_model_greedy_identical(small, tiny_model, draft) -> None:
    path, prompts, expected = small
    draft_path = path if draft == "itself" else tiny_model(
        "LlamaForCausalLM", vocab_size=SMALL_VOCAB, num_hidden_layers=1)
    llm_kwargs = {"speculative_config": draft_config(draft_path),
                  "num_gpu_blocks_override": 10, "max_model_len": 96}
    got, stats = run(path, prompts, **llm_kwargs)
    assert got == expected
    assert stats.num_preemptions > 0
    if draft == "itself":
        # The target as its own draft: every draft is the target's greedy token.
        assert stats.spec_decode_num_accepted_tokens == stats.spec_decode_num_draft_tokens > 0
    else:
        assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens


def test_draft_model_frees_its_kv_when_requests_end(small) -> None:
    path, prompts, _ = small
    llm = LLM(str(path), dtype="float32", speculative_config=draft_config(path))
    proposer = llm.llm_engine.executor.worker.runner.proposer
    free_before = proposer.num_free_blocks
    llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                 SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert proposer.states
    # NOTE: the runner hears of finished requests with the next step (as for its slots).
    llm.llm_engine.step()
    assert not proposer.states and proposer.num_free_blocks == free_before


def test_draft_vocabulary_mismatch_refused_at_start(small, tiny_model) -> None:
    path, _, _ = small
    other = tiny_model("LlamaForCausalLM")  # 49152 tokens against 64
    with pytest.raises(ValueError, match=r"speculative_config\.model: the draft's vocabulary"):
        LLM(str(path), dtype="float32", speculative_config=draft_config(other))


def test_draft_shorter_than_max_model_len_refused_at_start(small, tiny_model) -> None:
    path, _, _ = small
    short = tiny_model("LlamaForCausalLM", vocab_size=SMALL_VOCAB, max_position_embeddings=64)
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*max_position_embeddings"):
        LLM(str(path), dtype="float32", speculative_config=draft_config(short))


@pytest.mark.parametrize("arch", ["MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"])
def test_other_architectures_greedy_identical(tiny_model, monkeypatch, arch) -> None:
    path = tiny_model(arch, vocab_size=SMALL_VOCAB)
    prompts = prompts_for(SMALL_VOCAB, 4, seed=11)
    expected, _ = run(path, prompts)
    monkeypatch.setitem(proposer_mod.PROPOSERS, "oracle", _Oracle)
    monkeypatch.setattr(_Oracle, "continuations",
                        {tuple(p): p + e[0] for p, e in zip(prompts, expected)})
    monkeypatch.setattr(_Oracle, "mode", "half")
    got, stats = run(path, prompts, speculative_config={
        "method": "oracle", "num_speculative_tokens": 3, "adaptive": False})
    assert got == expected
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert run(path, prompts, speculative_config=NGRAM)[0] == expected
