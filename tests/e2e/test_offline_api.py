"""The offline API (`LLM.generate` / `LLM.chat`) on a tiny random Llama: input forms, output
shapes, logprobs against transformers, stopping rules, n > 1, and clear errors after which
the engine still works with every KV block back."""

from __future__ import annotations

import itertools
import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from pagoda import LLM, RequestOutput, SamplingParams
from pagoda.models.loader import CheckpointError

VOCAB = 49152
EOS = 2  # the tiny config's and the SmolLM2 tokenizer's eos (<|im_end|>)
MAX_MODEL_LEN = 256
KV_BYTES = 1 << 20  # 128 blocks of 16 tokens for the tiny model
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)


@pytest.fixture(scope="module")
def model_path(tiny_model) -> Path:
    return tiny_model("LlamaForCausalLM")


@pytest.fixture(scope="module")
def llm(model_path: Path) -> LLM:
    return LLM(str(model_path), dtype="float32", kv_cache_memory_bytes=KV_BYTES,
               max_model_len=MAX_MODEL_LEN)


@pytest.fixture(scope="module")
def hf_model(model_path: Path) -> transformers.PreTrainedModel:
    return transformers.AutoModelForCausalLM.from_pretrained(
        model_path, dtype=torch.float32).eval()


@pytest.fixture(autouse=True)
def engine_left_clean(request: pytest.FixtureRequest):
    """After every test that used the shared engine: nothing in flight, every block free."""
    yield
    if "llm" in request.fixturenames:
        assert_clean(request.getfixturevalue("llm"))


