#!/usr/bin/env bash
# The llama.cpp peer of `pagoda bench quant` / `bench kernels --decode` (optional; CI does
# not run it): llama-cpp-python built from source in its own venv at
# $PAGODA_LLAMA_VENV (default /work/llama-venv, where pagoda/benchmarks/quant.py looks).
# NOTE: without -march=native: a native build crashed (general-protection fault in
# libggml-cpu) on its first decode on the Intel Xeon machines; these flags work on both
# the AMD EPYC and the Intel ones (docs/quantization.md). About 6.5 min on 2 cores.
set -euo pipefail
VENV=${PAGODA_LLAMA_VENV:-/work/llama-venv}
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON" \
CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
    "$VENV/bin/python" -m pip install --no-cache-dir llama-cpp-python numpy
"$VENV/bin/python" -c "import llama_cpp; print('llama.cpp peer ready:', llama_cpp.__version__)"
echo "PAGODA_LLAMA_PYTHON=$VENV/bin/python"
