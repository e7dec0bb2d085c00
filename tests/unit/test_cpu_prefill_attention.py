"""The tiled C++ prefill-attention kernel (ops.paged_prefill_attention's CPU kernel) against
the PyTorch reference and a float64 oracle, and the paged backend's dispatch to it.

Requests are (query_len, seq_len): seq_len > query_len is a chunk after a cached prefix (or
a speculative verification's k + 1 rows); the query tiles of 64 / G rows (head dim <= 64)
straddle blocks, tiles of 16 positions and each other."""

from __future__ import annotations

import math

import pytest
import torch

from pagoda import cpu_features, ops
from pagoda.attention import torch_paged
from pagoda.attention.backend import AttentionMetadata, PrefillSeq
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.cpu_features import AmxStatus
from pagoda.ops import cpu_kernels, reference, registry
from pagoda.ops.kv_quant import quantize
from tests.helpers import spy_on_extension

REQUESTS = [(5, 5), (40, 40), (17, 50), (100, 130), (2, 90), (70, 70), (1, 33)]
CODES = [torch.int8, torch.uint8]  # uint8: fp8 e4m3fn bits


def _case(requests, hk, group, dtype, d=64, block_size=16, q_dtype=None, num_decodes=0,
          seed=0):
    """(q, k_cache, v_cache, tables, query_starts, query_lens, seq_lens): shuffled block ids,
    padded tables, large values in every slot no request reads; q has `num_decodes` rows
    (of no request) before the requests' rows."""
    g = torch.Generator().manual_seed(seed)
    nb = [math.ceil(s / block_size) for _, s in requests]
    num_blocks = 2 * sum(nb) + 3
    shape = (num_blocks, block_size, hk, d)
    k_cache = torch.randn(shape, generator=g)
    v_cache = torch.randn(shape, generator=g)
    used = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    ids = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(requests), max(nb) + 1, dtype=torch.int64)
    taken = 0
    for i, ((_, s), n) in enumerate(zip(requests, nb)):
        tables[i, :n] = ids[taken : taken + n]
        taken += n
        pos = torch.arange(s)
        used[tables[i, pos // block_size], pos % block_size] = True
    k_cache[~used], v_cache[~used] = 30.0, 1000.0
    qlens = torch.tensor([q for q, _ in requests])
    starts = num_decodes + torch.cumsum(qlens, 0) - qlens
    q = torch.randn(num_decodes + int(qlens.sum()), hk * group, d, generator=g)
    q = q.to(dtype if q_dtype is None else q_dtype)
    lens = torch.tensor([s for _, s in requests])
    return q, k_cache.to(dtype), v_cache.to(dtype), tables, starts, qlens, lens


def _naive(q, k_cache, v_cache, tables, starts, qlens, lens, window, scales=(None, None)):
    """Every request's rows, row by row, in float64; None where a row is no request's."""
    out = torch.full(q.shape, float("nan"), dtype=torch.float64)
    hk, d = k_cache.shape[2], k_cache.shape[3]
    group = q.shape[1] // hk
    for r in range(len(lens)):
        n, s0 = int(lens[r]), int(starts[r])
        keys = reference.gather_kv(k_cache, scales[0], tables[r : r + 1], n, torch.float64)[0]
        values = reference.gather_kv(v_cache, scales[1], tables[r : r + 1], n, torch.float64)[0]
        keys, values = (x.repeat_interleave(group, dim=1) for x in (keys, values))
        for i in range(int(qlens[r])):
            p = n - int(qlens[r]) + i
            lo = 0 if window is None else max(0, p - window + 1)
            sc = torch.einsum("hd,nhd->hn", q[s0 + i].double(), keys[lo : p + 1]) / math.sqrt(d)
            out[s0 + i] = torch.einsum("hn,nhd->hd", sc.softmax(-1), values[lo : p + 1])
    return out


def _tiled(*args):
    """The registered tiled kernel, called through dispatch's choice (asserting it is one)."""
    kernel = ops.paged_prefill_attention.select(*args)
    assert kernel is not ops.paged_prefill_attention.reference
    return kernel(*args)


def _check(case, window, tol, scales=(None, None), num_decodes=0):
    q = case[0]
    d = q.shape[2]
    args = (*case, d**-0.5, window, *(s for s in scales if s is not None))
    got = _tiled(*args)[num_decodes:]
    assert got.dtype == q.dtype
    want = _naive(*case, window, scales)[num_decodes:]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
    ref = reference.paged_prefill_attention(*args)[num_decodes:]
    torch.testing.assert_close(got.double(), ref.double(), atol=2 * tol, rtol=2 * tol)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, 5, 40])
