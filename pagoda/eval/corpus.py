"""Real text available offline, for calibrating quantization and for measuring perplexity.

Two built-in corpora, both shipped by Debian packages (scripts/setup.sh installs them), and
deliberately different texts so that a quantizer is never scored on what it calibrated on:

  "calib"  the English quotations of the `fortunes` package (/usr/share/games/fortunes:
           literature, wisdom, people, humorists, ...), one quotation per paragraph
  "eval"   the Python tutorial's reStructuredText sources from `python3-doc`
           (/usr/share/doc/python3.*/html/_sources/tutorial), chapters in file order

Anything else is a user file: `.txt` (taken whole) or `.jsonl` (one JSON object a line, its
"text" field; lines joined by blank lines).
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

FORTUNES_DIR = "/usr/share/games/fortunes"
# English prose among the fortune files (the others are ASCII art, program code, translations
# exercises or non-sequitur strips).
FORTUNE_FILES = (
    "literature", "wisdom", "people", "humorists", "love", "politics", "science",
    "education", "work", "miscellaneous", "platitudes", "pets", "food", "kids", "law",
    "medicine", "men-women", "news", "sports", "art", "songs-poems", "fortunes", "goedel",
)
PYTHON_TUTORIAL_GLOB = "/usr/share/doc/python3*/html/_sources/tutorial/*.rst.txt"
# Tutorial chapters in reading order (the index and appendix are link lists, left out).
TUTORIAL_CHAPTERS = (
    "appetite", "interpreter", "introduction", "controlflow", "datastructures", "modules",
    "inputoutput", "errors", "classes", "stdlib", "stdlib2", "venv", "whatnow",
    "interactive", "floatingpoint",
)

BUILTIN_CORPORA = {
    "calib": "fortunes (Debian package `fortunes`)",
    "eval": "the Python tutorial (Debian package `python3-doc`)",
}


class CorpusNotFoundError(FileNotFoundError):
    """A built-in corpus whose package is not installed, or a user file that is missing."""


def _fortunes_text(root: str = FORTUNES_DIR) -> str:
    quotes: list[str] = []
    for name in FORTUNE_FILES:
        path = os.path.join(root, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            quotes.extend(q.strip() for q in f.read().split("\n%\n") if q.strip())
    if not quotes:
        raise CorpusNotFoundError(
            f"corpus 'calib' needs the Debian package `fortunes` ({root} has none of its "
            "files): apt-get install fortunes, or pass a text file")
    return "\n\n".join(quotes) + "\n"


def _tutorial_text(pattern: str = PYTHON_TUTORIAL_GLOB) -> str:
    by_chapter: dict[str, str] = {}
    for path in sorted(glob.glob(pattern)):
        by_chapter.setdefault(Path(path).name.split(".")[0], path)
    chapters = [by_chapter[c] for c in TUTORIAL_CHAPTERS if c in by_chapter]
    if not chapters:
        raise CorpusNotFoundError(
            "corpus 'eval' needs the Debian package `python3-doc` (no "
            f"{pattern}): apt-get install python3-doc, or pass a text file")
    parts = []
    for path in chapters:
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read().strip())
    return "\n\n".join(parts) + "\n"


def _file_text(path: str) -> str:
    if not os.path.isfile(path):
        raise CorpusNotFoundError(
            f"no such text file: {path!r} (or name a built-in corpus: "
            f"{', '.join(BUILTIN_CORPORA)})")
    with open(path, encoding="utf-8", errors="replace") as f:
        if not path.endswith(".jsonl"):
            return f.read()
        texts = []
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not a JSON object ({e.msg})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                # NOTE: ValueError: bad file content, not a bad argument type.
                raise ValueError(  # noqa: TRY004
                    f'{path}:{lineno}: a .jsonl line needs a string "text" field')
            texts.append(text)
    if not texts:
        raise ValueError(f"{path}: no text records")
    return "\n\n".join(texts)


def load_text(source: str) -> str:
    """The text of a built-in corpus ("calib", "eval") or of a user .txt / .jsonl file.
    CorpusNotFoundError names the package to install or the missing file."""
    if source == "calib":
        return _fortunes_text()
    if source == "eval":
        return _tutorial_text()
    return _file_text(source)


def token_windows(token_ids: list[int], num_samples: int, seq_len: int) -> list[list[int]]:
    """Up to `num_samples` consecutive non-overlapping windows of `seq_len` tokens from the
    start of the text (deterministic: the same text gives the same calibration set)."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    count = min(num_samples, len(token_ids) // seq_len)
    if count == 0:
        raise ValueError(
            f"the text has {len(token_ids)} tokens, fewer than one window of {seq_len}")
    return [token_ids[i * seq_len : (i + 1) * seq_len] for i in range(count)]
