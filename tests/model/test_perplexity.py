"""`pagoda eval perplexity` equals the perplexity transformers' logits give on the same
sliding windows (float32), and the window arithmetic scores each token once."""

from __future__ import annotations

import math

import pytest
import torch
import transformers

from pagoda import LLM
from pagoda.eval.corpus import load_text
from pagoda.eval.perplexity import (
    perplexity,
    sliding_windows,
    tokenize_text,
    transformers_perplexity,
)

TEXT = (
    "The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins "
    "with a single step. Perplexity measures how well a language model predicts a text; "
    "lower is better, and a model that guesses uniformly over its vocabulary scores the "
    "vocabulary size. "
) * 4


def hf_perplexity(path, ids: list[int], seq_len: int, stride: int) -> tuple[float, int]:
    """Token by token from transformers' logits (an independent count of the windows)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    nll, count = 0.0, 0
    for w in sliding_windows(len(ids), seq_len, stride):
        with torch.no_grad():
            logits = model(torch.tensor([ids[w.begin : w.end]])).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        length = w.end - w.begin
        for p in range(length - w.num_scored, length):
            nll -= logprobs[p - 1, ids[w.begin + p]].item()
        count += w.num_scored
    return math.exp(nll / count), count


@pytest.mark.parametrize("seq_len,stride", [(64, 32), (48, 48), (100, 17)])
def test_perplexity_matches_transformers(tiny_model, seq_len, stride):
    path = tiny_model("LlamaForCausalLM")
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=256)
    ids = tokenize_text(llm.get_tokenizer(), TEXT)
    assert len(ids) > 2 * seq_len
    result = perplexity(llm, ids, seq_len, stride)
    expected, count = hf_perplexity(path, ids, seq_len, stride)
    assert result.num_tokens_scored == count
    assert result.perplexity == pytest.approx(expected, rel=1e-5)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    in_memory = transformers_perplexity(model.eval(), ids, seq_len, stride)
    assert in_memory.num_tokens_scored == count
    assert in_memory.perplexity == pytest.approx(expected, rel=1e-5)
    assert llm.llm_engine.kv_cache_manager.usage == 0.0


def test_windows_score_each_token_once():
    for n, seq_len, stride in [(10, 4, 2), (11, 4, 3), (9, 4, 4), (3, 8, 4), (1000, 64, 1)]:
        windows = sliding_windows(n, seq_len, stride)
        scored = [w.begin + p for w in windows
                  for p in range(w.end - w.begin - w.num_scored, w.end - w.begin)]
        assert len(scored) == len(set(scored))
        assert all(w.end - w.begin <= seq_len and w.num_scored <= w.end - w.begin - 1
                   for w in windows)
        assert windows[-1].end == n
        if stride < seq_len:
            assert sorted(scored) == list(range(1, n))


@pytest.mark.parametrize("kwargs,match", [
    ({"seq_len": 1, "stride": 1}, "seq_len"),
    ({"seq_len": 8, "stride": 9}, "stride"),
    ({"seq_len": 8, "stride": 0}, "stride"),
])
def test_window_arguments_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sliding_windows(100, **kwargs)


def test_user_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n")
    assert load_text(str(tmp_path / "a.txt")) == "hello world\n"
    (tmp_path / "b.jsonl").write_text('{"text": "one"}\n\n{"text": "two"}\n')
    assert load_text(str(tmp_path / "b.jsonl")) == "one\n\ntwo"
    (tmp_path / "c.jsonl").write_text('{"body": "one"}\n')
    with pytest.raises(ValueError, match="c.jsonl:1"):
        load_text(str(tmp_path / "c.jsonl"))
    with pytest.raises(FileNotFoundError, match="no such text file"):
        load_text(str(tmp_path / "missing.txt"))