def assert_clean(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.check_integrity()
    assert not engine.has_unfinished_requests()
    assert engine.get_num_unfinished_requests() == 0
    assert engine.kv_cache_manager.usage == 0.0


def random_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def decode(llm: LLM, ids: list[int]) -> str:
    return llm.get_tokenizer().decode(ids, skip_special_tokens=True,
                                      clean_up_tokenization_spaces=False)


def gen1(llm: LLM, prompt, params: SamplingParams) -> RequestOutput:
    outs = llm.generate(prompt, params, use_tqdm=False)
    assert len(outs) == 1 and outs[0].finished
    return outs[0]


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row i is log P(next token | ids[: i + 1])."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


# ---- input forms and output shapes -----------------------------------------------------
def test_generate_takes_strings_and_dicts_and_keeps_input_order(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    ids = random_ids(7, seed=0)
    prompts = ["hello world", {"prompt_token_ids": ids}, {"prompt": "the cat sat"}]
    # The first request runs longest, so outputs finish out of input order.
    params = [SamplingParams(temperature=0.0, max_tokens=m) for m in (9, 2, 5)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [
        tok.encode("hello world"), ids, tok.encode("the cat sat")]
    assert [o.prompt for o in outs] == ["hello world", None, "the cat sat"]
    assert len({o.request_id for o in outs}) == 3
    for out, p in zip(outs, params):
        (completion,) = out.outputs
        assert completion.index == 0
        assert len(completion.token_ids) == p.max_tokens
        assert completion.finish_reason == "length" and completion.stop_reason is None
        assert completion.text == decode(llm, completion.token_ids)
        assert completion.logprobs is None and out.prompt_logprobs is None
    # The same prompts alone give the same tokens as in the batch.
    alone = gen1(llm, prompts[1], params[1])
    assert alone.outputs[0].token_ids == outs[1].outputs[0].token_ids


def test_one_params_for_all_and_length_mismatch(llm: LLM) -> None:
    outs = llm.generate(["a", "b", "c"], SamplingParams(temperature=0.0, max_tokens=3),
                        use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 3, 3]
    with pytest.raises(ValueError, match="2 sampling_params for 3 prompts"):
        llm.generate(["a", "b", "c"], [GREEDY, GREEDY], use_tqdm=False)
    assert llm.generate([], GREEDY, use_tqdm=False) == []


def test_chat_applies_template_once(llm: LLM) -> None:
    tok = llm.get_tokenizer()
    conversations = [
        [{"role": "user", "content": "hi there"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    ]
    outs = llm.chat(conversations, GREEDY, use_tqdm=False)
    assert len(outs) == 2
    for out, conv in zip(outs, conversations):
        expected = tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True)
        expected = expected if isinstance(expected, list) else expected["input_ids"]
        assert out.prompt_token_ids == expected
        # No tokenizer BOS in front of the template's own first token.
        assert out.prompt_token_ids[:2] != [tok.bos_token_id] * 2
    single = llm.chat(conversations[0], GREEDY, use_tqdm=False)
    assert single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


# ---- logprobs ----------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.5])
def test_sample_logprobs_match_transformers(llm: LLM, hf_model, temperature: float) -> None:
    k = 3
    prompt = random_ids(12, seed=1)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=6, logprobs=k)
    out = gen1(llm, {"prompt_token_ids": prompt}, params).outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    # NOTE: logprobs are the model's raw distribution, before temperature (vLLM's default).
    ref = hf_logprobs(hf_model, prompt + out.token_ids)[len(prompt) - 1 : -1]
    total = 0.0
    for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert token in entry
        top = ref[step].topk(k)
        top_ids = top.indices.tolist()
        # The sampled token plus the top k, deduplicated when the sampled one is in the top k.
        assert set(entry) == {token, *top_ids}
        assert len(entry) == (k if token in top_ids else k + 1)
        for rank, tid in enumerate(top_ids, start=1):
            assert entry[tid].rank == rank
        assert entry[token].rank == int((ref[step] >= ref[step, token]).sum())
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, ref[step, tid].item(), abs_tol=1e-3)
            assert lp.decoded_token == llm.get_tokenizer().decode([tid])
        total += entry[token].logprob
    if temperature == 0.0:
        assert all(entry[t].rank == 1 for t, entry in zip(out.token_ids, out.logprobs))
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-4)


def test_logprobs_zero_returns_only_the_sampled_token(llm: LLM) -> None:
    out = gen1(llm, "logprobs", SamplingParams(temperature=0.0, max_tokens=3,
                                                logprobs=0)).outputs[0]
    assert [list(e) for e in out.logprobs] == [[t] for t in out.token_ids]


def prompt_logprobs_check(out: RequestOutput, prompt: list[int], hf_model, k: int) -> None:
    lps = out.prompt_logprobs
    assert lps is not None and len(lps) == len(prompt)
    assert lps[0] is None
    ref = hf_logprobs(hf_model, prompt)
    for pos in range(1, len(prompt)):
        entry, token = lps[pos], prompt[pos]
        assert entry is not None, f"prompt position {pos} has no logprobs"
        assert token in entry
        assert set(entry) == {token, *ref[pos - 1].topk(k).indices.tolist()}
        for tid, lp in entry.items():
            assert math.isclose(lp.logprob, ref[pos - 1, tid].item(), abs_tol=1e-3), (pos, tid)


def test_prompt_logprobs_match_transformers(llm: LLM, model_path: Path, hf_model) -> None:
    prompt = random_ids(40, seed=2)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    prompt_logprobs_check(gen1(llm, {"prompt_token_ids": prompt}, params), prompt, hf_model, 2)
    # The same under chunked prefill: the prompt's logprobs arrive in pieces.
    chunked = LLM(str(model_path), dtype="float32", kv_cache_memory_bytes=KV_BYTES,
                  max_model_len=MAX_MODEL_LEN, max_num_batched_tokens=16)
    prompt = random_ids(40, seed=3)
    prompt_logprobs_check(gen1(chunked, {"prompt_token_ids": prompt}, params), prompt,
                          hf_model, 2)
    assert_clean(chunked)


def test_prompt_logprobs_of_a_cached_prompt(llm: LLM, hf_model) -> None:
    prompt = random_ids(40, seed=4)
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=1)
    gen1(llm, {"prompt_token_ids": prompt}, params)
    prompt_logprobs_check(gen1(llm, {"prompt_token_ids": prompt}, params), prompt, hf_model, 1)