def test_float32_matches_oracle_and_reference(tiled, ext, group: int, window: int | None) -> None:
    case = _case(REQUESTS, 2, group, torch.float32, seed=group, num_decodes=3)
    _check(case, window, 1e-5, num_decodes=3)


@pytest.fixture(autouse=True)
def no_sdpa(monkeypatch):
    """Fresh long prefills stay on the kernels (on an AMX CPU they would take SDPA, which
    the tests that want it turn on themselves)."""
    monkeypatch.setattr(torch_paged, "_sdpa_prefill", False)


@pytest.fixture(autouse=True)
def vector_path():
    """The vector path's tests: the AMX path (on by default where it runs) is off; its own
    tests (`amx`) turn it on."""
    ext = None if cpu_kernels.kernels_disabled() else cpu_kernels.load_extension()
    if ext is None:
        yield
        return
    was = ext.prefill_amx_enabled()
    ext.set_prefill_amx(False)
    try:
        yield
    finally:
        ext.set_prefill_amx(was)


@pytest.fixture
def tiled(ext):
    """The tests of the tiled kernel itself: skipped, saying why, where it cannot run (it needs
    AVX-512 or AVX2 + FMA; prefill rows take the decode kernel there, tested below)."""
    if cpu_kernels.kernel_for("paged_prefill_attention") is None:
        pytest.skip("the tiled prefill kernel needs AVX-512 or AVX2 + FMA, in this build and "
                    f"CPU (build: {ext.kernel_isa()['paged_prefill_attention']})")


@pytest.fixture(params=[True, False], ids=["bf16_dot", "fp32_fma"])
def bf16_path(request: pytest.FixtureRequest, ext, tiled):
    """Both inner paths for bf16: vdpbf16ps (where the CPU has AVX512_BF16) and the fp32-FMA
    fallback of CPUs without it."""
    path = ext.set_bf16_dot(request.param)
    try:
        yield path
    finally:
        ext.set_bf16_dot(True)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, 33])
def test_bfloat16_paths_match_oracle(bf16_path: str, group: int, window: int | None) -> None:
    # NOTE: float32 accumulation, one rounding to bf16 (~4e-3 relative), as the decode kernel.
    _check(_case(REQUESTS, 2, group, torch.bfloat16, seed=7 + group), window, 1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 96, 128, 256])
@pytest.mark.parametrize("group", [1, 4])
def test_head_dims(tiled, ext, dtype: torch.dtype, head_dim: int, group: int) -> None:
    """Head dims with other tile heights (64 / G rows up to 64, 32 / G to 128, 16 / G)."""
    requests = [(70, 70), (3, 40), (33, 60)]
    case = _case(requests, 2, group, dtype, d=head_dim, seed=head_dim)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    _check(case, None, tol)
    _check(case, 21, tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 8, 24, 32])
def test_block_sizes(tiled, ext, dtype: torch.dtype, block_size: int) -> None:
    """Tiles of 16 positions over several blocks or parts of one."""
    case = _case(REQUESTS, 3, 3, dtype, block_size=block_size, seed=block_size)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    _check(case, None, tol)
    _check(case, 21, tol)


def test_float32_query_on_bfloat16_cache_is_near_exact(bf16_path: str) -> None:
    case = _case(REQUESTS, 3, 3, torch.bfloat16, q_dtype=torch.float32, seed=9)
    _check(case, 20, 1e-5)


