"""How long a prompt may be, in characters, before tokenizing it: a bound provable from the
tokenizer alone, so that a prompt too long for max_model_len is refused without the cost
of tokenizing it (an 8 MB prompt took 3 s), and the default body limit built from it.

The bound. Let L be the longest string in the vocabulary (in the tokenizer's own alphabet)
and S the most characters a normaliser can fold into one. For the tokenizers accepted here
every character of the normalised text is covered by exactly one token, and a token
covers at most as many characters as its vocabulary string has:
- byte-level BPE (GPT-2, Llama 3, SmolLM): a vocabulary character stands for one byte, and
  a text character is at least one byte;
- SentencePiece-style BPE (Metaspace): "▁" stands for one space, a byte-fallback piece
  "<0xNN>" (6 characters) for at most one character;
- added (special) tokens match their own literal text.
So `num_tokens >= len(normalised) / L >= len(text) / (L * S)`. Normalisers: NFC/NFD fold at
most S = max len(NFD(c)) characters into one, NFKC/NFKD at most max len(NFKD(c)), since
len(x) <= len(NFD(x)) = len(NFD(NFC(x))) <= S * len(NFC(x)); Prepend, Lowercase and a
one-character Replace never shrink text. A text longer than `(max_model_len - 1) * L * S`
characters therefore has at least max_model_len tokens, which the engine refuses anyway.
Anything that can drop characters (a Strip or regex Replace normaliser, a pre-tokenizer
that removes whitespace, a model that fuses unknown characters into one token, WordPiece
or Unigram models) has no such bound: `max_prompt_chars` returns None and only the body
limit applies.
"""

from __future__ import annotations

import json
from typing import Any

_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}
_MIN_BODY_BYTES = 1 << 20
# NOTE: the longest UTF-8 encoding of one character; JSON escapes are rarer and longer.
_BYTES_PER_CHAR = 4


# The most characters a Unicode normal form folds into one: max len(NFD(c)), max
# len(NFKD(c)) over all characters (tests/unit/test_prompt_limits.py recomputes them).
MAX_FOLD = {"NFC": 4, "NFD": 4, "NFKC": 18, "NFKD": 18}


def _normalizer_fold(spec: dict[str, Any] | None) -> int | None:
    """S for a normaliser spec (tokenizer.json), or None if it can drop characters."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind in MAX_FOLD:
        return MAX_FOLD[kind]
    if kind in ("Prepend", "Lowercase"):
        return 1
    if kind == "Replace":
        pattern, content = spec.get("pattern", {}), spec.get("content", "")
        literal = pattern.get("String")
        if literal is not None and len(literal) == 1 and content:
            return 1
        return None
    if kind == "Sequence":
        fold = 1
        for part in spec.get("normalizers", []):
            f = _normalizer_fold(part)
            if f is None:
                return None
            fold *= f
        return fold
    return None


def _keeps_characters(pre: dict[str, Any] | None, model: dict[str, Any]) -> bool:
    if pre is not None:
        kind = pre.get("type")
        if kind == "Sequence":
            if not all(_keeps_characters(p, model) for p in pre.get("pretokenizers", [])):
                return False
        elif kind == "Split":
            if pre.get("behavior") == "Removed":
                return False
        elif kind not in _KEEPING_PRE_TOKENIZERS:
            return False
    if model.get("type") != "BPE":
        return False
    fuses = model.get("fuse_unk") and model.get("unk_token") is not None
    return not fuses or bool(model.get("byte_fallback"))


def max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """The most characters a prompt that fits `max_model_len` can have (module docstring),
    or None when this tokenizer gives no such bound."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    spec = json.loads(backend.to_str())
    fold = _normalizer_fold(spec.get("normalizer"))
    if fold is None or not _keeps_characters(spec.get("pre_tokenizer"), spec.get("model", {})):
        return None
    longest = max(len(t) for t in tokenizer.get_vocab())
    return max(max_model_len - 1, 1) * longest * fold


def default_body_bytes(max_chars: int | None, max_model_len: int) -> int:
    """The default request body limit: one prompt of `max_chars` characters in UTF-8 (at
    least 1 MiB), or 64 characters a token without a bound. About 20 times the body of a
    max-length prompt of ordinary text, which averages some 4 characters a token."""
    chars = max_chars if max_chars is not None else 64 * max_model_len
    return max(_MIN_BODY_BYTES, _BYTES_PER_CHAR * chars)