# ---- n > 1 -------------------------------------------------------------------------------
def test_n_samples_distinct_and_reproducible_with_seed(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, logprobs=0)
    out = gen1(llm, "tell me a story", params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    samples = [tuple(c.token_ids) for c in out.outputs]
    assert len(set(samples)) == 3, "n samples must be drawn independently"
    for c in out.outputs:
        assert len(c.logprobs) == 6
        assert math.isclose(c.cumulative_logprob,
                            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs)),
                            abs_tol=1e-4)
    again = gen1(llm, "tell me a story", params)
    assert [tuple(c.token_ids) for c in again.outputs] == samples
    greedy = gen1(llm, "tell me a story", SamplingParams(n=2, temperature=0.0, max_tokens=4))
    assert greedy.outputs[0].token_ids == greedy.outputs[1].token_ids


def test_plain_greedy_rows_skip_the_sampling_metadata(llm: LLM, monkeypatch) -> None:
    """Rows whose token is the raw argmax take Sampler.greedy: the same tokens, without
    building the sampling metadata; a row with logprobs, or still short of min_tokens,
    takes the full sampler."""
    from pagoda.layers.sampler import SamplingMetadata

    calls = []
    build = SamplingMetadata.build.__func__
    monkeypatch.setattr(SamplingMetadata, "build",
                        classmethod(lambda cls, *a, **k: calls.append(1) or build(cls, *a, **k)))
    plain = gen1(llm, "hi", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    assert calls == []
    with_logprobs = gen1(llm, "hi", SamplingParams(temperature=0.0, max_tokens=6,
                                                   ignore_eos=True, logprobs=1))
    assert len(calls) == 6
    assert with_logprobs.outputs[0].token_ids == plain.outputs[0].token_ids
    calls.clear()
    late = gen1(llm, "hi", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                          min_tokens=3))
    assert len(calls) == 3  # outputs 0-2: stop tokens are banned there, the full sampler runs
    assert late.outputs[0].token_ids == plain.outputs[0].token_ids


# ---- stopping ----------------------------------------------------------------------------
FORCE_EOS = {EOS: 100.0}


def test_eos_min_tokens_and_ignore_eos(llm: LLM) -> None:
    eos_now = gen1(llm, "hi", SamplingParams(temperature=0.0, max_tokens=8,
                                             logit_bias=FORCE_EOS)).outputs[0]
    assert eos_now.token_ids == [EOS]
    assert (eos_now.finish_reason, eos_now.stop_reason, eos_now.text) == ("stop", None, "")
    late = gen1(llm, "hi", SamplingParams(temperature=0.0, max_tokens=8, min_tokens=3,
                                          logit_bias=FORCE_EOS)).outputs[0]
    assert len(late.token_ids) == 4 and late.token_ids[-1] == EOS
    assert EOS not in late.token_ids[:3]
    assert late.finish_reason == "stop"
    ignored = gen1(llm, "hi", SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True,
                                             logit_bias=FORCE_EOS)).outputs[0]
    assert ignored.token_ids == [EOS] * 5 and ignored.finish_reason == "length"


def baseline(llm: LLM, prompt: str, max_tokens: int = 12) -> list[int]:
    return gen1(llm, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)
                ).outputs[0].token_ids


def test_stop_token_ids(llm: LLM) -> None:
    base = baseline(llm, "stop tokens")
    i = next(i for i in range(2, len(base)) if base[i] not in base[:i])
    out = gen1(llm, "stop tokens", SamplingParams(temperature=0.0, max_tokens=12,
                                                  stop_token_ids=[base[i]])).outputs[0]
    assert out.token_ids == base[: i + 1]
    assert (out.finish_reason, out.stop_reason) == ("stop", base[i])
    # The stop token's own text is not part of the output.
    assert out.text == decode(llm, base[:i])


def token_texts(llm: LLM, ids: list[int]) -> list[str]:
    """The text each token adds to the output."""
    texts = [decode(llm, ids[:j]) for j in range(len(ids) + 1)]
    return [b[len(a):] for a, b in itertools.pairwise(texts)]