@pytest.mark.parametrize("code", CODES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("d", "block_size", "hk", "group"), [(64, 16, 2, 4), (64, 8, 1, 3), (96, 32, 2, 2),
                                         (128, 1, 2, 1)],
)
def test_quantized_caches(tiled, ext, code, q_dtype, d, block_size, hk, group) -> None:
    """int8 / fp8 codes read in place (codes staged as exact bf16 on the dot path)."""
    q, k_cache, v_cache, tables, starts, qlens, lens = _case(
        REQUESTS, hk, group, torch.float32, d=d, block_size=block_size, q_dtype=q_dtype,
        seed=d + group)
    k_codes, k_scale = quantize(k_cache * 2, code)
    v_codes, v_scale = quantize(v_cache, code)
    k_scale[0, 0, 0] = 0.0  # an all-zero row (scale 0) is just another key
    k_codes[0, 0, 0] = 0
    case = (q, k_codes, v_codes, tables, starts, qlens, lens)
    tol = 1e-5 if q_dtype == torch.float32 else 1e-2
    for window in (None, 9):
        _check(case, window, tol, scales=(k_scale, v_scale))


def test_window_reads_nothing_before_it(tiled, ext) -> None:
    """A windowed group nulls the table entries before a chunk's window (core/kv_groups):
    those entries are neither read nor checked."""
    requests = [(20, 100), (8, 64)]
    window = 24
    case = _case(requests, 2, 2, torch.bfloat16, block_size=8, seed=4)
    q, k_cache, v_cache, tables, starts, qlens, lens = case
    freed = tables.clone()
    for r, (query_len, seq_len) in enumerate(requests):
        first_read = max(0, seq_len - query_len - window + 1) // 8
        freed[r, :first_read] = 10**6
    args = (q, k_cache, v_cache, freed, starts, qlens, lens, 0.125, window)
    want = reference.paged_prefill_attention(*case, 0.125, window)
    torch.testing.assert_close(_tiled(*args), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("bad", "match"), [(-1, "out of range"), (10**6, "out of range")])
def test_out_of_range_block_id_is_a_clear_error(tiled, ext, bad: int, match: str) -> None:
    q, k_cache, v_cache, tables, starts, qlens, lens = _case([(5, 20)], 1, 2, torch.float32)
    tables[0, 1] = bad
    with pytest.raises(RuntimeError, match=match):
        _tiled(q, k_cache, v_cache, tables, starts, qlens, lens, 0.125)


def test_rows_outside_q_or_context_are_refused(tiled, ext) -> None:
    q, k_cache, v_cache, tables, starts, qlens, lens = _case([(5, 20)], 1, 2, torch.float32)
    with pytest.raises(RuntimeError, match="outside q"):
        _tiled(q, k_cache, v_cache, tables, starts + 1, qlens, lens, 0.125)
    with pytest.raises(RuntimeError, match="seq_len"):
        _tiled(q, k_cache, v_cache, tables, starts, qlens, lens.clone().fill_(4), 0.125)


# ---- the paged backend's dispatch ----------------------------------------------------------
def _metadata(case, num_decodes: int, decode_lens: list[int], tiled: bool) -> AttentionMetadata:
    """A step of `num_decodes` decodes (reading request 0's table) then the case's prefills;
    tiled=False leaves out the prefill arrays (only the per-token rows path remains)."""
    tables, starts, qlens, lens = case[3:]
    decode_tables = tables[:1].expand(num_decodes, -1).contiguous()
    token_tables = [decode_tables]
    token_lens = [torch.tensor(decode_lens)]
    prefills = []
    for r in range(len(lens)):
        n, s = int(qlens[r]), int(lens[r])
        prefills.append(PrefillSeq(int(starts[r]), n, s, tables[r, : math.ceil(s / 16)]))
        token_tables.append(tables[r : r + 1].expand(n, -1))
        token_lens.append(torch.arange(s - n, s) + 1)
    arrays = {}
    if tiled:
        arrays = {"prefill_query_starts": starts, "prefill_query_lens": qlens,
                  "prefill_seq_lens": lens, "prefill_block_tables": tables}
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decode_tokens=num_decodes,
        decode_block_tables=decode_tables,
        decode_seq_lens=torch.tensor(decode_lens),
        decode_max_seq_len=max(decode_lens),
        prefills=prefills,
        token_block_tables=torch.cat(token_tables),
        token_seq_lens=torch.cat(token_lens),
        **arrays,
    )


