"""The CPU quantized-linear kernels (ops/quant_cpu.py) against the wquant references.

Tolerances, and why: gguf_linear and wq_linear quantize the activations to int8 per block
(32 values; 16 for Q6_K) at every row count, so they are compared with the exact product of
those quantized activations (`_quantized_acts`, the kernel's rounding rule replayed) and
the dequantized weight, in float64: what is left is float32 summation order (atol 2e-5 of
the largest output; bf16 outputs also carry their final rounding, 2**-8 relative). Row
counts cover every tail of the kernel's 4-row tiles and an odd panel count (N = 37: 3
panels of 16, the last one partly padding). int8_linear (W8A8) is exact: equal to the
reference bit for bit. These tests pin the panel kernel at every row count (`panel_kernel`);
the wide products' tiled path (AMX CPUs) has its own tests at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.ops import quant_cpu, quant_layouts, wquant
from pagoda.ops.registry import OPS
from tests.helpers import panels_as_dense

gguf_quants = pytest.importorskip("gguf.quants")


@pytest.fixture(autouse=True)
def panel_kernel():
    """The int8 panel kernel at every row count (on an AMX CPU wide bf16 products would take
    the AMX kernel or the tiled path); this process's choice is put back after each test."""
    ext = quant_cpu.resolve()
    if ext is None:
        yield
        return
    chosen, amx = quant_cpu.wide_min_rows(), quant_cpu.amx_min_rows()
    quant_cpu.set_amx_min_rows(ext, None)
    quant_cpu.set_wide_min_rows(ext, None)
    yield
    quant_cpu.set_wide_min_rows(ext, chosen)
    quant_cpu.set_amx_min_rows(ext, amx)

MS = [1, 2, 3, 4, 17, 64, 300]
QUANTIZABLE = {quant_layouts.Q4_0: "Q4_0", quant_layouts.Q4_1: "Q4_1", quant_layouts.Q8_0: "Q8_0"}
KQUANTS = {quant_layouts.Q4_K: "Q4_K", quant_layouts.Q5_K: "Q5_K", quant_layouts.Q6_K: "Q6_K"}


def _quantized_acts(x: torch.Tensor, block: int) -> torch.Tensor:
    """x with each block rounded as the kernel does: d = max|x| / 127, round(x * (1 / d)) * d."""
    m, k = x.shape
    kp = -(-k // block) * block
    xp = torch.zeros(m, kp)
    xp[:, :k] = x.float()
    xb = xp.view(m, -1, block)
    d = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d != 0, 1 / d, torch.zeros_like(d))
    return (torch.round(xb * inv) * d).view(m, kp)[:, :k].double()


def _check_against_acts(y, x, w_deq, bias, block: int) -> None:
    ref = _quantized_acts(x, block) @ w_deq.double().T
    if bias is not None:
        ref = ref + bias.double()
    scale = ref.abs().max().item()
    if x.dtype == torch.float32:
        torch.testing.assert_close(y.double(), ref, rtol=0, atol=2e-5 * scale)
    else:
        torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=2e-5 * scale)


def _check(op, x, w, bias, block: int) -> None:
    assert not _runs_reference(op, x, w, bias)
    y = op(x, w, bias)
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    _check_against_acts(y, x, _deq(w), bias, block)


def _deq(w) -> torch.Tensor:
    return w.dequantize().to(torch.float32)


