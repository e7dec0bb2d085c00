"""The built-in offline corpora: real text from Debian packages, two different texts, or an
error that names the package to install."""

from __future__ import annotations

import pytest

from pagoda.eval import corpus


@pytest.mark.parametrize("name,package", [("calib", "fortunes"), ("eval", "python3-doc")])
def test_builtin_corpus_is_real_text_or_names_its_package(name, package):
    try:
        text = corpus.load_text(name)
    except corpus.CorpusNotFoundError as e:
        assert package in str(e)
        return
    assert len(text) > 100_000
    words = text.split()
    # Prose: mostly alphabetic words, not code or tables.
    assert sum(w.isalpha() for w in words) / len(words) > 0.6


@pytest.mark.parametrize("name", ["calib", "howto"])
def test_calibration_and_evaluation_texts_differ(name):
    try:
        calib, held_out = corpus.load_text(name), corpus.load_text("eval")
    except corpus.CorpusNotFoundError as e:
        assert "apt-get install" in str(e)
        return
    assert len(calib) > 100_000
    paragraphs = {p.strip() for p in calib.split("\n\n") if len(p.strip()) > 80}
    assert len(paragraphs) > 500
    assert not any(p in held_out for p in list(paragraphs)[:2000])


def test_missing_packages_are_named(tmp_path):
    with pytest.raises(corpus.CorpusNotFoundError, match="apt-get install fortunes"):
        corpus._fortunes_text(str(tmp_path))
    with pytest.raises(corpus.CorpusNotFoundError, match="python3-doc"):
        corpus._tutorial_text(str(tmp_path / "*.rst.txt"))
    with pytest.raises(corpus.CorpusNotFoundError, match="corpus 'howto' needs .*python3-doc"):
        corpus._howto_text(str(tmp_path))


def test_token_windows_spread_over_the_text():
    assert corpus.token_windows(list(range(10)), 3, 4) == [[0, 1, 2, 3], [6, 7, 8, 9]]
    assert corpus.token_windows(list(range(100)), 3, 10) == \
        [list(range(s, s + 10)) for s in (0, 45, 90)]
    assert corpus.token_windows(list(range(12)), 3, 4) == \
        [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert corpus.token_windows(list(range(7)), 5, 4) == [[0, 1, 2, 3]]
    with pytest.raises(ValueError, match="fewer than one window"):
        corpus.token_windows([1, 2], 1, 4)