@pytest.mark.parametrize("window", [None, 30])
def test_backend_takes_tiled_prefill_and_decode_kernels(tiled, ext, monkeypatch, window) -> None:
    """A mixed bf16 step: decode rows through the decode kernel, prefill rows through the
    tiled kernel, one call each, equal to the per-token rows path and the oracle."""
    case = _case(REQUESTS, 3, 3, torch.bfloat16, num_decodes=2, seed=21)
    q, k_cache, v_cache = case[:3]
    backend = TorchPagedAttention(9, 3, 64, window)
    calls = spy_on_extension(ext, monkeypatch)
    md = _metadata(case, 2, [7, 16], tiled=True)
    got = backend.forward(q, q[:, :0], q[:, :0], (k_cache, v_cache), md, kv_written=True)
    assert calls.count("paged_prefill_attention") == 1
    assert calls.count("paged_decode_attention") == 1
    rows = backend.forward(q, q[:, :0], q[:, :0], (k_cache, v_cache),
                           _metadata(case, 2, [7, 16], tiled=False), kv_written=True)
    assert calls.count("paged_decode_attention") == 2 and calls.count(
        "paged_prefill_attention") == 1
    torch.testing.assert_close(got.float(), rows.float(), atol=2e-2, rtol=2e-2)
    want = _naive(*case, window)[2:]
    torch.testing.assert_close(got.view_as(q)[2:].double(), want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("group", [1, 4])
def test_requests_with_few_query_vectors_take_the_decode_kernel(tiled, ext, monkeypatch, group) -> None:
    """Query rows x G below TILED_MIN_QUERY_VECTORS (speculative k + 1 rows, short chunks)
    go with the decode rows through the decode kernel, the others through the tiled one:
    one call each, and all rows right. G = 4: 4 rows are enough, 3 are not."""
    requests = [(3, 40), (20, 20), (4, 90), (2, 17), (16, 50)]
    case = _case(requests, 2, group, torch.bfloat16, num_decodes=2, seed=group)
    q, k_cache, v_cache = case[:3]
    backend = TorchPagedAttention(2 * group, 2, 64)
    calls = spy_on_extension(ext, monkeypatch)
    md = _metadata(case, 2, [7, 16], tiled=True)
    got = backend.forward(q, q[:, :0], q[:, :0], (k_cache, v_cache), md, kv_written=True)
    assert calls.count("paged_prefill_attention") == 1
    assert calls.count("paged_decode_attention") == 1
    arrays, rows, fresh = md.memo[("tiled_split", group, False)]
    assert fresh == []
    tiled_lens = [n for n, _ in requests if n * group >= 16]
    assert arrays[2].tolist() == tiled_lens
    assert len(rows) == 2 + sum(n for n, _ in requests) - sum(tiled_lens)
    want = _naive(*case, None)[2:]
    torch.testing.assert_close(got.view_as(q)[2:].double(), want, atol=1e-2, rtol=1e-2)
    rows_only = backend.forward(q, q[:, :0], q[:, :0], (k_cache, v_cache),
                                _metadata(case, 2, [7, 16], tiled=False), kv_written=True)
    torch.testing.assert_close(got[:2].float(), rows_only[:2].float())


def test_other_head_dims_keep_the_decode_kernels_rows(ext, monkeypatch) -> None:
    """Head dim 80 has no tiled kernel: every row goes through the decode kernel."""
    case = _case([(6, 20)], 1, 2, torch.bfloat16, d=80, num_decodes=1)
    q, k_cache, v_cache, *_ = case
    args = (*case, 80**-0.5)
    assert ops.paged_prefill_attention.select(*args) is ops.paged_prefill_attention.reference
    calls = spy_on_extension(ext, monkeypatch)
    backend = TorchPagedAttention(2, 1, 80)
    out = backend.forward(q, q[:, :0], q[:, :0], (k_cache, v_cache),
                          _metadata(case, 1, [20], tiled=True), kv_written=True)
    assert [c for c in calls if c.startswith("paged")] == ["paged_decode_attention"]
    torch.testing.assert_close(out.view_as(q)[1:].double(), _naive(*case, None)[1:],
                               atol=1e-2, rtol=1e-2)


def test_cpu_without_its_isa_has_no_tiled_kernel(ext, monkeypatch) -> None:
    """Mocked flags without AVX-512 and AVX2: the tiled kernel is never chosen (no SIGILL);
    an AVX-512 build never runs on an AVX2-only CPU, an AVX2 build does."""
    avx2 = frozenset({"avx2", "fma", "f16c"})
    assert not cpu_kernels.isa_allows("paged_prefill_attention", [], avx2)
    assert not cpu_kernels.isa_allows("paged_prefill_attention", ["avx512f"], avx2)
    assert cpu_kernels.isa_allows("paged_prefill_attention", ["avx2", "fma"], avx2)
    flags = frozenset(f for f in cpu_kernels.cpu_flags()
                      if not f.startswith("avx512") and f not in ("avx2", "fma"))
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: flags)
    monkeypatch.setattr(cpu_kernels, "_allowed", {})
    registry.refresh()
    q = torch.zeros(2, 2, 64, dtype=torch.bfloat16)
    assert ops.paged_prefill_attention.kernel_for(q) is None
    registry.refresh()  # NOTE: no resolution made under the mocked flags outlives the test