def _random_kquant_blocks(qtype: int, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Valid K-quant super-blocks: random codes and sub-block scales, finite float16 d / dmin."""
    nbytes = quant_layouts.GGUF_BLOCK[qtype][1]
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
    if qtype == quant_layouts.Q6_K:
        raw[:, 208:210] = d
    else:
        dmin = rng.uniform(0.001, 0.01, size=(n_blocks, 1)).astype(np.float16).view(np.uint8)
        raw[:, 0:2], raw[:, 2:4] = d, dmin
    return raw


def _gguf_weight(qtype: int, n: int, k: int, seed: int) -> wquant.GGUFWeight:
    rng = np.random.default_rng(seed)
    if qtype in QUANTIZABLE:
        raw = gguf_quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    else:
        values = quant_layouts.GGUF_BLOCK[qtype][0]
        raw = _random_kquant_blocks(qtype, n * k // values, rng).reshape(n, -1)
    w = wquant.GGUFWeight(torch.from_numpy(np.ascontiguousarray(raw)), qtype, (n, k))
    wquant.prepare("gguf_linear", w, "cpu")
    return w


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *KQUANTS],
                         ids=[*QUANTIZABLE.values(), *KQUANTS.values()])
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_gguf_linear_matches_reference(qext, qtype: int, dtype: torch.dtype) -> None:
    k = 96 if qtype in QUANTIZABLE else 512  # 96: three blocks, an odd count (padded pair)
    for n, k_ in ((37, k), (64, 2 * k + (256 if qtype in KQUANTS else 32))):
        w = _gguf_weight(qtype, n, k_, seed=n + qtype)
        assert "cpp" in w.kernel_data
        block = 16 if qtype == quant_layouts.Q6_K else 32
        for m in MS:
            x = torch.randn(m, k_, generator=torch.Generator().manual_seed(m)).to(dtype)
            bias = torch.randn(n).to(dtype) if m % 2 else None
            _check(wquant.gguf_linear, x, w, bias, block)


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *KQUANTS],
                         ids=[*QUANTIZABLE.values(), *KQUANTS.values()])
def test_gguf_layout_dequantizes_exactly(qext, qtype: int) -> None:
    w = _gguf_weight(qtype, 19, 512, seed=qtype)
    lay = w.kernel_data["cpp"]
    assert lay.codes.shape == (2, 512 * 2 * lay.bits)  # 19 rows: two panels of 16
    torch.testing.assert_close(lay.dequantize(), _deq(w), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("qtype", list(QUANTIZABLE), ids=list(QUANTIZABLE.values()))
def test_gguf_layout_gives_back_the_blocks_and_gguf_values(qtype: int) -> None:
    """Q4_0 / Q4_1 / Q8_0: the layout alone rebuilds the raw blocks bit for bit and
    dequantizes to exactly gguf's values, whole or by rows (the loader drops `raw`)."""
    rng = np.random.default_rng(qtype)
    raw = torch.from_numpy(np.ascontiguousarray(
        gguf_quants.quantize(rng.standard_normal((37, 96)).astype(np.float32), qtype)))
    lay = quant_layouts.from_gguf(raw, qtype, (37, 96))
    assert torch.equal(quant_layouts.to_gguf(lay, qtype), raw)
    dropped = wquant.GGUFWeight(None, qtype, (37, 96), layout=lay)
    full = wquant.GGUFWeight(raw, qtype, (37, 96)).dequantize()
    assert torch.equal(dropped.dequantize(), full) and torch.equal(dropped.blocks(), raw)
    rows = torch.tensor([36, 0, 17, 17, 5])
    assert torch.equal(dropped.dequantize_rows(rows), full[rows])
    with pytest.raises(ValueError, match="does not hold its blocks"):
        quant_layouts.to_gguf(lay, quant_layouts.Q4_K)


@pytest.mark.parametrize("qtype", list(QUANTIZABLE), ids=list(QUANTIZABLE.values()))
def test_dequantize_rows_kernel_equals_the_layouts_reference(qext, qtype: int) -> None:
    """The token table's lookups (GGUFEmbeddingMethod) in one call: bit for bit the
    layout's own row dequantization, in float32 and in bf16 (rounded once)."""
    lay = _gguf_weight(qtype, 37, 96, seed=qtype).kernel_data["cpp"]
    rows = torch.tensor([36, 0, 17, 17, 5, 16])
    ref = lay.dequantize_rows(rows)
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(quant_cpu.dequantize_rows(lay, rows, dtype), ref.to(dtype))
    with pytest.raises(RuntimeError, match="out of range"):
        quant_cpu.dequantize_rows(lay, torch.tensor([37]), torch.float32)


def test_scales_by_panel_and_by_group_give_the_same_bits(qext) -> None:
    """Layouts hold scales and offsets panel by panel ([panels, G, 16]: one stream per
    thread); a loaded GPTQ/AWQ [G, N] tensor is kept as it is. The kernels read both, to the
    same bits, at one row (the single-row path) and at several, and so do the references."""
    import dataclasses

    lay = _gguf_weight(quant_layouts.Q4_1, 37, 96, seed=3).kernel_data["cpp"]
    assert lay.scales.shape == (3, 3, 16) and lay.offsets.shape == (3, 3, 16)
    by_group = dataclasses.replace(
        lay, scales=quant_layouts._per_row(lay.scales).T.contiguous(),
        offsets=quant_layouts._per_row(lay.offsets).T.contiguous())
    assert by_group.scales.shape == (3, 48)
    assert torch.equal(by_group.dequantize(), lay.dequantize())
    rows = torch.tensor([36, 0, 17, 5])
    assert torch.equal(by_group.dequantize_rows(rows), lay.dequantize_rows(rows))
    for m in (1, 3, 17):
        x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        ys = [qext.q_linear(x, t.codes, t.scales, t.offsets, t.bits, t.block, t.group,
                            t.zero_form, 37, None) for t in (lay, by_group)]
        assert torch.equal(ys[0], ys[1])
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(quant_cpu.dequantize_rows(by_group, rows, dtype),
                           quant_cpu.dequantize_rows(lay, rows, dtype))
    with pytest.raises(RuntimeError, match="scales and offsets must be contiguous"):
        qext.q_linear(x, lay.codes, lay.scales[:2], lay.offsets[:2], 4, 32, 32, False, 37, None)


def _group_weight(bits: int, n: int, k: int, group: int, perm: bool, seed: int,
                  zero_shift: float = 0.0):
    g = torch.Generator().manual_seed(seed)
    groups = -(-k // group)
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, groups, generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g).float() + zero_shift
    p = torch.randperm(k, generator=g) if perm else None
    w = wquant.GroupQuantWeight(q, scales, zeros, bits, group, p)
    wquant.prepare("wq_linear", w, "cpu")
    return w


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("group,k", [(32, 200), (64, 576), (128, 576), (100, 100)])
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_wq_linear_matches_reference(qext, bits: int, group: int, k: int, dtype) -> None:
    # NOTE: zeros off the integers (k = 200) are held as float32, not uint8: the other path.
    w = _group_weight(bits, 37, k, group, perm=group == 64, seed=bits * group,
                      zero_shift=0.5 if k == 200 else 0.0)
    assert "cpp" in w.kernel_data
    assert w.layout.offsets.dtype == (torch.float16 if k == 200 else torch.uint8)
    for m in MS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype)
        bias = torch.randn(37).to(dtype) if m % 2 else None
        xp = x if w.perm is None else x.index_select(-1, w.perm)
        assert not _runs_reference(wquant.wq_linear, x, w, bias)
        _check_against_acts(wquant.wq_linear(x, w, bias), xp, _deq(w), bias, 32)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_single_row_products_split_over_threads(qext, threads: int) -> None:
    """M = 1 runs the single-row path: each thread an equal share of whole panels, one at a
    time: 13 panels (N = 200) over 1, 2 and 3 threads give shares of unequal sizes."""
    ws = [_gguf_weight(q, 200, 96, seed=q) for q in (quant_layouts.Q4_1, quant_layouts.Q8_0)]
    ws.append(_group_weight(4, 200, 128, 64, perm=False, seed=11))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for w in ws:
            op = wquant.gguf_linear if isinstance(w, wquant.GGUFWeight) else wquant.wq_linear
            x = torch.randn(1, w.shape[1], generator=torch.Generator().manual_seed(threads))
            _check(op, x.to(torch.bfloat16), w, torch.randn(200).to(torch.bfloat16), 32)
    finally:
        torch.set_num_threads(before)


