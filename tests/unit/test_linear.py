"""Repacked linear weights: bit-identical to F.linear, float32 left alone, memory freed."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagoda.layers import linear as linear_mod
from pagoda.layers.linear import Linear, can_pack

needs_mkldnn = pytest.mark.skipif(
    not can_pack(torch.zeros(2, 2, dtype=torch.bfloat16)), reason="no oneDNN in this torch"
)


@needs_mkldnn
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_is_bit_identical(dtype: torch.dtype, bias: bool) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias).to(dtype)
    weight = layer.weight.detach().clone()
    b = None if layer.bias is None else layer.bias.detach().clone()
    layer.process_weights_after_loading()
    if dtype == torch.float16 and layer.packed_weight is None:
        # oneDNN packs float16 only with AVX512_FP16 or AVX_NE_CONVERT: then F.linear stays.
        assert layer.weight.device.type == "cpu"
        x = torch.randn(3, 96).to(dtype)
        assert torch.equal(layer(x), F.linear(x, weight, b))
        return
    assert layer.packed_weight is not None
    assert layer.weight.device.type == "meta"  # dense storage released
    assert layer.weight.shape == (200, 96) and layer.weight.dtype == dtype
    for rows in (1, 3, 64, 257):
        x = torch.randn(rows, 96).to(dtype)
        assert torch.equal(layer(x), F.linear(x, weight, b))
    x3 = torch.randn(2, 5, 96).to(dtype)  # leading batch dims pass through
    assert torch.equal(layer(x3), F.linear(x3, weight, b))


def test_float32_is_not_packed() -> None:
    layer = Linear(8, 4)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None and layer.weight.device.type == "cpu"


def test_disable_env_var(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_PACKED_LINEAR", "1")
    layer = Linear(8, 4).to(torch.bfloat16)
    layer.process_weights_after_loading()
    assert layer.packed_weight is None
    assert not linear_mod.packing_enabled()


@needs_mkldnn
def test_packing_twice_is_a_no_op() -> None:
    layer = Linear(16, 8).to(torch.bfloat16)
    layer.process_weights_after_loading()
    packed = layer.packed_weight
    layer.process_weights_after_loading()
    assert layer.packed_weight is packed
