"""The C++ kernels' guards: any row size (the prefetcher terminates), block ids checked
against the cache, the instruction-set decision (mocked CPU flags), any block size.

NOTE: a prefetcher that never finishes a row hangs the head-dim tests rather than failing
them; they carry no timeout of their own (run the file under `timeout` to see it fail).
"""

from __future__ import annotations

import pytest
import torch

from pagoda import ops
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.layers.norm import RMSNorm
from pagoda.ops import cpu_kernels, reference, registry
from tests.helpers import spy_on_extension
from tests.unit.test_cpu_paged_attention import _kernel, _make_case, _metadata, _naive


def _backend_decode(q, k_cache, v_cache, bt, lens, window) -> torch.Tensor:
    """The paged backend's forward on a batch of decodes whose K/V are already written."""
    backend = TorchPagedAttention(q.shape[1], k_cache.shape[2], q.shape[2], window)
    out = backend.forward(
        q, q[:, :0], q[:, :0], (k_cache, v_cache), _metadata(bt, lens), kv_written=True
    )
    return out.view_as(q)


def _seq_lens(n: int) -> list[int]:
    return [1 + (37 * i) % 90 for i in range(n)]


# ---- row sizes: head dims whose rows are not a multiple of the 128-byte prefetch unit ----
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [96, 80, 32, 48, 40])
@pytest.mark.parametrize("num_kv_heads", [1, 3])
@pytest.mark.parametrize("many", [False, True], ids=["head_items", "request_items"])
def test_any_head_dim_matches_reference(
    ext, dtype: torch.dtype, head_dim: int, num_kv_heads: int, many: bool
) -> None:
    """Few requests: one kv head per work item; many: all of a request's kv heads per item
    (row spans of 1 and 3 heads: 64 * odd bytes for head dims 32 and 96 in bf16)."""
    n = 4 * torch.get_num_threads() + 1 if many else 3
    case = _make_case(_seq_lens(n), num_kv_heads, 2, dtype, head_dim=head_dim, seed=head_dim)
    q, k_cache, v_cache, bt, lens = case
    for window in (None, 19):
        out = _kernel(q, k_cache, v_cache, bt, lens, head_dim**-0.5, window)
        ref = reference.paged_attention(q, k_cache, v_cache, bt, lens, head_dim**-0.5, window)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        torch.testing.assert_close(out.double(), _naive(*case, window), atol=tol, rtol=tol)


# ---- block ids ---------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, 10**6])
def test_out_of_range_block_id_is_a_clear_error(ext, bad: int) -> None:
    q, k_cache, v_cache, bt, lens = _make_case([40, 9], 2, 2, torch.bfloat16)
    num_blocks = k_cache.shape[0]
    bt[1, 0] = bad
    with pytest.raises(RuntimeError, match=rf"block_tables\[1, 0\] = {bad} is out of range "
                                           rf"for a KV cache of {num_blocks} blocks"):
        _kernel(q, k_cache, v_cache, bt, lens, 0.125)
    with pytest.raises(RuntimeError, match="out of range"):  # through the backend too
        _backend_decode(q, k_cache, v_cache, bt, lens, None)


def test_unread_table_entries_are_not_checked(ext) -> None:
    """Padding past a sequence's blocks and blocks before its window are never read."""
    q, k_cache, v_cache, bt, lens = _make_case([40, 9], 2, 2, torch.float32)
    want = _kernel(q, k_cache, v_cache, bt, lens, 0.125, 16)
    bt[1, 1:] = 10**6  # request 1 (9 tokens, block size 16) reads block 0 only
    bt[0, 0] = 10**6  # request 0 (40 tokens, window 16) reads positions 24..39: blocks 1-2
    torch.testing.assert_close(_kernel(q, k_cache, v_cache, bt, lens, 0.125, 16), want)


# ---- instruction sets: the dispatch decision with the CPU's flags mocked -------------------
FUSED_ISA = ["avx512f", "avx512bw", "avx512vl"]
FUSED_AVX2 = ["avx2", "fma", "f16c"]


