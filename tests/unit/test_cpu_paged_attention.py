"""The C++ paged decode-attention kernel (ops.paged_attention's CPU kernel) against the
PyTorch reference and a float64 oracle."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda import ops
from pagoda.attention.backend import AttentionMetadata
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.ops import cpu_kernels, reference
from tests.helpers import spy_on_extension

BLOCK_SIZE = 16
HEAD_DIM = 64


def _ext_or_skip() -> None:
    if cpu_kernels.kernels_disabled():
        pytest.skip("PAGODA_DISABLE_CPU_KERNELS is set")
    if cpu_kernels.load_extension() is None:
        pytest.skip("the C++ extension could not be built here (no compiler?)")


def _kernel(q, k_cache, v_cache, block_tables, seq_lens, scale, window=None) -> torch.Tensor:
    """The registered C++ kernel, called directly (not through dispatch)."""
    kernel = ops.paged_attention.kernel_for(q)
    assert kernel is not None and kernel.name == "cpp"
    return kernel.fn(kernel.resolve(), q, k_cache, v_cache, block_tables, seq_lens, scale, window)


def _make_case(
    seq_lens: list[int],
    num_kv_heads: int,
    group: int,
    dtype: torch.dtype,
    head_dim: int = HEAD_DIM,
    seed: int = 0,
    block_size: int = BLOCK_SIZE,
    q_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q/caches; block tables use shuffled, non-contiguous ids and padded rows."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_req = [math.ceil(n / block_size) for n in seq_lens]
    max_blocks = max(blocks_per_req) + 1  # NOTE: one extra padding column, never read
    num_blocks = 2 * sum(blocks_per_req) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    # NOTE: large values in the unused slots, so that reading a row past a sequence's end
    # shows in the output (finite, so that the masked PyTorch reference stays finite).
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    ids = torch.randperm(num_blocks, generator=g)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int64)
    taken = 0
    for i, (n, nb) in enumerate(zip(seq_lens, blocks_per_req)):
        block_tables[i, :nb] = ids[taken : taken + nb]
        taken += nb
        pos = torch.arange(n)
        used[block_tables[i, pos // block_size], pos % block_size] = True
    k_cache[~used] = 30.0
    v_cache[~used] = 1000.0
    q = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, generator=g)
    q = q.to(dtype if q_dtype is None else q_dtype)
    return q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int64)


def _naive(q, k_cache, v_cache, block_tables, seq_lens, window):
    """Per-request softmax(q K^T) V in float64."""
    b, h, d = q.shape
    hk = k_cache.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        n = int(seq_lens[i])
        keys = k_cache[block_tables[i]].reshape(-1, hk, d)[:n].double()
        values = v_cache[block_tables[i]].reshape(-1, hk, d)[:n].double()
        lo = 0 if window is None else max(0, n - window)
        keys, values = keys[lo:], values[lo:]
        keys = keys.repeat_interleave(h // hk, dim=1)  # [n, h, d]
        values = values.repeat_interleave(h // hk, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].double(), keys) / math.sqrt(d)
        out[i] = torch.einsum("hn,nhd->hd", scores.softmax(-1), values)
    return out


def _metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decode_tokens=len(seq_lens),
        decode_block_tables=block_tables,
        decode_seq_lens=seq_lens,
        decode_max_seq_len=int(seq_lens.max()),
        prefills=[],
    )


def _reference(q, k_cache, v_cache, block_tables, seq_lens, window):
    """The PyTorch reference of the op."""
    scale = q.shape[2] ** -0.5
    return reference.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, window)


SEQ_LENS = [1, 16, 17, 5, 32, 100, 64, 3, 250, 48]


def test_extension_builds() -> None:
    """Fails loudly where a compiler exists but the build breaks (CI has g++)."""
    if cpu_kernels.kernels_disabled():
        pytest.skip("PAGODA_DISABLE_CPU_KERNELS is set")
    assert cpu_kernels.load_extension() is not None


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, 20])
def test_float32_matches_oracle_and_reference(group: int, window: int | None) -> None:
    _ext_or_skip()
    case = _make_case(SEQ_LENS, num_kv_heads=2, group=group, dtype=torch.float32, seed=group)
    q, k_cache, v_cache, bt, lens = case
    out = _kernel(q, k_cache, v_cache, bt, lens, HEAD_DIM**-0.5, window)
    assert out is not None and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _naive(*case, window), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out, _reference(*case, window), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("window", [None, 33])
def test_bfloat16_matches_oracle(group: int, window: int | None) -> None:
    _ext_or_skip()
    case = _make_case(SEQ_LENS, num_kv_heads=3, group=group, dtype=torch.bfloat16, seed=7)
    q, k_cache, v_cache, bt, lens = case
    out = _kernel(q, k_cache, v_cache, bt, lens, HEAD_DIM**-0.5, window)
    assert out is not None and out.dtype == torch.bfloat16
    # NOTE: the kernel accumulates in float32 and rounds once to bf16 (~4e-3 relative).
    torch.testing.assert_close(out.double(), _naive(*case, window), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, _reference(*case, window), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 80])
def test_other_head_dims_and_int32_tables(head_dim: int, dtype: torch.dtype) -> None:
    _ext_or_skip()
    case = _make_case([7, 40, 1], 1, 4, dtype, head_dim=head_dim, seed=3)
    q, k_cache, v_cache, bt, lens = case
    out = _kernel(q, k_cache, v_cache, bt.to(torch.int32), lens, head_dim**-0.5
    )
    assert out is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), _naive(*case, None), atol=tol, rtol=tol)


@pytest.fixture(params=[True, False], ids=["bf16_dot", "fp32_fma"])
def bf16_path(request: pytest.FixtureRequest):
    """Both inner paths of bf16 caches: vdpbf16ps (where the CPU has AVX512_BF16) and the
    fp32-FMA fallback of CPUs without it (the only path on such CPUs)."""
    _ext_or_skip()
    ext = cpu_kernels.load_extension()
    path = ext.set_bf16_dot(request.param)
    try:
        yield path
    finally:
        ext.set_bf16_dot(True)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, 33])
def test_bfloat16_paths_match_oracle(bf16_path: str, group: int, window: int | None) -> None:
    case = _make_case(SEQ_LENS, num_kv_heads=2, group=group, dtype=torch.bfloat16, seed=group)
    q, k_cache, v_cache, bt, lens = case
    out = _kernel(q, k_cache, v_cache, bt, lens, HEAD_DIM**-0.5, window)
    assert out is not None and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), _naive(*case, window), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("group", [1, 3])
def test_float32_query_on_bfloat16_cache_is_near_exact(bf16_path: str, group: int) -> None:
    """A float32 q against bf16 caches keeps float32 accuracy (q is never rounded)."""
    case = _make_case(SEQ_LENS, 3, group, torch.bfloat16, seed=9, q_dtype=torch.float32)
    q, k_cache, v_cache, bt, lens = case
    out = _kernel(q, k_cache, v_cache, bt, lens, HEAD_DIM**-0.5, 20)
    assert out is not None and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _naive(*case, 20), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_large_head_dims(dtype: torch.dtype, head_dim: int, group: int) -> None:
    """Head dims whose query heads are processed in several chunks per kv head."""
    _ext_or_skip()
    case = _make_case([70, 1, 33, 16], 2, group, dtype, head_dim=head_dim, seed=head_dim)
    q, k_cache, v_cache, bt, lens = case
    out = _kernel(q, k_cache, v_cache, bt, lens, head_dim**-0.5, 40)
    assert out is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), _naive(*case, 40), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 24, 32])
@pytest.mark.parametrize("window", [None, 21])
def test_other_block_sizes(dtype: torch.dtype, block_size: int, window: int | None) -> None:
    """Tiles of 16 positions that span several blocks, or part of one."""
    _ext_or_skip()
    case = _make_case(SEQ_LENS, 3, 3, dtype, seed=block_size, block_size=block_size)
    q, k_cache, v_cache, bt, lens = case
    out = _kernel(q, k_cache, v_cache, bt, lens, HEAD_DIM**-0.5, window)
    assert out is not None
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), _naive(*case, window), atol=tol, rtol=tol)


def test_window_larger_than_context_and_long_context() -> None:
    _ext_or_skip()
    case = _make_case([3000, 5], 2, 2, torch.float32, seed=11)
    q, k_cache, v_cache, bt, lens = case
    for window in (4096, 1000, 1):
        out = _kernel(q, k_cache, v_cache, bt, lens, 0.125, window)
        assert out is not None
        torch.testing.assert_close(out.double(), _naive(*case, window), atol=1e-5, rtol=1e-5)


def test_backend_decode_uses_kernel_and_matches_reference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _ext_or_skip()
    case = _make_case(SEQ_LENS, num_kv_heads=3, group=3, dtype=torch.float32, seed=5)
    q, k_cache, v_cache, bt, lens = case
    ext = cpu_kernels.load_extension()
    calls = spy_on_extension(ext, monkeypatch)
    md = _metadata(bt, lens)
    md.slot_mapping = torch.empty(0, dtype=torch.int64)
    empty = torch.empty(0, 3, HEAD_DIM)
    out = TorchPagedAttention(9, 3, HEAD_DIM).forward(q, empty, empty, (k_cache, v_cache), md)
    assert calls.count("paged_decode_attention") == 1
    torch.testing.assert_close(out.view_as(q), _reference(*case, None), atol=1e-5, rtol=1e-5)


def test_disable_env_var_forces_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    q, k_cache, v_cache, bt, lens = _make_case([5], 1, 1, torch.float32)
    args = (q, k_cache, v_cache, bt, lens, 0.125)
    assert ops.paged_attention.kernel_for(q) is None
    assert ops.paged_attention.select(*args) is ops.paged_attention.reference


def test_unsupported_dtype_takes_reference() -> None:
    q, k_cache, v_cache, bt, lens = _make_case([5], 1, 1, torch.float16)
    args = (q, k_cache, v_cache, bt, lens, 0.125)
    assert ops.paged_attention.select(*args) is ops.paged_attention.reference
    torch.testing.assert_close(
        ops.paged_attention(*args).double(), _naive(*args[:5], None), atol=1e-2, rtol=1e-2
    )


def test_extension_name_carries_a_cpu_tag() -> None:
    """-march=native builds differ per CPU, so the cached build's name says which CPU."""
    name = cpu_kernels.extension_name()
    assert name.startswith("pagoda_paged_attention_cpu_") and name == cpu_kernels.extension_name()
    assert len(name.rsplit("_", 1)[1]) >= 7


