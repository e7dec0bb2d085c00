"""The character bound on prompts (prompt_limits.py): its constants, which tokenizers get
one, and that it holds: no text over the bound tokenizes to fewer tokens than it claims."""

from __future__ import annotations

import json
import random
import sys
import unicodedata
from pathlib import Path

import pytest
import tokenizers
import transformers

from pagoda.entrypoints.openai.prompt_limits import (
    MAX_FOLD,
    _keeps_characters,
    _normalizer_fold,
    default_body_bytes,
    max_prompt_chars,
)


def test_max_fold_matches_unicodedata() -> None:
    chars = [chr(c) for c in range(sys.maxunicode + 1) if not 0xD800 <= c < 0xE000]
    for form, decomposed in (("NFC", "NFD"), ("NFD", "NFD"), ("NFKC", "NFKD"),
                             ("NFKD", "NFKD")):
        assert MAX_FOLD[form] == max(len(unicodedata.normalize(decomposed, c)) for c in chars)


@pytest.mark.parametrize(("spec", "fold"), [
    (None, 1),
    ({"type": "NFC"}, 4),
    ({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                          {"type": "Replace", "pattern": {"String": " "},
                                           "content": "▁"}]}, 1),
    ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]}, 18),
    ({"type": "Strip", "strip_left": True, "strip_right": True}, None),
    ({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}, None),
    ({"type": "Replace", "pattern": {"String": " "}, "content": ""}, None),
    ({"type": "BertNormalizer"}, None),
])
def test_normalizer_fold(spec, fold) -> None:
    assert _normalizer_fold(spec) == fold


BPE = {"type": "BPE", "fuse_unk": False, "unk_token": None, "byte_fallback": False}


@pytest.mark.parametrize(("pre", "model", "keeps"), [
    ({"type": "ByteLevel"}, BPE, True),
    ({"type": "Metaspace"}, {**BPE, "fuse_unk": True, "unk_token": "<unk>",
                             "byte_fallback": True}, True),
    (None, {**BPE, "fuse_unk": True, "unk_token": "<unk>"}, False),
    ({"type": "Whitespace"}, BPE, False),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Removed"}]},
     BPE, False),
    ({"type": "Sequence", "pretokenizers": [{"type": "Split", "behavior": "Isolated"},
                                            {"type": "ByteLevel"}]}, BPE, True),
    ({"type": "ByteLevel"}, {"type": "WordPiece"}, False),
])
def test_keeps_characters(pre, model, keeps) -> None:
    assert _keeps_characters(pre, model) is keeps


def test_bound_holds_for_the_embedded_tokenizer(tokenizer_dir: Path) -> None:
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    max_model_len = 64
    bound = max_prompt_chars(tok, max_model_len)
    longest = max(len(t) for t in tok.get_vocab())
    assert bound == (max_model_len - 1) * longest
    rng = random.Random(0)
    # NOTE: the texts of the longest tokens give the fewest tokens per character there are.
    longest_texts = [tok.convert_tokens_to_string([t])
                     for t in sorted(tok.get_vocab(), key=len)[-20:]]
    samples = ["".join(rng.choice(longest_texts) for _ in range(bound)),
               " " * (bound + 1),
               "".join(chr(rng.randint(32, 0x2FFF)) for _ in range(bound + 1))]
    for text in samples:
        assert len(tok.encode(text[: bound + 1])) >= max_model_len


def test_no_bound_for_a_tokenizer_that_drops_characters() -> None:
    model = tokenizers.models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")
    backend = tokenizers.Tokenizer(model)
    backend.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=backend)
    assert json.loads(tok.backend_tokenizer.to_str())["pre_tokenizer"]["type"] == "Whitespace"
    assert max_prompt_chars(tok, 64) is None


def test_default_body_bytes() -> None:
    assert default_body_bytes(10_000, 128) == 1 << 20
    assert default_body_bytes(2_000_000, 8192) == 8_000_000
    assert default_body_bytes(None, 32768) == 4 * 64 * 32768
