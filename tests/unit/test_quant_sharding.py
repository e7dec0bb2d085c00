"""Quantized layers at tp_size 2: each rank's loaders cut its shard of every checkpoint
tensor (codes packed along the input or the output, scales per group or per block, zeros
packed along the output), and the rank's weight is its slice of the full dequantized one."""

from __future__ import annotations

import pytest
import torch

from pagoda.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagoda.quant import packing
from pagoda.quant.awq import AWQConfig
from pagoda.quant.compressed_tensors import CompressedTensorsConfig
from pagoda.quant.fp8 import Fp8Config
from pagoda.quant.gptq import GPTQConfig
from tests.quant_helpers import dequantize_groups, rtn_groups
from tests.unit.test_quant_compressed_tensors import ct_config, ct_quantizer
from tests.unit.test_quant_int8_fp8 import fp8_quantizer

HIDDEN, HEAD, HEADS, KV_HEADS = 128, 16, 8, 4


def gptq_parts(w: torch.Tensor, group_size: int):
    k = w.shape[1]
    group_of = torch.arange(k) // group_size
    codes, scales, zeros = rtn_groups(w, 4, group_of, k // group_size, sym=False)
    qweight, qzeros = packing.pack_gptq(codes.T, zeros.T, 4)
    parts = {"qweight": qweight, "qzeros": qzeros, "scales": scales.T,
             "g_idx": group_of.to(torch.int32)}
    return parts, dequantize_groups(codes, scales, zeros, group_of)


def awq_parts(w: torch.Tensor, group_size: int):
    k = w.shape[1]
    group_of = torch.arange(k) // group_size
    codes, scales, zeros = rtn_groups(w, 4, group_of, k // group_size, sym=False)
    qweight, qzeros = packing.pack_awq(codes.T, zeros.T)
    return ({"qweight": qweight, "qzeros": qzeros, "scales": scales.T},
            dequantize_groups(codes, scales, zeros, group_of))


def _dense(layer) -> torch.Tensor:
    w = layer.quant_weight
    full = w.dequantize()
    if getattr(w, "perm", None) is not None:
        full = torch.empty_like(full).index_copy_(1, w.perm, full)
    return full


def _load(layer, parts_by_shard: dict) -> None:
    params = dict(layer.named_parameters())
    for shard_id, parts in parts_by_shard.items():
        for name, tensor in parts.items():
            param = params[name]
            if shard_id is None:
                param.weight_loader(param, tensor)
            else:
                param.weight_loader(param, tensor, shard_id)
    layer.process_weights_after_loading()


CONFIGS = {
    "gptq": (lambda: GPTQConfig(4, 32), lambda w: gptq_parts(w, 32)),
    "awq": (lambda: AWQConfig(32, []), lambda w: awq_parts(w, 32)),
    "ct": (lambda: CompressedTensorsConfig.from_config(ct_config(4, 32, False)),
           lambda w: ct_quantizer(4, 32, False)("x.q_proj.weight", w)),
    "fp8_block": (lambda: Fp8Config(True, (16, 32)), lambda w: fp8_quantizer("block")("", w)),
}


@pytest.mark.parametrize("method", list(CONFIGS))
@pytest.mark.parametrize("rank", [0, 1])
def test_qkv_shards_at_tp2(method, rank):
    make_config, quantize = CONFIGS[method]
    g = torch.Generator().manual_seed(0)
    rows = {"q": HEADS * HEAD, "k": KV_HEADS * HEAD, "v": KV_HEADS * HEAD}
    quantized = {sid: quantize(torch.randn(n, HIDDEN, generator=g)) for sid, n in rows.items()}
    layer = QKVParallelLinear(HIDDEN, HEAD, HEADS, KV_HEADS, bias=False,
                              quant_config=make_config(), prefix="l.qkv_proj",
                              tp_rank=rank, tp_size=2)
    _load(layer, {sid: parts for sid, (parts, _) in quantized.items()})
    expected = torch.cat([deq.chunk(2)[rank] for _, deq in quantized.values()])
    assert torch.equal(_weight(layer, method), expected)


@pytest.mark.parametrize("method", list(CONFIGS))
@pytest.mark.parametrize("rank", [0, 1])
def test_row_parallel_shards_at_tp2(method, rank):
    make_config, quantize = CONFIGS[method]
    w = torch.randn(64, 2 * HIDDEN, generator=torch.Generator().manual_seed(1))
    parts, deq = quantize(w)
    layer = RowParallelLinear(2 * HIDDEN, 64, bias=False, quant_config=make_config(),
                              prefix="l.o_proj", tp_rank=rank, tp_size=2)
    _load(layer, {None: parts})
    assert torch.equal(_weight(layer, method), deq.chunk(2, dim=1)[rank])


def test_merged_gate_up_shards_at_tp2():
    make_config, quantize = CONFIGS["awq"]
    g = torch.Generator().manual_seed(2)
    quantized = [quantize(torch.randn(64, HIDDEN, generator=g)) for _ in range(2)]
    layer = MergedColumnParallelLinear(HIDDEN, [64, 64], bias=False,
                                       quant_config=make_config(), prefix="l.gate_up_proj",
                                       tp_rank=1, tp_size=2)
    _load(layer, {i: parts for i, (parts, _) in enumerate(quantized)})
    assert torch.equal(_dense(layer), torch.cat([deq.chunk(2)[1] for _, deq in quantized]))


def _weight(layer, method: str) -> torch.Tensor:
    return layer.quant_weight.dequantize() if method == "fp8_block" else _dense(layer)