def test_single_row_streams_give_the_same_bits(qext) -> None:
    """On AVX-512 a thread walks its share of a single-row product as several streams of
    panels side by side (2 by default). Each panel is computed alone in the same order, so
    1 to 4 streams give the same bits: shares of 1 to 38 panels (too short for two a
    stream, or leaving a remainder), 4- and 8-bit codes, [G, N] scales, 1 to 3 threads."""
    import dataclasses

    q41 = _gguf_weight(quant_layouts.Q4_1, 600, 96, seed=31).kernel_data["cpp"]
    by_group = dataclasses.replace(
        q41, scales=quant_layouts._per_row(q41.scales).T.contiguous(),
        offsets=quant_layouts._per_row(q41.offsets).T.contiguous())
    cases = [(q41, 600), (by_group, 600),
             (_gguf_weight(quant_layouts.Q8_0, 200, 128, seed=32).kernel_data["cpp"], 200),
             (_gguf_weight(quant_layouts.Q4_0, 37, 64, seed=33).kernel_data["cpp"], 37),
             (_group_weight(4, 300, 256, 64, perm=False, seed=34).layout, 300)]
    before = torch.get_num_threads()
    was = qext.set_gemv_streams(2)
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            for t, n in cases:
                x = torch.randn(1, t.shape[1], generator=torch.Generator().manual_seed(n))
                x = x.to(torch.bfloat16)
                bias = torch.randn(n).to(torch.bfloat16)
                ys = []
                for streams in (1, 2, 3, 4):
                    qext.set_gemv_streams(streams)
                    ys.append(qext.q_linear(x, t.codes, t.scales, t.offsets, t.bits, t.block,
                                            t.group, t.zero_form, n, bias))
                assert all(torch.equal(ys[0], y) for y in ys[1:]), (threads, n)
        with pytest.raises(RuntimeError, match="1 to 4"):
            qext.set_gemv_streams(5)
    finally:
        qext.set_gemv_streams(was)
        torch.set_num_threads(before)


def test_many_rows_run_in_row_chunks(qext) -> None:
    """Hundreds of rows of a wide K go in row chunks that fit L2 (K = 2048: 128 rows a
    chunk, so 300 rows are 128 + 128 + 44), each chunk over every panel pair."""
    w = _gguf_weight(quant_layouts.Q4_1, 37, 2048, seed=12)
    x = torch.randn(300, 2048, generator=torch.Generator().manual_seed(12)).to(torch.bfloat16)
    _check(wquant.gguf_linear, x, w, None, 32)


@pytest.mark.parametrize("qtype", [*QUANTIZABLE, *KQUANTS],
                         ids=[*QUANTIZABLE.values(), *KQUANTS.values()])
