"""Real text available offline, for calibrating quantization and for measuring perplexity.

Three built-in corpora, all shipped by Debian packages (scripts/setup.sh installs them), and
deliberately different texts so that a quantizer is never scored on what it calibrated on:

  "calib"  the English quotations of the `fortunes` package (/usr/share/games/fortunes:
           literature, wisdom, people, humorists, ...), one quotation per paragraph
  "howto"  the Python HOWTOs and FAQ from `python3-doc` (.../_sources/howto, faq): text of
           the evaluation text's kind (reStructuredText prose with Python examples) but none
           of its pages, for calibrating a model that is scored on "eval"
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
PYTHON_SOURCES_GLOB = "/usr/share/doc/python3*/html/_sources"
PYTHON_TUTORIAL_GLOB = PYTHON_SOURCES_GLOB + "/tutorial/*.rst.txt"
HOWTO_SECTIONS = ("howto", "faq")  # file order within each; their index pages left out
# Tutorial chapters in reading order (the index and appendix are link lists, left out).
TUTORIAL_CHAPTERS = (
    "appetite", "interpreter", "introduction", "controlflow", "datastructures", "modules",
    "inputoutput", "errors", "classes", "stdlib", "stdlib2", "venv", "whatnow",
    "interactive", "floatingpoint",
)

BUILTIN_CORPORA = {
    "calib": "fortunes (Debian package `fortunes`)",
    "howto": "the Python HOWTOs and FAQ (Debian package `python3-doc`)",
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


def _rst_files(pattern: str) -> dict[str, str]:
    """Page name -> path, the first path of each name (python3-doc's sources are reachable
    through several /usr/share/doc/python3* directories)."""
    by_name: dict[str, str] = {}
    for path in sorted(glob.glob(pattern)):
        by_name.setdefault(Path(path).name.split(".")[0], path)
    return by_name


def _joined(paths: list[str]) -> str:
    parts = []
    for path in paths:
        with open(path, encoding="utf-8", errors="replace") as f:
            parts.append(f.read().strip())
    return "\n\n".join(parts) + "\n"


def _tutorial_text(pattern: str = PYTHON_TUTORIAL_GLOB) -> str:
    by_chapter = _rst_files(pattern)
    chapters = [by_chapter[c] for c in TUTORIAL_CHAPTERS if c in by_chapter]
    if not chapters:
        raise CorpusNotFoundError(
            "corpus 'eval' needs the Debian package `python3-doc` (no "
            f"{pattern}): apt-get install python3-doc, or pass a text file")
    return _joined(chapters)


def _howto_text(root: str = PYTHON_SOURCES_GLOB) -> str:
    pages = []
    for section in HOWTO_SECTIONS:
        files = _rst_files(f"{root}/{section}/*.rst.txt")
        pages.extend(path for name, path in sorted(files.items()) if name != "index")
    if not pages:
        raise CorpusNotFoundError(
            "corpus 'howto' needs the Debian package `python3-doc` (no "
            f"{root}/{{{','.join(HOWTO_SECTIONS)}}}): apt-get install python3-doc, or pass a "
            "text file")
    return _joined(pages)


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
    """The text of a built-in corpus ("calib", "howto", "eval") or of a user .txt / .jsonl
    file. CorpusNotFoundError names the package to install or the missing file."""
    if source == "calib":
        return _fortunes_text()
    if source == "howto":
        return _howto_text()
    if source == "eval":
        return _tutorial_text()
    return _file_text(source)


def token_windows(token_ids: list[int], num_samples: int, seq_len: int) -> list[list[int]]:
    """Up to `num_samples` non-overlapping windows of `seq_len` tokens spread evenly over the
    text: the first at its start, the others (tokens - seq_len) // (count - 1) tokens apart
    (deterministic: the same text gives the same calibration set). Spread rather than
    consecutive, so that a small calibration set samples the whole corpus (every fortune
    file, every HOWTO) instead of its first pages."""
    if seq_len < 2:
        raise ValueError(f"seq_len must be at least 2, got {seq_len}")
    count = min(num_samples, len(token_ids) // seq_len)
    if count == 0:
        raise ValueError(
            f"the text has {len(token_ids)} tokens, fewer than one window of {seq_len}")
    # count * seq_len <= len(token_ids), so the gap is at least seq_len: no overlap.
    gap = (len(token_ids) - seq_len) // (count - 1) if count > 1 else 0
    return [token_ids[i * gap : i * gap + seq_len] for i in range(count)]
