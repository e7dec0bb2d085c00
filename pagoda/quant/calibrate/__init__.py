"""`pagoda quantize`: post-training quantization of an HF model into a GPTQ or AWQ checkpoint
(rtn.py: the round-to-nearest grid every method shares, gptq.py, awq.py, runner.py: the
layer-by-layer driver, export.py: the Hugging Face directory)."""