@pytest.mark.parametrize("n, k, tile", [(200, 256, 64), (37, 512, 37), (37, 512, 16)])
def test_dequantize_tiles_product_matches_reference(qext, qtype: int, n: int, k: int,
                                                     tile: int) -> None:
    """q_linear_tiles (per tile of output rows the weight dequantized to bf16, then ATen's
    bf16 GEMM) against x times the bf16-rounded dequantized weight, in float64: what is left
    is float32 summation order and the output's rounding to bf16 (2**-8 relative); tiles
    of whole panels, one covering N = 37 (not a panel multiple), and a bias (added in bf16)."""
    if qtype in KQUANTS and k % quant_layouts.QK_K:
        pytest.skip("K-quant super-blocks are 256 wide")
    w = _gguf_weight(qtype, n, k, seed=13)
    lay = w.kernel_data["cpp"]
    g = torch.Generator().manual_seed(13)
    x = torch.randn(70, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    y = qext.q_linear_tiles(x, lay.codes, lay.scales, lay.offsets, lay.bits, lay.block,
                            lay.group, lay.zero_form, n, bias, tile)
    # NOTE: the GEMM adds the bias in bf16 (a bf16 checkpoint's bias loses nothing)
    ref = x.double() @ _deq(w).to(torch.bfloat16).double().T + bias.to(torch.bfloat16).double()
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("zero_form", [True, False], ids=["gptq_zeros", "gguf_offsets"])
def test_wide_rows_take_the_tiles(qext, zero_form: bool) -> None:
    """With a threshold set, q_linear (what the layers and the fused decoder call) runs
    bf16 products of at least that many rows as q_linear_tiles, bit for bit, and fewer
    rows, and every float32 product, on the int8 panel kernel."""
    if zero_form:
        g = torch.Generator().manual_seed(5)
        w = wquant.GroupQuantWeight(torch.randint(0, 16, (48, 256), generator=g, dtype=torch.uint8),
                                    torch.rand(48, 4, generator=g) * 0.02 + 0.001,
                                    torch.randint(0, 16, (48, 4), generator=g).float(), 4, 64)
        wquant.prepare("wq_linear", w, "cpu")
        op = wquant.wq_linear
    else:
        w = _gguf_weight(quant_layouts.Q4_1, 48, 256, seed=5)
        op = wquant.gguf_linear
    lay = w.kernel_data["cpp"]
    n, k = lay.shape
    args = (lay.codes, lay.scales, lay.offsets, lay.bits, lay.block, lay.group, lay.zero_form, n)
    x = torch.randn(12, k, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    bias = torch.randn(n)
    panel = qext.q_linear(x, *args, bias)
    tiles = qext.q_linear_tiles(x, *args, bias, qext.tile_rows(k, n))
    assert not torch.equal(panel, tiles)  # the two paths round differently
    quant_cpu.set_wide_min_rows(qext, 12)
    assert quant_cpu.wide_min_rows() == 12
    assert torch.equal(qext.q_linear(x, *args, bias), tiles)
    assert torch.equal(qext.q_linear(x[:11], *args, bias), panel[:11])
    assert torch.equal(op(x, w, bias), tiles)
    y32 = qext.q_linear(x.float(), *args, bias)
    quant_cpu.set_wide_min_rows(qext, None)
    assert torch.equal(y32, qext.q_linear(x.float(), *args, bias))


def test_tile_rows_cover_n_or_whole_panels(qext) -> None:
    assert qext.tile_rows(576, 3072) == 3072
    assert qext.tile_rows(576, 37) == 37
    rows = qext.tile_rows(4096, 28672)  # Llama-8B's gate_up: 16 MiB of bf16 a tile
    assert rows % quant_layouts.PANEL == 0 and rows * 4096 * 2 <= 16 << 20 and rows >= 1024


def test_wide_products_take_the_tiles_only_with_amx(monkeypatch) -> None:
    amx = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    no_amx = frozenset({"avx512f", "avx512_bf16"})
    rows = quant_cpu.WIDE_MIN_ROWS

    def wide_min_rows(mode: str, flags: frozenset[str], usable: bool) -> int | None:
        # NOTE: a build without the AMX kernel: the tiles are the one wide path.
        return quant_cpu.decide_wide_paths(mode, flags, usable, False).wide_min_rows

    assert wide_min_rows("auto", amx, True) == rows
    assert wide_min_rows("auto", amx, False) is None  # tiles refused
    assert wide_min_rows("auto", no_amx, True) is None
    assert wide_min_rows("int8", amx, True) is None
    assert wide_min_rows("bf16", no_amx, False) == rows
    monkeypatch.setenv("PAGODA_QUANT_WIDE", "fp4")
    with pytest.raises(ValueError, match="PAGODA_QUANT_WIDE"):
        quant_cpu.wide_mode()


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_linear_equals_reference(qext, m: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(m)
    for n, k in ((37, 100), (64, 576)):
        w = wquant.Int8Weight(torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8),
                              torch.rand(n, generator=g) * 0.01)
        wquant.prepare("int8_linear", w, "cpu")
        x = torch.randn(m, k, generator=g).to(dtype)
        bias = torch.randn(n, generator=g) if m % 2 else None
        assert wquant.int8_linear.select(x, w, bias) is not wquant.int8_linear.reference
        y = wquant.int8_linear(x, w, bias)
        assert torch.equal(y, wquant.int8_linear_reference(x, w, bias))


def test_three_dim_activations(qext) -> None:
    w = _gguf_weight(quant_layouts.Q4_1, 40, 128, seed=1)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)
    y = wquant.gguf_linear(x, w)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.reshape(6, 40), wquant.gguf_linear(x.reshape(6, 128), w))


# ---- the fallback: the reference, never a crash -------------------------------------------
def _runs_reference(op, *args) -> bool:
    return OPS[op.name].select(*args) is op.reference


def test_prepared_weight_takes_the_kernel(qext) -> None:
    w = _gguf_weight(quant_layouts.Q4_1, 8, 64, seed=2)
    assert not _runs_reference(wquant.gguf_linear, torch.randn(1, 64).to(torch.bfloat16), w)
    # float32 (exact against transformers) keeps the reference: the kernel rounds the
    # activations to int8.
    assert _runs_reference(wquant.gguf_linear, torch.randn(1, 64), w)
    g = _group_weight(4, 8, 64, 32, perm=False, seed=5)
    assert _runs_reference(wquant.wq_linear, torch.randn(1, 64), g)