@pytest.mark.parametrize(("mode", "vendor", "want"), [
    ("auto", "AuthenticAMD", "l2"),
    ("auto", "GenuineIntel", "l1"),
    ("auto", "unknown", "l1"),
    ("l1", "AuthenticAMD", "l1"),
    ("l2", "GenuineIntel", "l2"),
])
def test_kv_prefetch_level_follows_vendor_unless_asked(mode: str, vendor: str,
                                                       want: str) -> None:
    assert cpu_kernels.kv_prefetch_level(mode, vendor) == want


def test_kv_prefetch_level_refuses_unknown_modes() -> None:
    with pytest.raises(ValueError, match="PAGODA_KV_PREFETCH='l3'"):
        cpu_kernels.kv_prefetch_level("l3", "AuthenticAMD")


def test_configure_kv_prefetch_sets_the_extension(monkeypatch: pytest.MonkeyPatch) -> None:
    _ext_or_skip()
    ext = cpu_kernels.load_extension()
    before = ext.kv_prefetch_l2()
    try:
        for vendor, want in (("AuthenticAMD", True), ("GenuineIntel", False)):
            monkeypatch.setattr("pagoda.cpu_features.cpu_vendor", lambda v=vendor: v)
            monkeypatch.delenv("PAGODA_KV_PREFETCH", raising=False)
            assert cpu_kernels.configure_kv_prefetch(ext) == ("l2" if want else "l1")
            assert ext.kv_prefetch_l2() is want
            monkeypatch.setenv("PAGODA_KV_PREFETCH", "l1" if want else "l2")
            cpu_kernels.configure_kv_prefetch(ext)
            assert ext.kv_prefetch_l2() is not want
    finally:
        ext.set_kv_prefetch_l2(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefetch_level_leaves_outputs_bit_identical(dtype: torch.dtype) -> None:
    """The prefetch hint moves no arithmetic: both levels give the same bits, over enough
    requests and tiles that every thread takes several items."""
    _ext_or_skip()
    ext = cpu_kernels.load_extension()
    before = ext.kv_prefetch_l2()
    case = _make_case(SEQ_LENS * 4, num_kv_heads=3, group=3, dtype=dtype, seed=11)
    q, k_cache, v_cache, bt, lens = case
    outs = []
    try:
        for l2 in (False, True):
            ext.set_kv_prefetch_l2(l2)
            assert ext.kv_prefetch_l2() is l2
            outs.append(_kernel(q, k_cache, v_cache, bt, lens, HEAD_DIM**-0.5, None))
    finally:
        ext.set_kv_prefetch_l2(before)
    assert torch.equal(outs[0], outs[1])
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(outs[1].double(), _naive(*case, None), atol=tol, rtol=tol)


# Ranges longer than one part (512 positions) in a call with fewer than two (request, kv
# head) pairs a CPU of the process: split into aligned parts that threads take apart and the
# last part of a head merges; windows make a range start between part boundaries.
LONG_LENS = [513, 1025, 2000, 512, 1500, 700]


def _parts(n: int, window: int | None, length: int) -> int:
    start = 0 if window is None else max(0, n - window)
    return (n - 1) // length - start // length + 1 if n - start > length else 0


def _splits(ext, rows: int, kv_heads: int) -> bool:
    return rows * kv_heads < 2 * ext.decode_split_cpus()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 600, 1100])
