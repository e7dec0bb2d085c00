"""IncrementalDetokenizer on the real SmolLM2 byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import transformers

from pagoda.engine.detokenizer import IncrementalDetokenizer, decode_token
from pagoda.sampling_params import SamplingParams

MULTILINGUAL = "naïve café 👨‍👩‍👧 日本語テキスト Ελληνικά e\u0301 🇯🇵 한국어 𝔘𝔫𝔦 ok"
EOS = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Any:
    return transformers.AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[int]:
    messages = [{"role": "user", "content": "Say something"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(
    detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1, stop_terminated: bool = False
) -> tuple[list[str], str | None]:
    """Feed `ids` `chunk` at a time, collecting the streamed deltas (last one finished)."""
    deltas, stop = [], None
    for start in range(0, len(ids), chunk):
        last = start + chunk >= len(ids)
        stop = detok.update(ids[start : start + chunk], stop_terminated and last)
        finished = last or stop is not None
        deltas.append(detok.get_next_output_text(finished=finished, delta=True))
        if stop is not None:
            break
    return deltas, stop


@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_equal_full_decode(
    tokenizer: Any, prompt_ids: list[int], chunk: int, skip_special_tokens: bool
) -> None:
    ids = encode(tokenizer, MULTILINGUAL) + [EOS] + encode(tokenizer, " tail 🎉")
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    deltas, stop = stream(detok, ids, chunk)
    assert stop is None
    assert all("\ufffd" not in d for d in deltas)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert "".join(deltas) == detok.output_text == expected
    assert detok.num_output_tokens == len(ids)


def test_split_characters_are_held_until_complete(tokenizer: Any) -> None:
    ids = encode(tokenizer, " 👨‍👩‍👧")
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    texts = []
    for token_id in ids:
        detok.update([token_id], False)
        texts.append(detok.output_text)
    assert all("\ufffd" not in t for t in texts)
    assert "" in texts[:2], "the first byte-level pieces should be held back"
    assert texts[-1] == " 👨‍👩‍👧"


def test_incomplete_tail_is_flushed_when_finished(tokenizer: Any) -> None:
    ids = encode(tokenizer, "ok 🎉")[:-1]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams())
    deltas, _ = stream(detok, ids)
    assert "\ufffd" not in "".join(deltas[:-1])
    assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_token_text_is_not_added(tokenizer: Any) -> None:
    ids = encode(tokenizer, "Hello world") + [EOS]
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(skip_special_tokens=False))
    deltas, stop = stream(detok, ids, stop_terminated=True)
    assert stop is None
    assert "".join(deltas) == detok.output_text == "Hello world"
    assert detok.num_output_tokens == len(ids)


ANSWER = "The answer is 42. Done."  # The| answer| is| |4|2|.| Done|.


@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [
        ("answer is", False, "The "),
        ("answer is", True, "The answer is"),
        ("swer i", False, "The an"),  # starts and ends inside tokens
        ("swer i", True, "The answer i"),
        ("42.", False, "The answer is "),
        (" Done.", True, "The answer is 42. Done."),
    ],
)
def test_stop_strings_across_token_boundaries(
    tokenizer: Any, stop: str, include: bool, expected: str
) -> None:
    params = SamplingParams(stop=[stop, "never"], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tokenizer, [], params)
    deltas, matched = stream(detok, encode(tokenizer, ANSWER))
    assert matched == stop
    assert detok.output_text == expected
    assert "".join(deltas) == expected
    assert detok.update(encode(tokenizer, " more"), False) is None
    assert detok.output_text == expected


def test_earliest_stop_string_wins(tokenizer: Any) -> None:
    params = SamplingParams(stop=["is 42", "answer"])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    # One update with every token: both stops are in the new text; "answer" comes first.
    assert detok.update(encode(tokenizer, ANSWER), False) == "answer"
    assert detok.output_text == "The "


def test_streaming_holds_back_a_possible_stop_prefix(tokenizer: Any) -> None:
    stop = "answer is"
    params = SamplingParams(stop=[stop])
    detok = IncrementalDetokenizer(tokenizer, [], params)
    streamed = ""
    for token_id in encode(tokenizer, ANSWER):
        matched = detok.update([token_id], False)
        streamed += detok.get_next_output_text(finished=matched is not None, delta=True)
        # Never more than the final text, never part of the stop string.
        assert "The ".startswith(streamed)
        if matched is not None:
            break
        held = len(detok.output_text) - len(streamed)
        assert held == min(len(stop) - 1, len(detok.output_text))
        full = detok.get_next_output_text(finished=False, delta=False)
        assert full == detok.output_text[: len(detok.output_text) - held]
    assert matched == stop and streamed == "The "


def test_stop_strings_wait_for_min_tokens(tokenizer: Any) -> None:
    ids = encode(tokenizer, "ab ab ab ab")  # ab| ab| ab| ab
    assert len(ids) == 4
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["ab"], min_tokens=2))
    _, matched = stream(detok, ids)
    assert matched == "ab"
    assert detok.output_text == "ab ab "


def test_detokenize_false_only_counts(tokenizer: Any) -> None:
    detok = IncrementalDetokenizer(tokenizer, [], SamplingParams(detokenize=False, stop=["a"]))
    assert detok.update(encode(tokenizer, "a b c"), False) is None
    assert detok.output_text == "" and detok.num_output_tokens == 3


def test_decode_token(tokenizer: Any) -> None:
    assert decode_token(tokenizer, encode(tokenizer, " world")[0]) == " world"
    assert decode_token(tokenizer, EOS) == "<|im_end|>"
    assert decode_token(tokenizer, encode(tokenizer, "🎉")[0]) == "\ufffd"


def test_work_per_token_does_not_grow_with_the_history(tokenizer: Any, prompt_ids: list[int]) -> None:
    ids = encode(tokenizer, MULTILINGUAL * 20)
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(stop=["zzz", "</s>"]))
    decoded_lengths: list[int] = []
    decode = detok._decode

    def counting_decode(window: list[int]) -> str:
        decoded_lengths.append(len(window))
        return decode(window)

    detok._decode = counting_decode
    for token_id in ids:
        detok.update([token_id], False)
        detok.get_next_output_text(finished=False, delta=True)
    assert detok.output_text == tokenizer.decode(ids)
    # Each step decodes a short window (a few tokens before the read offset), never the
    # whole history: a full re-decode per step would reach len(ids) here.
    assert len(ids) > 500 and max(decoded_lengths) < 16, max(decoded_lengths)