def test_disabled_kernels_fall_back_to_reference(qext, monkeypatch) -> None:
    w = _gguf_weight(quant_layouts.Q4_1, 8, 64, seed=3)
    x = torch.randn(2, 64).to(torch.bfloat16)
    monkeypatch.setenv("PAGODA_DISABLE_CPU_KERNELS", "1")
    assert _runs_reference(wquant.gguf_linear, x, w)
    assert torch.equal(wquant.gguf_linear(x, w), wquant.gguf_linear_reference(x, w))
    fresh = wquant.GGUFWeight(w.raw, w.qtype, w.shape)
    wquant.prepare("gguf_linear", fresh, "cpu")
    assert not fresh.kernel_data


def test_cpu_without_the_instructions_falls_back(qext, monkeypatch) -> None:
    assert not quant_cpu.isa_allows(["avx512f", "avx512bw", "avx512vl"], frozenset({"avx2"}))
    assert not quant_cpu.isa_allows(["avx512f"], frozenset({"avx512f", "avx512bw", "avx512vl"}))
    # The AVX2 path (AVX2 + FMA + F16C): whole, and only where the CPU has all three.
    avx2 = frozenset({"avx2", "fma", "f16c"})
    assert quant_cpu.isa_allows(sorted(avx2), avx2)
    assert not quant_cpu.isa_allows(sorted(avx2), frozenset({"avx2", "fma"}))
    assert not quant_cpu.isa_allows(["avx2"], avx2)
    assert not quant_cpu.isa_allows([], avx2)
    w = _gguf_weight(quant_layouts.Q8_0, 8, 64, seed=4)
    monkeypatch.setattr(quant_cpu, "_allowed", False)
    x = torch.randn(1, 64).to(torch.bfloat16)
    assert _runs_reference(wquant.gguf_linear, x, w)
    assert torch.equal(wquant.gguf_linear(x, w), wquant.gguf_linear_reference(x, w))


def test_unsupported_weights_run_the_reference(qext) -> None:
    w_odd_group = _group_weight(4, 8, 96, 48, perm=False, seed=6)  # group 48: not a multiple of 32
    for w in (w_odd_group,):
        assert not w.kernel_data
        x = torch.randn(2, w.shape[1]).to(torch.bfloat16)
        assert _runs_reference(wquant.wq_linear, x, w)
        assert torch.equal(wquant.wq_linear(x, w), wquant.wq_linear_reference(x, w))
    unprepared = wquant.GGUFWeight(_gguf_weight(quant_layouts.Q4_0, 8, 64, 7).raw,
                                   quant_layouts.Q4_0, (8, 64))
    assert _runs_reference(wquant.gguf_linear, torch.randn(1, 64).to(torch.bfloat16),
                           unprepared)


def test_layout_rejects_a_wrong_raw_shape() -> None:
    with pytest.raises(ValueError, match="does not hold"):
        quant_layouts.from_gguf(torch.zeros(4, 19, dtype=torch.uint8), quant_layouts.Q4_0, (4, 32))


def test_failed_build_falls_back(qext, monkeypatch) -> None:
    w = _gguf_weight(quant_layouts.Q4_1, 8, 64, seed=8)
    monkeypatch.setattr(quant_cpu, "_module", None)
    monkeypatch.setattr(quant_cpu, "_load_failed", True)
    assert quant_cpu.resolve() is None
    x = torch.randn(3, 64).to(torch.bfloat16)
    assert _runs_reference(wquant.gguf_linear, x, w)
    assert torch.equal(wquant.gguf_linear(x, w), wquant.gguf_linear_reference(x, w))