def test_long_ranges_split_into_parts_match_oracle(dtype: torch.dtype,
                                                   window: int | None) -> None:
    _ext_or_skip()
    ext = cpu_kernels.load_extension()
    length = ext.decode_split_len()
    assert length == 512
    case = _make_case(LONG_LENS, num_kv_heads=3, group=3, dtype=dtype, seed=5)
    q, k_cache, v_cache, bt, lens = case
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    want = _naive(*case, window)
    for i, n in enumerate(LONG_LENS):
        before = ext.decode_parts_run()
        out = _kernel(q[i : i + 1], k_cache, v_cache, bt[i : i + 1], lens[i : i + 1],
                      HEAD_DIM**-0.5, window)
        # NOTE: every kv head (3) of a range over 512 positions, one item per part met.
        parts = 3 * _parts(n, window, length) if _splits(ext, 1, 3) else 0
        assert ext.decode_parts_run() - before == parts
        torch.testing.assert_close(out[0].double(), want[i], atol=tol, rtol=tol)


def test_split_follows_the_batch_and_the_cpus_not_the_team_size() -> None:
    """Two (request, kv head) pairs a CPU or more share the threads whole: no part runs
    (splitting there cost more than it balanced). The decision and the bits do not change
    with the OpenMP team's size (worker/omp_team.py changes it with the load). Every call
    matches the oracle."""
    _ext_or_skip()
    ext = cpu_kernels.load_extension()
    cpus = ext.decode_split_cpus()
    rows_no_split = -(-2 * cpus // 3)  # NOTE: 3 kv heads a request
    lens = [1500, 1300] + [1100] * (rows_no_split - 2)
    case = _make_case(lens, num_kv_heads=3, group=3, dtype=torch.bfloat16, seed=9)
    q, k_cache, v_cache, bt, lens_t = case
    want = _naive(*case, None)
    threads = torch.get_num_threads()
    outs = {}
    try:
        for team in (1, 2):
            torch.set_num_threads(team)
            for rows in (1, rows_no_split):
                before = ext.decode_parts_run()
                outs[team, rows] = _kernel(q[:rows], k_cache, v_cache, bt[:rows],
                                           lens_t[:rows], HEAD_DIM**-0.5, None)
                assert (ext.decode_parts_run() > before) is _splits(ext, rows, 3)
                torch.testing.assert_close(outs[team, rows].double(), want[:rows], atol=1e-2,
                                           rtol=1e-2)
    finally:
        torch.set_num_threads(threads)
    assert cpus < 2 or _splits(ext, 1, 3)
    for rows in (1, rows_no_split):
        assert torch.equal(outs[1, rows], outs[2, rows])


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn])
def test_split_ranges_on_quantized_caches_match_the_dequantized_oracle(
        kv_dtype: torch.dtype) -> None:
    """The code paths (scaled rows read in place) through split ranges too."""
    _ext_or_skip()
    from pagoda.ops import kv_quant

    case = _make_case([1300], num_kv_heads=1, group=3, dtype=torch.float32, seed=13)
    q, k_cache, v_cache, bt, lens = case
    k_codes, k_scale = kv_quant.quantize(k_cache, kv_dtype)
    v_codes, v_scale = kv_quant.quantize(v_cache, kv_dtype)
    k_deq = kv_quant.dequantize(k_codes, k_scale, torch.float32)
    v_deq = kv_quant.dequantize(v_codes, v_scale, torch.float32)
    q = q.to(torch.bfloat16)
    ext = cpu_kernels.load_extension()
    out = torch.empty_like(q)
    before = ext.decode_parts_run()
    ext.paged_decode_attention(out, q, k_codes, v_codes, bt, lens, HEAD_DIM**-0.5, -1,
                               k_scale, v_scale)
    assert ext.decode_parts_run() - before == 3  # 1 kv head: parts [0, 512), ..., [1024, 1300)
    want = _naive(q.float(), k_deq, v_deq, bt, lens, None)
    torch.testing.assert_close(out.double(), want, atol=2e-2, rtol=2e-2)


def test_split_can_be_turned_off_for_comparisons() -> None:
    """`set_decode_split_len(0)` runs every range in one item (no part runs); both settings
    agree with the oracle, and differ at most by float32 rounding. Lengths other than
    multiples of 16 are refused."""
    _ext_or_skip()
    ext = cpu_kernels.load_extension()
    case = _make_case([1700], num_kv_heads=1, group=3, dtype=torch.float32, seed=21)
    q, k_cache, v_cache, bt, lens = case
    outs = []
    old = ext.decode_split_len()
    try:
        for length in (old, 0):
            ext.set_decode_split_len(length)
            before = ext.decode_parts_run()
            outs.append(_kernel(q, k_cache, v_cache, bt, lens, HEAD_DIM**-0.5, None))
            assert (ext.decode_parts_run() > before) is (length > 0)
        with pytest.raises(RuntimeError, match="multiple of 16"):
            ext.set_decode_split_len(100)
    finally:
        ext.set_decode_split_len(old)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(outs[0].double(), _naive(*case, None), atol=1e-5, rtol=1e-5)
