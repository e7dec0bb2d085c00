"""UnquantizedLinearMethod's oneDNN repack: bit-identical to F.linear, float32 left alone,
no dense copy kept, and state_dict() / .to() still see the dense weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers.linear import ReplicatedLinear
from pagoda.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.quant import unquantized
from pagoda.quant.unquantized import UnquantizedLinearMethod
from tests.helpers import bf16_packs

needs_mkldnn = pytest.mark.skipif(
    not bf16_packs(),
    reason="no oneDNN in this torch, or oneDNN packs no bf16 weight on this CPU (no AVX-512)",
)


def _layer(in_size: int, out_size: int, dtype: torch.dtype, bias: bool = False):
    torch.manual_seed(0)
    layer = ReplicatedLinear(in_size, out_size, bias=bias, params_dtype=dtype)
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer


@needs_mkldnn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical(dtype: torch.dtype, bias: bool, wide_gemm) -> None:
    wide_gemm("bf16")  # NOTE: the float32 path for wide products: tests/unit/test_gemm_dispatch.py
    layer = _layer(96, 200, dtype, bias)
    assert isinstance(layer.quant_method, UnquantizedLinearMethod)
    weight = layer.weight.detach().clone()
    b = None if layer.bias is None else layer.bias.detach().clone()
    layer.process_weights_after_loading()
    if dtype == torch.float16 and not layer.weight.is_mkldnn:
        # oneDNN packs float16 only with AVX512_FP16 or AVX_NE_CONVERT: then F.linear stays.
        x = torch.randn(3, 96).to(dtype)
        assert torch.equal(layer(x), F.linear(x, weight, b))
        return
    # the packed tensor is the registered weight: no dense copy is kept beside it
    assert layer.weight.is_mkldnn
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"][: 1 + bias]
    assert layer.weight.shape == (200, 96) and layer.weight.dtype == dtype
    assert layer.weight.weight_loader == layer.weight_loader  # loader metadata kept
    for rows in (1, 3, 64, 257):
        x = torch.randn(rows, 96).to(dtype)
        if dtype == torch.float16 and rows == 1:
            # NOTE: at one float16 row F.linear takes ATen's own gemv, not oneDNN (seen on
            # an avx512_fp16 Xeon), which sums in another order: only closeness holds.
            torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-3, atol=1e-3)
            continue
        assert torch.equal(layer(x), F.linear(x, weight, b))
    x3 = torch.randn(2, 5, 96).to(dtype)  # leading batch dims pass through
    assert torch.equal(layer(x3), F.linear(x3, weight, b))


def test_float32_is_not_packed() -> None:
    layer = _layer(8, 4, torch.float32)
    layer.process_weights_after_loading()
    assert not layer.weight.is_mkldnn and layer.weight.device.type == "cpu"


def test_disable_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_PACKED_LINEAR", "1")
    layer = _layer(8, 4, torch.bfloat16)
    layer.process_weights_after_loading()
    assert not layer.weight.is_mkldnn
    assert not unquantized.packing_enabled()


@needs_mkldnn
def test_packing_twice_is_a_no_op() -> None:
    layer = _layer(16, 8, torch.bfloat16)
    layer.process_weights_after_loading()
    packed = layer.weight
    layer.process_weights_after_loading()
    assert layer.weight is packed


@needs_mkldnn
def test_state_dict_after_packing_is_the_dense_weight() -> None:
    layer = _layer(32, 24, torch.bfloat16, bias=True)
    dense = {k: v.clone() for k, v in layer.state_dict().items()}
    layer.process_weights_after_loading()
    assert layer.weight.is_mkldnn
    state = layer.state_dict()
    assert state.keys() == dense.keys()
    for name, tensor in state.items():
        assert tensor.layout == torch.strided and tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, dense[name]), name


@needs_mkldnn
def test_to_converts_a_packed_layer_and_repacks_where_it_can() -> None:
    layer = _layer(32, 24, torch.bfloat16, bias=True)
    weight = layer.weight.detach().clone()
    layer.process_weights_after_loading()
    x = torch.randn(5, 32)
    layer.to(torch.float32)  # float32 is not packed: a dense float32 weight
    assert not layer.weight.is_mkldnn and layer.weight.dtype == torch.float32
    assert torch.equal(layer.weight, weight.float())
    assert layer.weight.weight_loader == layer.weight_loader
    assert torch.equal(layer(x), F.linear(x, weight.float(), layer.bias))
    layer.to(torch.bfloat16)  # back to a packed bf16 weight, same values
    assert layer.weight.is_mkldnn and torch.equal(layer.state_dict()["weight"], weight)
    layer.to("cpu")
    xb = x.bfloat16()
    assert torch.equal(layer(xb), F.linear(xb, weight, layer.bias))


@needs_mkldnn
def test_lm_head_and_tied_embedding_pack_for_logits() -> None:
    torch.manual_seed(0)
    table = torch.randn(50, 16).bfloat16()
    hidden = torch.randn(3, 16).bfloat16()
    head = ParallelLMHead(50, 16, params_dtype=torch.bfloat16)
    head.weight_loader(head.weight, table)
    head.process_weights_after_loading()
    assert head.weight.is_mkldnn
    assert torch.equal(head.compute_logits(hidden), F.linear(hidden, table))
    embed = ParallelLMHead.tie_weights(VocabParallelEmbedding(50, 16, params_dtype=torch.bfloat16))
    embed.weight_loader(embed.weight, table)
    embed.process_weights_after_loading()
    # the table stays dense for lookups; a packed copy, not a parameter, serves logits
    assert not embed.weight.is_mkldnn and embed.packed_logits_weight is not None
    assert [n for n, _ in embed.named_parameters()] == ["weight"]
    assert torch.equal(embed(torch.tensor([3, 7])), table[[3, 7]])
    assert torch.equal(embed.compute_logits(hidden), F.linear(hidden, table))
    embed.to(torch.float32)
    assert embed.packed_logits_weight is None and embed.weight.dtype == torch.float32
    assert torch.equal(embed.compute_logits(hidden.float()), F.linear(hidden.float(), table.float()))


def test_a_weight_onednn_cannot_pack_stays_dense_on_f_linear(monkeypatch) -> None:
    """Where oneDNN refuses a weight (bf16 on a CPU without AVX-512, float16 without
    AVX512_FP16): the dense weight is kept, and the product is F.linear's."""
    monkeypatch.setattr(unquantized, "pack_weight", lambda w: None)
    layer = _layer(32, 24, torch.bfloat16, bias=True)
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    layer.process_weights_after_loading()
    assert not layer.weight.is_mkldnn and torch.equal(layer.weight, weight)
    x = torch.randn(5, 32).to(torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, weight, bias))
    assert torch.equal(layer.state_dict()["weight"], weight)