# ---- the storage: codes held once, packed; the preparers --------------------------------
@pytest.mark.parametrize("bits", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("n,k,group", [(37, 100, 20), (16, 64, 64), (50, 200, 200)])
def test_group_weight_is_held_packed_and_unpacks_exactly(bits: int, n: int, k: int, group: int):
    w = _group_weight(bits, n, k, group, perm=False, seed=bits + n)
    g = torch.Generator().manual_seed(bits + n)  # the same draws as _group_weight
    q = torch.randint(0, 2**bits, (n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, -(-k // group), generator=g) * 0.02 + 0.001
    zeros = torch.randint(0, 2**bits, scales.shape, generator=g).float()
    assert torch.equal(w.qweight, q) and torch.equal(w.scales, scales)
    assert torch.equal(w.zeros, zeros)
    cols = torch.arange(k) // group
    assert torch.equal(w.dequantize(), (q.float() - zeros[:, cols]) * scales[:, cols])
    stored = 4 if bits <= 4 else 8
    padded = -(-n // 16) * 16 * (-(-k // 64) * 64)
    assert w.layout.codes.numel() == padded * stored // 8 and w.layout.bits == stored


def test_int4_g64_weight_bytes():
    """GPTQ-like int4 g64 at SmolLM2's gate_up shape: float16 scales, uint8 zeros."""
    n, k = 3072, 576
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, k // 64, generator=g) * 0.02).to(torch.float16).float()
    zeros = torch.full((n, k // 64), 8.0)
    lay = wquant.GroupQuantWeight(q, scales, zeros, 4, 64).layout
    assert lay.scales.dtype == torch.float16 and lay.offsets.dtype == torch.uint8
    nbytes = sum(t.numel() * t.element_size() for t in (lay.codes, lay.scales, lay.offsets))
    assert nbytes / (n * k) == pytest.approx(0.5 + 3 / 64)


def test_group_weight_shares_a_transposed_scales_tensor():
    g = torch.Generator().manual_seed(1)
    scales_gn = torch.rand(2, 32, generator=g)  # GPTQ / AWQ store scales [G, N]
    w = wquant.GroupQuantWeight(torch.zeros(32, 128, dtype=torch.uint8), scales_gn.T,
                                torch.full((32, 2), 8.0), 4, 64)
    assert w.layout.scales.data_ptr() == scales_gn.data_ptr()
    assert torch.equal(w.scales, scales_gn.T)
    # the offsets (unpacked zeros: a new tensor) then follow the scales' [G, N] order
    assert w.layout.offsets.shape == (2, 32)
    torch.testing.assert_close(w.layout.dequantize(), w.dequantize())


def test_group_weight_on_meta_makes_nothing_on_the_host():
    meta = torch.device("meta")
    w = wquant.GroupQuantWeight(torch.empty(20, 70, dtype=torch.uint8, device=meta),
                                torch.empty(20, 2, device=meta), torch.empty(20, 2, device=meta),
                                4, 64)
    assert w.layout.codes.device == meta and w.dequantize().device == meta
    x = torch.empty(3, 70, device=meta)
    assert wquant.wq_linear(x, w).shape == (3, 20)


def test_preparers_skip_the_dtypes_their_kernels_refuse(qext) -> None:
    raw = _gguf_weight(quant_layouts.Q4_1, 8, 64, seed=9).raw
    for dtype, built in ((torch.float32, False), (torch.bfloat16, True), (None, True)):
        w = wquant.GGUFWeight(raw, quant_layouts.Q4_1, (8, 64))
        wquant.prepare("gguf_linear", w, "cpu", dtype)
        assert ("cpp" in w.kernel_data) is built
        gw = _group_weight(4, 8, 64, 32, perm=False, seed=10)
        gw.kernel_data.clear()
        wquant.prepare("wq_linear", gw, "cpu", dtype)
        assert ("cpp" in gw.kernel_data) is built
    i8 = wquant.Int8Weight(torch.zeros(8, 64, dtype=torch.int8), torch.ones(8))
    wquant.prepare("int8_linear", i8, "cpu", torch.float32)  # exact: it runs in float32 too
    assert "cpp" in i8.kernel_data


@pytest.fixture
def amx_qext(qext):
    if not quant_cpu.amx_kernel_runs(qext):
        pytest.skip("q_linear_amx does not run here (no amx_bf16, AMX tiles refused, or a "
                    "build without AMX-TILE / AMX-BF16 / AVX512-BF16)")
    return qext


def _amx_case_weight(kind: str, n: int, seed: int):
    """A GGUF type by name, or a GPTQ-style group weight: g64, one group over all of K, or
    K = 200 (short of the codes' 256 padded columns)."""
    if kind.startswith("gptq"):
        k = 200 if kind == "gptq_k200" else 256
        return _group_weight(4, n, k, 64 if kind == "gptq_g64" else k, False, seed=seed)
    qtype = {**{v: q for q, v in QUANTIZABLE.items()}, **{v: q for q, v in KQUANTS.items()}}
    return _gguf_weight(qtype[kind], n, 256, seed=seed)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q8_0", "Q6_K", "gptq_g64", "gptq_all_k",
                                  "gptq_k200"])
@pytest.mark.parametrize("n", [48, 37])
def test_amx_product_matches_reference_and_is_row_invariant(amx_qext, kind: str,
                                                            n: int) -> None:
    """q_linear_amx (each panel dequantized to bf16 in the B-tile layout, TDPBF16PS) against
    x times the bf16-rounded dequantized weight in float64: float32 sums and the output's
    rounding to bf16 are what is left (2**-8 relative). Any row's result is the same bits
    in any call: alone, among fewer rows, reordered (70 rows: two groups of four tiles).
    K = 200: the columns past K are padding in both x and the weight buffer."""
    lay = _amx_case_weight(kind, n, seed=31).kernel_data["cpp"]
    args = (lay.codes, lay.scales, lay.offsets, lay.bits, lay.block, lay.group, lay.zero_form,
            lay.shape[0])
    g = torch.Generator().manual_seed(32)
    x = torch.randn(70, lay.shape[1], generator=g).to(torch.bfloat16)
    bias = torch.randn(n, generator=g)
    y = amx_qext.q_linear_amx(x, *args, bias)
    ref = (x.double() @ lay.dequantize().to(torch.bfloat16).double().T + bias.double())
    torch.testing.assert_close(y.double(), ref, rtol=2**-8, atol=1e-4 * ref.abs().max().item())
    assert torch.equal(amx_qext.q_linear_amx(x[:17], *args, bias), y[:17])
    assert torch.equal(amx_qext.q_linear_amx(x[5:6], *args, bias), y[5:6])
    perm = torch.randperm(70, generator=g)
    assert torch.equal(amx_qext.q_linear_amx(x[perm], *args, bias), y[perm])
    assert amx_qext.q_linear_amx(x[:0], *args, bias).shape == (0, n)


def test_amx_weight_buffers_carry_nothing_between_products(amx_qext) -> None:
    """q_linear_amx keeps each thread's weight buffers from one call to the next. A product
    whose dequantized weights are all inf or NaN (infinite scales) fills them first; a K =
    200 product after it (columns 200-255 padding, never dequantized) must give the bits it
    gave before, as 0 * NaN in the padding would not."""
    def args(w):
        lay = w.kernel_data["cpp"]
        return (lay.codes, lay.scales, lay.offsets, lay.bits, lay.block, lay.group,
                lay.zero_form, lay.shape[0])

    w = _group_weight(4, 80, 200, 200, False, seed=41)
    g = torch.Generator().manual_seed(42)
    x = torch.randn(48, 200, generator=g).to(torch.bfloat16)
    before = amx_qext.q_linear_amx(x, *args(w), None)
    assert not before.isnan().any()
    poison = _group_weight(4, 80, 256, 256, False, seed=43)
    lay = poison.kernel_data["cpp"]
    lay.scales.fill_(float("inf"))
    xp = torch.randn(48, 256, generator=g).to(torch.bfloat16)
    assert amx_qext.q_linear_amx(xp, *args(poison), None).isnan().any()
    assert torch.equal(amx_qext.q_linear_amx(x, *args(w), None), before)


@pytest.mark.parametrize("k", [576, 1536, 200])
def test_amx_product_over_several_row_chunks(amx_qext, k: int) -> None:
    """Past about 1 MiB of activations (896 rows at K = 576, 320 at 1,536) q_linear_amx
    runs its rows in chunks, each a pass over every panel pair with the weights dequantized
    again: 2,100 rows (three to seven chunks, the last one partial, with a partial row
    tile) give each row the bits of the same rows in calls of 100. Five panels: two pairs
    and a single one, so each thread moves between pairs and chunks. K = 200: the padded
    copy of x instead of x read in place."""
    w = _group_weight(4, 80, k, 32 if k % 32 == 0 else k, False, seed=35)
    lay = w.kernel_data["cpp"]
    args = (lay.codes, lay.scales, lay.offsets, lay.bits, lay.block, lay.group, lay.zero_form,
            lay.shape[0])
    g = torch.Generator().manual_seed(36)
    x = torch.randn(2100, k, generator=g).to(torch.bfloat16)
    bias = torch.randn(80, generator=g)
    y = amx_qext.q_linear_amx(x, *args, bias)
    parts = [amx_qext.q_linear_amx(x[i:i + 100], *args, bias) for i in range(0, 2100, 100)]
    assert torch.equal(y, torch.cat(parts))
    ref = x[:64].double() @ lay.dequantize().to(torch.bfloat16).double().T + bias.double()
    torch.testing.assert_close(y[:64].double(), ref, rtol=2**-8,
                               atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q6_K", "gptq_g64", "gptq_k200"])
@pytest.mark.parametrize("n", [48, 37, 80])
def test_panel_copy_holds_the_weight_and_gives_q_linear_amx_bits(amx_qext, kind: str,
                                                                 n: int) -> None:
    """dequantize_panels: the weight dequantized once (w = s q + m in float32, one rounding
    to bf16; for GGUF blocks exactly the reference's values) in q_linear_amx's buffer
    layout; q_linear_panels reads it instead of dequantizing and gives q_linear_amx's bits, row counts below a tile to several tile
    pairs, with a bias, an odd panel count (37, 80: three and five panels) and K short of
    the padded columns (200 of 256)."""
    lay = _amx_case_weight(kind, n, seed=51).kernel_data["cpp"]
    k = lay.shape[1]
    args = (lay.codes, lay.scales, lay.offsets, lay.bits, lay.block, lay.group, lay.zero_form)
    panels = amx_qext.dequantize_panels(*args, n, k)
    assert panels.dtype == torch.bfloat16 and panels.shape == ((n + 15) // 16, 256 * 16)
    dense = panels_as_dense(panels, n, k)
    if kind.startswith("gptq"):
        # NOTE: the kernels fold the zero point into an offset (s q - s z, one fused
        # multiply-add); the reference subtracts first, so a code at the zero point gives
        # 0 there and a rounding residue here.
        torch.testing.assert_close(dense.float(), lay.dequantize(), rtol=2**-8, atol=1e-6)
    else:  # GGUF: s q + m, as the reference computes it
        assert torch.equal(dense, lay.dequantize().to(torch.bfloat16))
    g = torch.Generator().manual_seed(52)
    bias = torch.randn(n, generator=g)
    for m in (1, 17, 70):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        for b in (None, bias):
            assert torch.equal(amx_qext.q_linear_panels(x, panels, n, b),
                               amx_qext.q_linear_amx(x, *args, n, b))


def test_panel_copy_over_several_row_chunks(amx_qext) -> None:
    """2,100 rows at K = 576 (three row chunks, the last partial): q_linear_amx's bits,
    which dequantizes each pair again per chunk where the copy reads it again."""
    w = _group_weight(4, 80, 576, 32, False, seed=53)
    lay = w.kernel_data["cpp"]
    args = (lay.codes, lay.scales, lay.offsets, lay.bits, lay.block, lay.group, lay.zero_form)
    panels = amx_qext.dequantize_panels(*args, 80, 576)
    x = torch.randn(2100, 576, generator=torch.Generator().manual_seed(54)).to(torch.bfloat16)
    assert torch.equal(amx_qext.q_linear_panels(x, panels, 80, None),
                       amx_qext.q_linear_amx(x, *args, 80, None))


def test_panel_copy_refuses_what_does_not_fit(amx_qext) -> None:
    w = _group_weight(4, 48, 256, 64, False, seed=55)
    lay = w.kernel_data["cpp"]
    panels = amx_qext.dequantize_panels(lay.codes, lay.scales, lay.offsets, lay.bits,
                                        lay.block, lay.group, lay.zero_form, 48, 256)
    x = torch.randn(4, 256).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="panels cover 256 columns, x has 320"):
        amx_qext.q_linear_panels(torch.zeros(4, 320, dtype=torch.bfloat16), panels, 48, None)
    with pytest.raises(RuntimeError, match="n = 20 does not match 48 padded rows"):
        amx_qext.q_linear_panels(x, panels, 20, None)
    with pytest.raises(RuntimeError, match="x must be a contiguous bf16"):
        amx_qext.q_linear_panels(x.float(), panels, 48, None)
    with pytest.raises(RuntimeError, match="panels must be a contiguous bf16"):
        amx_qext.q_linear_panels(x, panels.float(), 48, None)
    with pytest.raises(RuntimeError, match="bias must have 48 elements"):
        amx_qext.q_linear_panels(x, panels, 48, torch.zeros(47))


def test_q_linear_takes_the_amx_kernel_for_its_rows(amx_qext) -> None:
    """q_linear dispatches bf16 products by rows: the panel kernel below amx_min_rows,
    q_linear_amx up to the tiled path's first row, the tiles from there; float32 x stays on
    the panel kernel."""
    w = _gguf_weight(quant_layouts.Q4_1, 48, 256, seed=33)
    lay = w.kernel_data["cpp"]
    n = lay.shape[0]
    args = (lay.codes, lay.scales, lay.offsets, lay.bits, lay.block, lay.group, lay.zero_form, n)
    x = torch.randn(24, 256, generator=torch.Generator().manual_seed(34)).to(torch.bfloat16)
    panel = amx_qext.q_linear(x, *args, None)
    amx = amx_qext.q_linear_amx(x, *args, None)
    tiles = amx_qext.q_linear_tiles(x, *args, None, amx_qext.tile_rows(256, n))
    assert not torch.equal(panel, amx)
    quant_cpu.set_wide_min_rows(amx_qext, 20)
    quant_cpu.set_amx_min_rows(amx_qext, 10)
    assert quant_cpu.amx_min_rows() == 10
    assert torch.equal(amx_qext.q_linear(x[:9], *args, None), panel[:9])
    assert torch.equal(amx_qext.q_linear(x[:10], *args, None), amx[:10])
    assert torch.equal(wquant.gguf_linear(x[:19], w), amx[:19])
    assert torch.equal(amx_qext.q_linear(x[:20], *args, None), tiles[:20])
    y32 = amx_qext.q_linear(x.float(), *args, None)
    quant_cpu.set_amx_min_rows(amx_qext, None)
    assert torch.equal(y32, amx_qext.q_linear(x.float(), *args, None))
    assert torch.equal(amx_qext.q_linear(x[:19], *args, None), panel[:19])


def test_wide_paths_by_cpu_and_mode() -> None:
    amx = frozenset({"avx512f", "avx512_bf16", "amx_bf16", "amx_tile"})
    no_amx = frozenset({"avx512f", "avx512_bf16"})
    both = quant_cpu.WidePaths(quant_cpu.AMX_MIN_ROWS, quant_cpu.AMX_WIDE_MIN_ROWS)
    tiles = quant_cpu.WidePaths(None, quant_cpu.WIDE_MIN_ROWS)
    none = quant_cpu.WidePaths(None, None)
    assert quant_cpu.decide_wide_paths("auto", amx, True, True) == both
    assert quant_cpu.decide_wide_paths("auto", amx, True, False) == tiles  # kernel not built
    assert quant_cpu.decide_wide_paths("auto", amx, False, True) == none  # tiles refused
    assert quant_cpu.decide_wide_paths("auto", no_amx, True, True) == none
    assert quant_cpu.decide_wide_paths("amx", amx, True, True) == both
    assert quant_cpu.decide_wide_paths("bf16", no_amx, False, False) == tiles
    assert quant_cpu.decide_wide_paths("bf16", amx, True, True) == tiles
    assert quant_cpu.decide_wide_paths("int8", amx, True, True) == none
    with pytest.raises(ValueError, match="no usable bf16 AMX"):
        quant_cpu.decide_wide_paths("amx", no_amx, True, True)
