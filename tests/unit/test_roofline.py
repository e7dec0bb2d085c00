"""Roofline arithmetic on given numbers (no measurement)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from pagoda.benchmarks import roofline as rl
from pagoda.benchmarks.roofline import (
    MachineLimits,
    ModelShape,
    fraction_of_roofline,
    min_num_steps,
    roofline,
    workload_cost,
)

SMOLLM2_135M = ModelShape(
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    vocab_size=49152,
    tie_word_embeddings=True,
)

# One layer, hidden 4, MLP 8, 2 query heads / 1 KV head of dim 2, vocab 10.
TINY = ModelShape(1, 4, 8, 2, 1, 2, 10, tie_word_embeddings=True)


def test_smollm2_parameter_count_matches_gguf() -> None:
    # 134,515,008 is the GGUF's tensor total (see ENV_NOTES).
    assert SMOLLM2_135M.num_params == 134_515_008
    assert SMOLLM2_135M.weight_params_read_per_step == 134_515_008  # tied: head == table
    assert SMOLLM2_135M.kv_elems_per_token == 2 * 30 * 3 * 64


def test_untied_model_reads_head_not_table() -> None:
    untied = ModelShape(1, 4, 8, 2, 1, 2, 10, tie_word_embeddings=False)
    assert untied.num_params == TINY.num_params + 40
    assert untied.weight_params_read_per_step == TINY.weight_params_read_per_step


def test_tiny_shape_counts() -> None:
    assert TINY.layer_linear_params == 16 + 16 + 16 + 96  # q, k+v, o, gate+up+down
    assert TINY.num_params == 144 + 12 + 40
    assert TINY.kv_elems_per_token == 4
    assert TINY.attn_flops_per_pair == 16


def test_min_num_steps_takes_the_tightest_limit() -> None:
    lengths = [(10, 5)] * 4  # 20 output tokens, 56 forwarded
    assert min_num_steps(lengths, concurrency=2, max_num_batched_tokens=1000) == 10
    assert min_num_steps(lengths, concurrency=8, max_num_batched_tokens=1000) == 5
    assert min_num_steps(lengths, concurrency=2, max_num_batched_tokens=5) == 12
    assert min_num_steps([], concurrency=2, max_num_batched_tokens=5) == 0


def test_workload_cost_by_hand() -> None:
    # prompt 3, output 2: tokens at positions 0..3 are forwarded, 2 are sampled.
    cost = workload_cost([(3, 2)], TINY, dtype_bytes=2, concurrency=1, max_num_batched_tokens=100)
    assert cost.num_steps == 2
    assert cost.num_forwarded_tokens == 4
    assert cost.linear_flops == 2 * 144 * 4
    assert cost.lm_head_flops == 2 * 40 * 2
    assert cost.attn_flops == 16 * (1 + 2 + 3 + 4)
    assert cost.weight_bytes == 2 * 196 * 2
    # KV: prefill reads 3 tokens, the decode token reads 4, 4 tokens are written.
    assert cost.kv_bytes == (3 + 4 + 4) * 4 * 2
    assert cost.total_flops == 1472
    assert cost.total_bytes == 872


def test_closed_forms_match_a_token_by_token_count() -> None:
    lengths = [(7, 5), (1, 1), (12, 3)]
    cost = workload_cost(lengths, TINY, 4, concurrency=3, max_num_batched_tokens=64)
    pairs = kv_reads = writes = 0
    for p, o in lengths:
        pairs += sum(pos + 1 for pos in range(p + o - 1))
        kv_reads += p + sum(p + j for j in range(1, o))
        writes += p + o - 1
    assert cost.attn_flops == TINY.attn_flops_per_pair * pairs
    assert cost.kv_bytes == (kv_reads + writes) * TINY.kv_elems_per_token * 4


def test_roofline_picks_the_slower_side() -> None:
    limits = MachineLimits(flops_per_s=1472.0, bytes_per_s=436.0)
    est = roofline([(3, 2)], TINY, limits, 2, concurrency=1, max_num_batched_tokens=100)
    assert est.compute_s == pytest.approx(1.0)
    assert est.memory_s == pytest.approx(2.0)
    assert (est.time_s, est.bound) == (pytest.approx(2.0), "memory")
    assert est.output_tokens_per_s == pytest.approx(1.0)
    assert est.single_stream_s_per_token == pytest.approx(392 / 436)
    assert fraction_of_roofline(est, measured_s=8.0) == pytest.approx(0.25)

    fast_memory = MachineLimits(flops_per_s=1472.0, bytes_per_s=1e9)
    est = roofline([(3, 2)], TINY, fast_memory, 2, concurrency=1, max_num_batched_tokens=100)
    assert est.bound == "compute"
    assert est.time_s == pytest.approx(1.0)


def test_smollm2_single_stream_floor() -> None:
    # bf16 weights at 48 GB/s: about 5.6 ms per token (PERF_NOTES measured 5.5 ms).
    limits = MachineLimits(flops_per_s=1e12, bytes_per_s=48e9)
    est = roofline([(100, 10)], SMOLLM2_135M, limits, 2, 1, 2048)
    assert est.single_stream_s_per_token * 1e3 == pytest.approx(5.605, abs=0.01)
    assert math.isfinite(est.output_tokens_per_s)


def test_quantized_weights_bound_the_bytes_not_the_flops() -> None:
    # A GGUF file run natively: weights at its bytes per weight, the KV cache in the dtype.
    cost = workload_cost([(3, 2)], TINY, 2, 1, 100, weight_bytes_per_param=0.5)
    assert cost.weight_bytes == 2 * 196 * 0.5
    assert cost.kv_bytes == (3 + 4 + 4) * 4 * 2
    assert cost.total_flops == 1472
    limits = MachineLimits(flops_per_s=1e12, bytes_per_s=392.0)
    est = roofline([(3, 2)], TINY, limits, 2, 1, 100, weight_bytes_per_param=0.5)
    assert est.single_stream_s_per_token == pytest.approx(0.25)
    # No requests: no steps, and still the floor of one step's weights.
    est = roofline([], TINY, limits, 2, 1, 100, weight_bytes_per_param=0.5)
    assert est.single_stream_s_per_token == pytest.approx(0.25)


def test_gguf_matrices_types_and_bytes(tmp_path: Path) -> None:
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    path = tmp_path / "m.gguf"
    writer = GGUFWriter(path, "llama")
    rng = np.random.default_rng(0)
    q8 = quantize(rng.standard_normal((4, 64)).astype(np.float32), GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.add_tensor("token_embd.weight", rng.random((2, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_norm.weight", rng.random(64, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    types, per_param = rl.gguf_matrices(path)
    assert types == [int(GGMLQuantizationType.F32), int(GGMLQuantizationType.Q8_0)]
    # 256 Q8_0 weights in 8 blocks of 34 bytes, 128 float32 ones; the norm is no matrix.
    assert per_param == pytest.approx((8 * 34 + 128 * 4) / 384)


def test_gguf_kernel_rate_counts_toward_the_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    rates = {"bfloat16": 100.0, "float32": 50.0}
    monkeypatch.setattr(rl, "measure_matmul_flops", lambda m, k, n, dt, t: rates[dt] + m)
    monkeypatch.setattr(rl, "measure_read_bandwidth", lambda n, t: 7.0)
    # A type the kernel lacks (None) is left out; the rest count at every row count.
    monkeypatch.setattr(rl, "measure_gguf_kernel_ops",
                        lambda rows, k, n, qt, t: {} if qt == 99 else {
                            m: 1000.0 * qt + m for m in rows})
    limits, details = rl.measure_machine("bfloat16", TINY, quick=True, gguf_types=[3, 99])
    assert details["gguf_kernel"] == {"Q4_1 256x4x8": 3256.0, "Q4_1 1024x4x8": 4024.0}
    assert limits.flops_per_s == 4024.0
    limits, details = rl.measure_machine("bfloat16", TINY, quick=True)
    assert details["gguf_kernel"] == {}
    assert limits.flops_per_s == 2148.0  # bf16 at 2048^3


def test_gguf_kernel_rate_measured() -> None:
    from pagoda.ops import quant_cpu, quant_layouts

    if quant_cpu.resolve() is None:
        pytest.skip("no quant CPU kernel on this machine")
    rates = rl.measure_gguf_kernel_ops((16, 32), 64, 32, quant_layouts.Q4_1, 0.01)
    assert list(rates) == [16, 32] and min(rates.values()) > 0
    # Q4_K super-blocks are 256 wide: no kernel call for K = 64.
    assert rl.measure_gguf_kernel_ops((16,), 64, 32, quant_layouts.Q4_K, 0.01) == {}