def _fresh_kv(case, num_decodes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [T, Hk, D] as the step computed them: each request's rows read back from its
    cache slots (what a bf16 cache stores bit for bit); zeros for the decode rows."""
    q, k_cache, v_cache, tables, starts, qlens, lens = case
    k = torch.zeros(q.shape[0], *k_cache.shape[2:], dtype=k_cache.dtype)
    v = torch.zeros_like(k)
    bs = k_cache.shape[1]
    for r in range(len(lens)):
        n, s, a = int(qlens[r]), int(lens[r]), int(starts[r])
        pos = torch.arange(s - n, s)
        blocks, offs = tables[r, pos // bs], pos % bs
        k[a : a + n], v[a : a + n] = k_cache[blocks, offs], v_cache[blocks, offs]
    return k, v


@pytest.mark.parametrize("requests", [
    [(70, 70), (100, 130), (2, 90), (64, 64), (40, 40)],  # SDPA, tiled and the decode kernel
    [(70, 70), (300, 300)],  # SDPA alone
], ids=["mixed", "sdpa_only"])
def test_long_fresh_prefills_take_sdpa_where_enabled(tiled, ext, monkeypatch, requests) -> None:
    """With SDPA on (AMX CPUs): bf16 prefills of SDPA_MIN_QUERY_LEN tokens with nothing cached
    before them run SDPA on their own K/V, the rest of the step the kernels as before; every
    row right."""
    monkeypatch.setattr(torch_paged, "_sdpa_prefill", True)
    nd = 2 if len(requests) > 2 else 0
    case = _case(requests, 3, 3, torch.bfloat16, num_decodes=nd, seed=31)
    q, k_cache, v_cache = case[:3]
    k, v = _fresh_kv(case, nd)
    backend = TorchPagedAttention(9, 3, 64)
    calls = spy_on_extension(ext, monkeypatch)
    md = _metadata(case, nd, [7, 16], tiled=True)
    got = backend.forward(q, k, v, (k_cache, v_cache), md, kv_written=True)
    _, _, fresh = md.memo[("tiled_split", 3, True)]
    starts = case[4]
    want_fresh = [(int(starts[i]), n) for i, (n, s) in enumerate(requests)
                  if n == s and n >= torch_paged.SDPA_MIN_QUERY_LEN]
    assert fresh == want_fresh and len(fresh) == 2
    assert calls.count("paged_prefill_attention") == (1 if nd else 0)
    assert calls.count("paged_decode_attention") == (1 if nd else 0)
    want = _naive(*case, None)[nd:]
    torch.testing.assert_close(got.view_as(q)[nd:].double(), want, atol=1e-2, rtol=1e-2)


def test_sdpa_prefill_stays_off_for_quantized_caches_windows_and_float32(monkeypatch) -> None:
    monkeypatch.setattr(torch_paged, "_sdpa_prefill", True)
    q = torch.zeros(4, 9, 64, dtype=torch.bfloat16)
    cache = torch.zeros(4, 16, 3, 64, dtype=torch.bfloat16)
    assert TorchPagedAttention(9, 3, 64)._sdpa_takes(q, cache, [])
    assert not TorchPagedAttention(9, 3, 64, 32)._sdpa_takes(q, cache, [])
    assert not TorchPagedAttention(9, 3, 64)._sdpa_takes(q, cache.to(torch.int8),
                                                         [torch.ones(1), torch.ones(1)])
    assert not TorchPagedAttention(9, 3, 64)._sdpa_takes(q.float(), cache.float(), [])


@pytest.mark.parametrize(("mode", "amx", "kernel_amx", "want"), [
    ("auto", True, False, True), ("auto", True, True, False), ("auto", False, False, False),
    ("on", False, False, True), ("on", True, True, True), ("off", True, False, False)])
def test_sdpa_prefill_mode(monkeypatch, mode: str, amx: bool, kernel_amx: bool,
                           want: bool) -> None:
    """auto: SDPA where AMX runs, unless the tiled kernel runs on AMX itself."""
    flags = frozenset({"avx512f", "amx_bf16", "amx_tile"} if amx else {"avx512f"})
    monkeypatch.setattr(cpu_features, "cpu_info", lambda: ("cpu", flags))
    monkeypatch.setattr(cpu_features, "request_amx_tiles", lambda: AmxStatus(amx, "mocked"))
    monkeypatch.setattr(ops, "prefill_attention_on_amx", lambda: kernel_amx)
    monkeypatch.setattr(torch_paged, "_sdpa_prefill", None)
    monkeypatch.setenv("PAGODA_PREFILL_SDPA", mode)
    assert torch_paged.sdpa_prefill_enabled() is want
    monkeypatch.setattr(torch_paged, "_sdpa_prefill", None)
    monkeypatch.setenv("PAGODA_PREFILL_SDPA", "amx")
    with pytest.raises(ValueError, match="PAGODA_PREFILL_SDPA"):
        torch_paged.sdpa_prefill_enabled()


# ---------------------------------------------------------------------------------------
# The AMX path (paged_prefill_amx_cpu.cpp): bf16 q and cache, head dims multiple of 64.

LONG_REQUESTS = [(150, 700), (64, 64), (65, 600), (0, 20), (3, 3), (200, 200)]


@pytest.fixture
def amx(ext, tiled):
    """The AMX path on; skipped, saying why, where it cannot run."""
    if not ext.prefill_amx_compiled():
        pytest.skip("this build has no AMX prefill path (it needs AMX-TILE, AMX-BF16 and "
                    "AVX512-BF16 at compile time: an Intel CPU with AMX)")
    if not cpu_features.amx_bf16_usable():
        pytest.skip("this process may not use bf16 AMX (no amx_bf16, or tiles refused)")
    ext.set_prefill_amx(True)
    yield ext
    ext.set_prefill_amx(False)


@pytest.mark.parametrize("group", [1, 3, 4])
@pytest.mark.parametrize("window", [None, 33, 200])
def test_amx_matches_oracle(amx, group: int, window: int | None) -> None:
    """Short and long requests: cached prefixes, items of 64 rows, several 512-key chunks,
    empty queries; causal and window masks."""
    _check(_case(REQUESTS + LONG_REQUESTS, 2, group, torch.bfloat16, seed=40 + group,
                 num_decodes=2), window, 1e-2, num_decodes=2)


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("block_size", [1, 8, 24, 32])
def test_amx_head_dims_and_block_sizes(amx, head_dim: int, block_size: int) -> None:
    _check(_case(REQUESTS, 2, 2, torch.bfloat16, d=head_dim, block_size=block_size,
                 seed=head_dim + block_size), None, 1e-2)


@pytest.mark.parametrize("window", [None, 300])
def test_amx_rescales_when_a_later_key_outscores_the_running_max(amx, window) -> None:
    """Keys grow with their position, so a row's max keeps rising by more than the slack the
    kernel lets its running max lag by: the P V of the blocks before is brought up and O
    rescaled, mid-chunk and across chunks, many times per row."""
    requests = [(600, 700), (64, 64), (100, 1100)]
    case = list(_case(requests, 1, 3, torch.float32, seed=21))
    k_cache, tables, block_size = case[1].clone(), case[3], case[1].shape[1]
    for r, (_, s) in enumerate(requests):
        pos = torch.arange(s)
        k_cache[tables[r, pos // block_size], pos % block_size] *= (1 + pos / 16.0)[:, None, None]
    case[1] = k_cache
    case = [x.bfloat16() if x.is_floating_point() else x for x in case]
    _check(tuple(case), window, 1e-2)


def test_amx_runs_and_agrees_with_the_vector_path(amx, monkeypatch) -> None:
    """The AMX path is what runs (its results differ from the vector path's in the last
    bits: another summation order), and the two agree to bf16 rounding."""
    case = _case(REQUESTS + LONG_REQUESTS, 3, 3, torch.bfloat16, seed=5)
    args = (*case, 0.125, None)
    got = _tiled(*args)
    amx.set_prefill_amx(False)
    vec = _tiled(*args)
    amx.set_prefill_amx(True)
    assert not torch.equal(got, vec)
    torch.testing.assert_close(got.float(), vec.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize(("dtype", "head_dim"), [
    (torch.float32, 64), (torch.bfloat16, 32), (torch.bfloat16, 96)])
def test_amx_leaves_float32_and_other_head_dims_to_the_vector_path(amx, dtype, head_dim) -> None:
    """Bit for bit the vector path's results with the AMX path on: it does not take them."""
    case = _case(REQUESTS, 2, 3, dtype, d=head_dim, seed=11)
    args = (*case, head_dim**-0.5, None)
    got = _tiled(*args)
    amx.set_prefill_amx(False)
    assert torch.equal(got, _tiled(*args))
    amx.set_prefill_amx(True)


def test_amx_leaves_quantized_caches_to_the_vector_path(amx) -> None:
    case = _case(REQUESTS, 2, 3, torch.float32, seed=13)
    q, k_cache, v_cache = case[:3]
    k_codes, k_scale = quantize(k_cache, torch.int8)
    v_codes, v_scale = quantize(v_cache, torch.int8)
    args = (q.bfloat16(), k_codes, v_codes, *case[3:], 0.125, None, k_scale, v_scale)
    got = _tiled(*args)
    amx.set_prefill_amx(False)
    assert torch.equal(got, _tiled(*args))
    amx.set_prefill_amx(True)


def test_amx_refuses_bad_block_ids_before_running(amx) -> None:
    case = list(_case(REQUESTS, 2, 3, torch.bfloat16, seed=17))
    case[3] = case[3].clone()
    case[3][2, 0] = 10**6
    with pytest.raises(RuntimeError, match="out of range"):
        _tiled(*case, 0.125, None)


@pytest.mark.parametrize(("mode", "usable", "compiled", "want"), [
    ("auto", True, True, True), ("auto", False, True, False), ("auto", True, False, False),
    ("off", True, True, False)])
def test_prefill_amx_mode(mode: str, usable: bool, compiled: bool, want: bool) -> None:
    assert cpu_kernels.prefill_amx_allowed(mode, usable, compiled) is want


def test_prefill_amx_mode_is_checked() -> None:
    with pytest.raises(ValueError, match="PAGODA_PREFILL_AMX"):
        cpu_kernels.prefill_amx_allowed("on", True, True)


def test_configure_prefill_amx_follows_the_cpu_and_environment(ext, monkeypatch) -> None:
    monkeypatch.setattr(cpu_features, "cpu_info", lambda: ("cpu", frozenset({"avx512f"})))
    assert cpu_kernels.configure_prefill_amx(ext) is False and not ext.prefill_amx_enabled()
    monkeypatch.setenv("PAGODA_PREFILL_AMX", "off")
    monkeypatch.setattr(cpu_features, "cpu_info", lambda: ("cpu", frozenset({"amx_bf16"})))
    monkeypatch.setattr(cpu_features, "request_amx_tiles", lambda: AmxStatus(True, "mocked"))
    assert cpu_kernels.configure_prefill_amx(ext) is False and not ext.prefill_amx_enabled()
    monkeypatch.setenv("PAGODA_PREFILL_AMX", "auto")
    assert cpu_kernels.configure_prefill_amx(ext) is ext.prefill_amx_compiled()
    ext.set_prefill_amx(False)


def test_set_prefill_amx_refuses_a_build_without_it(ext) -> None:
    if ext.prefill_amx_compiled():
        pytest.skip("this build has the AMX path (the refusal is for builds without it)")
    with pytest.raises(RuntimeError, match="not in this build"):
        ext.set_prefill_amx(True)