def test_stop_strings_across_token_boundaries(llm: LLM) -> None:
    prompt = "stop strings"
    base = baseline(llm, prompt)
    full = decode(llm, base)
    pieces = token_texts(llm, base)
    # A stop string made of the end of token j - 1 and the start of token j.
    for j in range(1, len(base)):
        if len(pieces[j - 1]) >= 2 and len(pieces[j]) >= 2:
            stop = pieces[j - 1][-2:] + pieces[j][:2]
            start = len("".join(pieces[: j - 1])) + len(pieces[j - 1]) - 2
            if full.find(stop) == start:
                break
    else:
        pytest.skip("no token pair suitable for a boundary-spanning stop string")
    out = gen1(llm, prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=["@@@", stop]))
    (c,) = out.outputs
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == full[:start]
    assert c.token_ids == base[: j + 1]
    kept = gen1(llm, prompt, SamplingParams(temperature=0.0, max_tokens=12, stop=[stop],
                                            include_stop_str_in_output=True)).outputs[0]
    assert kept.text == full[: start + len(stop)]
    # A stop string completed by the very last allowed token still counts as the stop.
    last = gen1(llm, prompt, SamplingParams(temperature=0.0, max_tokens=j + 1, stop=[stop]))
    assert (last.outputs[0].finish_reason, last.outputs[0].stop_reason) == ("stop", stop)
    assert last.outputs[0].text == full[:start]


