"""The parallel layers' weight loaders (shards of q/k/v, gate/up, rows, columns, vocab at
tp_size 1, 2 and 4), the dotted prefixes of a model's modules, and quantization as a
strategy the layers take without knowing it (a test int8 method from the registry)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pagoda.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagoda.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from pagoda.quant.base import (
    QuantizationConfig,
    QuantizeMethodBase,
    get_quantization_config,
    quant_config_from_hf,
    quantization_methods,
    register_quantization_config,
    set_weight_attrs,
)
from tests.helpers import make_tiny_config

HEAD = 4  # head_size
TOTAL_HEADS, TOTAL_KV_HEADS, HIDDEN = 4, 2, 8


def _qkv_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(TOTAL_HEADS * HEAD, HIDDEN, generator=g),
        "k": torch.randn(TOTAL_KV_HEADS * HEAD, HIDDEN, generator=g),
        "v": torch.randn(TOTAL_KV_HEADS * HEAD, HIDDEN, generator=g),
    }


def _heads(w: torch.Tensor, first: int, count: int) -> torch.Tensor:
    return w[first * HEAD : (first + count) * HEAD]


def _load_qkv(layer: QKVParallelLinear, parts: dict[str, torch.Tensor]) -> None:
    for shard_id, tensor in parts.items():
        layer.weight.weight_loader(layer.weight, tensor, shard_id)


def test_qkv_loader_packs_q_k_v_at_tp1() -> None:
    parts = _qkv_weights()
    layer = QKVParallelLinear(HIDDEN, HEAD, TOTAL_HEADS, TOTAL_KV_HEADS, bias=True)
    assert layer.weight.shape == ((TOTAL_HEADS + 2 * TOTAL_KV_HEADS) * HEAD, HIDDEN)
    _load_qkv(layer, {"v": parts["v"], "q": parts["q"], "k": parts["k"]})  # any order
    assert torch.equal(layer.weight, torch.cat([parts["q"], parts["k"], parts["v"]]))
    biases = {sid: torch.randn(t.shape[0]) for sid, t in parts.items()}
    for sid, b in biases.items():
        layer.bias.weight_loader(layer.bias, b, sid)
    assert torch.equal(layer.bias, torch.cat([biases["q"], biases["k"], biases["v"]]))
    packed = QKVParallelLinear(HIDDEN, HEAD, TOTAL_HEADS, TOTAL_KV_HEADS, bias=False)
    packed.weight.weight_loader(packed.weight, layer.weight.detach())  # shard_id None
    assert torch.equal(packed.weight, layer.weight)


@pytest.mark.parametrize("rank", [0, 1])
def test_qkv_loader_takes_this_ranks_heads_at_tp2(rank: int) -> None:
    parts = _qkv_weights()
    layer = QKVParallelLinear(HIDDEN, HEAD, TOTAL_HEADS, TOTAL_KV_HEADS, bias=False,
                              tp_rank=rank, tp_size=2)
    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    _load_qkv(layer, parts)
    expected = torch.cat([
        _heads(parts["q"], 2 * rank, 2), _heads(parts["k"], rank, 1), _heads(parts["v"], rank, 1)
    ])
    assert torch.equal(layer.weight, expected)


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_qkv_loader_replicates_kv_heads_at_tp4(rank: int) -> None:
    parts = _qkv_weights()
    layer = QKVParallelLinear(HIDDEN, HEAD, TOTAL_HEADS, TOTAL_KV_HEADS, bias=False,
                              tp_rank=rank, tp_size=4)
    assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_head_replicas) == (1, 1, 2)
    _load_qkv(layer, parts)
    kv_head = rank // 2  # ranks 0, 1 share kv head 0; ranks 2, 3 kv head 1
    expected = torch.cat([
        _heads(parts["q"], rank, 1), _heads(parts["k"], kv_head, 1),
        _heads(parts["v"], kv_head, 1),
    ])
    assert torch.equal(layer.weight, expected)


def test_qkv_loader_rejects_wrong_shapes_and_shard_ids() -> None:
    parts = _qkv_weights()
    layer = QKVParallelLinear(HIDDEN, HEAD, TOTAL_HEADS, TOTAL_KV_HEADS, bias=False)
    loader = layer.weight.weight_loader
    with pytest.raises(ValueError, match=r"has shape \(8, 8\), expected \(16, 8\)"):
        loader(layer.weight, parts["k"], "q")
    with pytest.raises(ValueError, match=r"expected \(8, 8\)"):
        loader(layer.weight, parts["k"][:, :4], "k")
    with pytest.raises(ValueError, match="shard id 'x'"):
        loader(layer.weight, parts["q"], "x")


@pytest.mark.parametrize(("rank", "size"), [(0, 1), (0, 2), (1, 2)])
def test_gate_up_loader_takes_shard_ids_0_and_1(rank: int, size: int) -> None:
    gate, up = torch.randn(6, HIDDEN), torch.randn(6, HIDDEN)
    layer = MergedColumnParallelLinear(HIDDEN, [6, 6], bias=False, tp_rank=rank, tp_size=size)
    assert layer.shard_ids == (0, 1)
    layer.weight.weight_loader(layer.weight, up, 1)
    layer.weight.weight_loader(layer.weight, gate, 0)
    n = 6 // size
    expected = torch.cat([gate[rank * n : (rank + 1) * n], up[rank * n : (rank + 1) * n]])
    assert torch.equal(layer.weight, expected)
    with pytest.raises(ValueError, match="shard id 2"):
        layer.weight.weight_loader(layer.weight, up, 2)


@pytest.mark.parametrize("rank", [0, 1])
def test_column_row_and_vocab_shards_at_tp2(rank: int) -> None:
    w, b = torch.randn(6, 4), torch.randn(6)
    col = ColumnParallelLinear(4, 6, bias=True, tp_rank=rank, tp_size=2)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    assert torch.equal(col.weight, w[3 * rank : 3 * rank + 3])
    assert torch.equal(col.bias, b[3 * rank : 3 * rank + 3])
    row = RowParallelLinear(6, 4, bias=True, tp_rank=rank, tp_size=2)
    row.weight.weight_loader(row.weight, w.T)
    row.bias.weight_loader(row.bias, b[:4])
    assert torch.equal(row.weight, w.T[:, 3 * rank : 3 * rank + 3])
    assert torch.equal(row.bias, b[:4])  # the bias is added once, whole
    with pytest.raises(NotImplementedError, match="all-reduce"):
        row(torch.randn(2, 3))
    table = torch.randn(10, 4)
    embed = VocabParallelEmbedding(10, 4, tp_rank=rank, tp_size=2)
    embed.weight.weight_loader(embed.weight, table)
    assert torch.equal(embed.weight, table[5 * rank : 5 * rank + 5])
    with pytest.raises(ValueError, match="not divisible"):
        ColumnParallelLinear(4, 5, tp_rank=rank, tp_size=2)


def test_single_rank_layers_compute_the_dense_products() -> None:
    x = torch.randn(3, 4)
    w, b = torch.randn(6, 4), torch.randn(6)
    col = ColumnParallelLinear(4, 6, bias=True)
    col.weight.weight_loader(col.weight, w)
    col.bias.weight_loader(col.bias, b)
    assert torch.equal(col(x), F.linear(x, w, b))
    head = ParallelLMHead(6, 4)
    head.weight.weight_loader(head.weight, w)
    assert torch.equal(head.compute_logits(x), F.linear(x, w))
    with pytest.raises(RuntimeError, match="compute_logits"):
        head(torch.tensor([1]))


def test_every_module_of_the_model_has_its_dotted_prefix() -> None:
    config = make_tiny_config("LlamaForCausalLM")
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    kinds = (LinearBase, VocabParallelEmbedding, LlamaAttention, LlamaMLP, LlamaDecoderLayer)
    checked = {name for name, module in model.named_modules() if isinstance(module, kinds)}
    for name, module in model.named_modules():
        if isinstance(module, kinds) or name == "model":
            assert module.prefix == name
    assert {"model.layers.1.self_attn.qkv_proj", "model.layers.0.mlp.gate_up_proj",
            "model.layers.1.mlp.down_proj", "model.embed_tokens", "lm_head"} <= checked
    with torch.device("meta"):
        nested = LlamaForCausalLM(config, prefix="draft")
    assert nested.model.layers[0].self_attn.o_proj.prefix == "draft.model.layers.0.self_attn.o_proj"


# --- quantization as a strategy ---------------------------------------------------------


class _Int8Method(QuantizeMethodBase):
    """Weight-only int8 with one scale per output row, as a checkpoint would store it."""

    def create_weights(
        self, layer: nn.Module, input_size_per_partition: int,
        output_partition_sizes: list[int], input_size: int, output_size: int,
        params_dtype: torch.dtype, **extra_weight_attrs: Any,
    ) -> None:
        rows = sum(output_partition_sizes)
        weight = nn.Parameter(torch.empty(rows, input_size_per_partition, dtype=torch.int8),
                              requires_grad=False)
        scale = nn.Parameter(torch.empty(rows, dtype=params_dtype), requires_grad=False)
        set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
        set_weight_attrs(scale, {"output_dim": 0, **extra_weight_attrs})
        layer.register_parameter("weight", weight)
        layer.register_parameter("weight_scale", scale)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None):
        return F.linear(x, layer.weight.to(x.dtype) * layer.weight_scale[:, None], bias)


@register_quantization_config("pagoda-test-int8")
class _Int8Config(QuantizationConfig):
    @classmethod
    def from_config(cls, config: dict[str, Any]) -> _Int8Config:
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        return None if prefix.endswith("lm_head") else _Int8Method()


def test_registry_resolves_names_and_rejects_unknown_ones() -> None:
    assert "pagoda-test-int8" in quantization_methods()
    assert get_quantization_config("pagoda-test-int8") is _Int8Config
    with pytest.raises(ValueError, match="'no-such-method' is not supported"):
        get_quantization_config("no-such-method")
    config = make_tiny_config("LlamaForCausalLM")
    assert quant_config_from_hf(config) is None
    config.quantization_config = {"quant_method": "pagoda-test-int8"}
    assert isinstance(quant_config_from_hf(config), _Int8Config)


def test_layers_take_a_quant_method_without_knowing_it() -> None:
    config = make_tiny_config("LlamaForCausalLM", num_hidden_layers=1)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, quant_config=_Int8Config())
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, _Int8Method) and qkv.weight.dtype == torch.int8
    assert "model.layers.0.self_attn.qkv_proj.weight_scale" in dict(model.named_parameters())
    assert not isinstance(model.lm_head.quant_method, _Int8Method)  # skipped by prefix

    layer = QKVParallelLinear(HIDDEN, HEAD, TOTAL_HEADS, TOTAL_KV_HEADS, bias=False,
                              quant_config=_Int8Config())
    g = torch.Generator().manual_seed(1)
    dense = []
    for shard_id, rows in (("q", 16), ("k", 8), ("v", 8)):
        q = torch.randint(-127, 128, (rows, HIDDEN), dtype=torch.int8, generator=g)
        scale = torch.rand(rows, generator=g)
        layer.weight.weight_loader(layer.weight, q, shard_id)
        layer.weight_scale.weight_loader(layer.weight_scale, scale, shard_id)
        dense.append(q.float() * scale[:, None])
    x = torch.randn(3, HIDDEN)
    torch.testing.assert_close(layer(x), F.linear(x, torch.cat(dense)))