def test_isa_decision() -> None:
    full = frozenset(FUSED_ISA + FUSED_AVX2 + ["avx512_bf16"])
    assert cpu_kernels.isa_allows("fused_ops", FUSED_ISA, full)
    assert not cpu_kernels.isa_allows("fused_ops", FUSED_ISA, full - {"avx512bw"})
    assert not cpu_kernels.isa_allows("fused_ops", FUSED_ISA, full - {"avx512vl"})
    # The AVX2 path (AVX2 + FMA + F16C), whole and only where the CPU has all three.
    avx2 = frozenset(FUSED_AVX2)
    assert cpu_kernels.isa_allows("fused_ops", FUSED_AVX2, avx2)
    assert cpu_kernels.isa_allows("fused_ops", FUSED_AVX2, full)
    assert not cpu_kernels.isa_allows("fused_ops", FUSED_AVX2, avx2 - {"f16c"})
    assert not cpu_kernels.isa_allows("fused_ops", ["avx2", "fma"], avx2)
    # Built without either path: scalar code only, so the reference runs instead.
    assert not cpu_kernels.isa_allows("fused_ops", [], avx2)
    assert cpu_kernels.isa_allows("paged_attention", [], frozenset({"avx2"}))
    assert cpu_kernels.isa_allows("paged_attention", ["avx512f"], full)
    assert not cpu_kernels.isa_allows("paged_attention", ["avx512f", "avx512_bf16"],
                                      full - {"avx512_bf16"})


def _mock_flags(monkeypatch: pytest.MonkeyPatch, drop: set[str]) -> None:
    flags = cpu_kernels.cpu_flags() - drop
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_kernels, "_allowed", {})
    registry.refresh()  # as an engine start on such a CPU would


def test_cpu_without_the_fused_paths_flags_uses_the_reference(ext, monkeypatch) -> None:
    """A CPU lacking what the build's fused-op path uses (AVX-512 BW/VL; the AVX2 path's
    F16C) runs the reference."""
    fused = ext.kernel_isa()["fused_ops"]
    _mock_flags(monkeypatch, {"avx512bw", "avx512vl"} if "avx512bw" in fused else {"f16c"})
    calls = spy_on_extension(ext, monkeypatch)
    x = torch.randn(3, 64).to(torch.bfloat16)
    r = torch.randn(3, 64).to(torch.bfloat16)
    norm = RMSNorm(64).to(torch.bfloat16)
    assert ops.fused_ops_for(x) is None
    assert ops.fused_add_rms_norm.select(x, r, norm.weight, 1e-6) is reference.fused_add_rms_norm
    got, res = norm.forward_residual(x, r)
    want, want_res = reference.fused_add_rms_norm(x, r, norm.weight, 1e-6)
    assert torch.equal(got, want) and torch.equal(res, want_res)
    assert ops.silu_and_mul(torch.randn(2, 8).to(torch.bfloat16)).shape == (2, 4)
    compiled = ext.kernel_isa()["paged_attention"]
    assert not any(c in ("fused_add_rms_norm", "silu_and_mul") for c in calls)
    # Attention needs neither: it keeps its kernel where the CPU has what it was built for.
    kernel = ops.paged_attention.kernel_for(torch.zeros(1, 1, 64, dtype=torch.bfloat16))
    assert (kernel is not None) == all(f in cpu_kernels.cpu_flags() for f in compiled)


def test_cpu_without_avx512_uses_the_reference_everywhere(ext, monkeypatch) -> None:
    """Flags lacking what the build used (never SIGILL): only kernels built without AVX-512
    may run (the AVX2 paths, the decode kernel's portable code)."""
    _mock_flags(monkeypatch, {f for f in cpu_kernels.cpu_flags() if f.startswith("avx512")})
    calls = spy_on_extension(ext, monkeypatch)
    case = _make_case(_seq_lens(4), 2, 2, torch.float32)
    out = ops.paged_attention(*case, 0.125)
    torch.testing.assert_close(out.double(), _naive(*case, None), atol=1e-5, rtol=1e-5)
    # The decode kernel runs only where its build needs no AVX-512 (its AVX2 path, or the
    # portable code alone).
    compiled = ext.kernel_isa()["paged_attention"]
    runs = not any(f.startswith("avx512") for f in compiled)
    assert ("paged_decode_attention" in calls) == runs, (compiled, calls)
    # The fused ops run only where the build is the AVX2 one, which needs no AVX-512.
    fused = ops.fused_ops_for(torch.zeros(2, dtype=torch.bfloat16))
    assert (fused is not None) == (ext.kernel_isa()["fused_ops"] == FUSED_AVX2)


# ---- block sizes ---------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [1, 2, 8, 16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_sizes_match_reference(ext, block_size: int, dtype: torch.dtype) -> None:
    """Tiles of 16 positions over blocks that divide the tile (1-16) or span several tiles."""
    case = _make_case(_seq_lens(9), 2, 3, dtype, seed=block_size, block_size=block_size)
    q, k_cache, v_cache, bt, lens = case
    for window in (None, 21):
        out = _kernel(q, k_cache, v_cache, bt, lens, 0.125, window)
        ref = reference.paged_attention(q, k_cache, v_cache, bt, lens, 0.125, window)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out, ref, atol=tol, rtol=tol)
        # The backend's decode path on the same inputs takes the kernel.
        torch.testing.assert_close(_backend_decode(q, k_cache, v_cache, bt, lens, window), out)