# ---- errors ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"temperature": -1.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"n": 0}, "n must be"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"stop": [""]}, "stop strings"),
        ({"logprobs": -1}, "logprobs"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_bad_sampling_params_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    ("prompt", "params", "match"),
    [
        ("", GREEDY, "prompt is empty"),
        ({"prompt_token_ids": []}, GREEDY, "prompt is empty"),
        ({"prompt_token_ids": [5, VOCAB]}, GREEDY, f"token id {VOCAB} is outside"),
        ({"prompt_token_ids": [5, -1]}, GREEDY, "token id -1 is outside"),
        ({"tokens": [5]}, GREEDY, "'prompt' or 'prompt_token_ids'"),
        ({"prompt_token_ids": [5] * 200}, SamplingParams(max_tokens=100), "exceeds max_model_len"),
        ({"prompt_token_ids": [5] * MAX_MODEL_LEN}, GREEDY, "no room to generate"),
        ("x", SamplingParams(logprobs=21), "logprobs must be at most 20"),
        ("x", SamplingParams(prompt_logprobs=21), "prompt_logprobs must be at most 20"),
        ("x", SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias token id"),
        ("x", SamplingParams(stop_token_ids=[VOCAB]), "stop_token_ids token id"),
    ],
    ids=["empty-text", "empty-ids", "id-too-big", "id-negative", "bad-dict", "too-long",
         "prompt-fills-context", "logprobs", "prompt-logprobs", "logit-bias", "stop-ids"],
)
def test_bad_requests_raise_and_engine_recovers(llm: LLM, prompt, params, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        llm.generate(prompt, params, use_tqdm=False)
    assert_clean(llm)
    # A bad request in a batch takes nothing else down with it and leaves nothing queued.
    with pytest.raises(ValueError, match=match):
        llm.generate(["fine", prompt], [GREEDY, params], use_tqdm=False)
    assert_clean(llm)
    assert len(gen1(llm, "still works", GREEDY).outputs[0].token_ids) == GREEDY.max_tokens


def test_duplicate_request_id_rejected(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("dup", "x", GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", "y", GREEDY)
    engine.abort_request("dup")


def with_architecture(src: Path, dst: Path, arch: str) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["architectures"] = [arch]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_bad_engine_configs_raise(llm: LLM, model_path: Path, tmp_path: Path) -> None:
    bad_arch = with_architecture(model_path, tmp_path / "bad_arch", "FooForCausalLM")
    with pytest.raises(ValueError, match=r"unsupported architecture \['FooForCausalLM'\]"):
        LLM(str(bad_arch), dtype="float32", kv_cache_memory_bytes=KV_BYTES)
    with pytest.raises(CheckpointError, match="no such file"):
        LLM(str(tmp_path / "missing"), dtype="float32")
    # 1/16 MiB holds 8 blocks of 16 tokens, 7 usable past the null block: the message
    # names the 112 tokens that would fit.
    with pytest.raises(ValueError, match="largest max_model_len that fits is 112"):
        LLM(str(model_path), dtype="float32", kv_cache_memory_bytes=1 << 16)
    with pytest.raises(ValueError, match="max_position_embeddings 512"):
        LLM(str(model_path), dtype="float32", max_model_len=1024)
    # Without chunked prefill a prompt longer than the step budget could never run.
    with pytest.raises(ValueError, match="max_num_batched_tokens 64 is smaller"):
        LLM(str(model_path), dtype="float32", kv_cache_memory_bytes=KV_BYTES,
            enable_chunked_prefill=False, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="dtype"):
        LLM(str(model_path), dtype="float64")
    assert len(gen1(llm, "still works", GREEDY).outputs[0].token_ids) == GREEDY.max_tokens


def test_abort_mid_run_frees_blocks(llm: LLM) -> None:
    engine = llm.llm_engine
    engine.add_request("doomed", {"prompt_token_ids": random_ids(40, seed=5)},
                       SamplingParams(temperature=0.0, max_tokens=50))
    engine.add_request("kept", "a survivor", SamplingParams(temperature=0.0, max_tokens=8))
    for _ in range(3):
        engine.step()
    engine.check_integrity()
    assert engine.kv_cache_manager.usage > 0
    (aborted,) = engine.abort_request("doomed")
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert len(aborted.outputs[0].token_ids) == 3
    engine.check_integrity()
    assert engine.kv_cache_manager.get_block_ids("doomed") == []
    assert engine.abort_request("doomed") == []  # unknown ids are ignored
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            final = out if out.finished else final
    assert final is not None and final.request_id == "kept"
    assert len(final.outputs[0].token_ids) == 8
    assert final.outputs[0].finish_reason == "length"
    assert "doomed" not in engine.executor.worker.runner.input_batch.req_id_to_slot



def test_streaming_deltas_report_each_finish_once(llm: LLM) -> None:
    """DELTA mode with n > 1: a sample that finished earlier is not repeated in later deltas."""
    from pagoda.core.request import RequestStatus
    from pagoda.core.scheduler import EngineCoreOutput
    from pagoda.engine.output_processor import OutputKind, OutputProcessor

    proc = OutputProcessor(llm.get_tokenizer())
    params = SamplingParams(n=2, max_tokens=5)
    proc.add_request("r", None, [5, 6, 7], params, ["r#0", "r#1"], OutputKind.DELTA, 0.0)
    sched = type("S", (), {"requests": {}})()
    outs, _ = proc.process(
        [EngineCoreOutput("r#0", [100], finish_status=RequestStatus.FINISHED_LENGTH),
         EngineCoreOutput("r#1", [101])], sched)
    assert [(c.index, c.finish_reason) for c in outs[0].outputs] == [(0, "length"), (1, None)]
    outs, _ = proc.process([EngineCoreOutput("r#1", [102])], sched)
    assert [(c.index, c.token_ids) for c in outs[0].outputs] == [(1, [102])]
    outs, _ = proc.process(
        [EngineCoreOutput("r#1", [103], finish_status=RequestStatus.FINISHED_LENGTH)], sched)
    assert [(c.index, c.finish_reason) for c in outs[0].outputs] == [(1, "length")]
    assert outs[0].finished and "r" not in proc.requests


def test_out_of_range_seed_is_refused_before_anything_is_queued(llm: LLM) -> None:
    # NOTE: generators are made in the runner; a seed it cannot take must fail at add time,
    # not inside a step (which would fail every request of the batch).
    with pytest.raises(ValueError, match="seed"):
        llm.generate(["hi"], SamplingParams(max_tokens=2, seed=2**64))
    engine = llm.llm_engine
    assert engine.get_num_unfinished_requests() == 0
    assert not engine.output_processor.requests
    out = llm.generate(["hi"], SamplingParams(max_tokens=2, seed=2**63 - 1))
    assert len(out[0].outputs[0].token_ids) == 2
