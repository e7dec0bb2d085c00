"""The embedded SmolLM2-135M-Instruct GGUF end to end: pagoda's batched greedy chat replies
match transformers (loading the same GGUF, float32) token for token, and answer sensibly."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagoda import LLM, RequestOutput, SamplingParams
from pagoda.models.loader import default_model_path

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def llm() -> LLM:
    # NOTE: a small max_model_len and pool: the default would size KV for 8192 tokens.
    return LLM(dtype="float32", max_model_len=512, kv_cache_memory_bytes=64 << 20)


@pytest.fixture(scope="module")
def pagoda_outputs(llm: LLM) -> list[RequestOutput]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params,
                    use_tqdm=False)
    llm.llm_engine.check_integrity()
    assert llm.llm_engine.kv_cache_manager.usage == 0.0
    return outs


@pytest.fixture(scope="module")
def hf_outputs(llm: LLM, pagoda_outputs: list[RequestOutput]) -> list[list[int]]:
    """transformers' greedy continuation of each prompt pagoda templated, one at a time."""
    path = default_model_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    eos = llm.get_tokenizer().eos_token_id
    results = []
    for out in pagoda_outputs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            seq = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=MAX_TOKENS, do_sample=False,
                                 eos_token_id=eos, pad_token_id=eos)
        results.append(seq[0, ids.shape[1]:].tolist())
    return results


def test_chat_prompts_are_the_template(llm: LLM, pagoda_outputs: list[RequestOutput]) -> None:
    tokenizer = llm.get_tokenizer()
    for out, question in zip(pagoda_outputs, QUESTIONS):
        expected = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=True
        )
        expected = expected if isinstance(expected, list) else expected["input_ids"]
        assert out.prompt_token_ids == expected


def test_greedy_matches_transformers(
    pagoda_outputs: list[RequestOutput], hf_outputs: list[list[int]]
) -> None:
    for question, out, expected in zip(QUESTIONS, pagoda_outputs, hf_outputs):
        (completion,) = out.outputs
        assert completion.token_ids == expected, question
        # transformers keeps the eos it stopped on; so does pagoda, with reason "stop".
        stopped = len(expected) < MAX_TOKENS
        assert completion.finish_reason == ("stop" if stopped else "length"), question


def test_knows_the_capital_of_france(pagoda_outputs: list[RequestOutput]) -> None:
    assert "Paris" in pagoda_outputs[0].outputs[0].text
