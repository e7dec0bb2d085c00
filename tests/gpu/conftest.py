"""tests/gpu/ runs where CUDA exists and is not collected elsewhere (nothing skipped, nothing
counted). `PAGODA_GPU_TEST_DEVICE=cpu` collects it anyway and runs it on the CPU: a dry run
of the tests' own logic on a machine without a GPU (it proves nothing about CUDA)."""

from __future__ import annotations

import os

import torch

DEVICE = torch.device(os.environ.get("PAGODA_GPU_TEST_DEVICE", "cuda"))

if DEVICE.type == "cuda" and not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]
