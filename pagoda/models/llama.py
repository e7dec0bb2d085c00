"""The Llama family: Llama 2/3, SmolLM2, Mistral (sliding window), Qwen2 (qkv bias),
Qwen3 (q/k norm). One decoder, switched by config fields, not by subclass.

Module names follow transformers' (`model.layers.3.self_attn.qkv_proj`, each module's
`prefix`), except that q/k/v and gate/up are packed (`packed_modules_mapping`);
`load_weights` hands the checkpoint's separate tensors to the packed layers' loaders.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn
from transformers import PretrainedConfig

from pagoda.attention.backend import AttentionMetadata, get_backend
from pagoda.layers.activation import silu_and_mul
from pagoda.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagoda.layers.norm import RMSNorm
from pagoda.layers.rotary import RotaryEmbedding, apply_rotary, rope_inv_freq
from pagoda.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagoda.models.fused_decoder import FusedDecoderStack
from pagoda.models.registry import register_model
from pagoda.models.weight_utils import load_weights_by_name
from pagoda.ops import fused_ops_for
from pagoda.ops.kv_quant import is_quantized
from pagoda.quant.base import QuantizableLayer, QuantizationConfig

KVCache = tuple[torch.Tensor, ...]  # K, V (and, quantized, their scales)
_UNBUILT = object()  # LlamaForCausalLM._fused_stack before it is (re)built


@dataclass(frozen=True)
class LlamaSpec:
    """The slice of an HF config the decoder needs, with each family's defaults resolved."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    sliding_windows: tuple[int | None, ...]
    max_position_embeddings: int

    @classmethod
    def from_hf(cls, c: PretrainedConfig) -> LlamaSpec:
        arch = (c.architectures or ["LlamaForCausalLM"])[0]
        heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
        attn_bias = bool(getattr(c, "attention_bias", False))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        return cls(
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=c.rms_norm_eps,
            qkv_bias=True if is_qwen2 else attn_bias,
            o_bias=False if is_qwen2 else attn_bias,
            mlp_bias=bool(getattr(c, "mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            sliding_windows=_sliding_windows(c, arch),
            max_position_embeddings=c.max_position_embeddings,
        )


def _sliding_windows(c: PretrainedConfig, arch: str) -> tuple[int | None, ...]:
    """Each layer's window (None: full attention): Mistral windows every layer; others
    follow `layer_types` (transformers derives Qwen2's from use_sliding_window and
    max_window_layers: layers from max_window_layers on are windowed)."""
    window = getattr(c, "sliding_window", None)
    n = c.num_hidden_layers
    if arch == "MistralForCausalLM":
        return (window,) * n
    if arch == "Qwen2ForCausalLM" and not getattr(c, "use_sliding_window", False):
        return (None,) * n
    layer_types = getattr(c, "layer_types", None)
    if window and layer_types:
        return tuple(window if t == "sliding_attention" else None for t in layer_types)
    return (None,) * n


class RopeInputs:
    """One step's rotary inputs, shared by every layer: the positions and the full cos/sin
    tables for the fused kernel, or the rows gathered once (on first use) for PyTorch ops."""

    __slots__ = ("_cos_sin", "cos_table", "fused", "positions", "sin_table")

    def __init__(
        self, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused
    ) -> None:
        self.positions, self.cos_table, self.sin_table, self.fused = positions, cos, sin, fused
        self._cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None

    def cos_sin(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin rows of this step's positions: [T, 1, D / 2] each."""
        if self._cos_sin is None:
            p = self.positions
            self._cos_sin = (self.cos_table[p][:, None], self.sin_table[p][:, None])
        return self._cos_sin


class LlamaAttention(nn.Module):
    def __init__(
        self, spec: LlamaSpec, layer_idx: int, backend: str,
        quant_config: QuantizationConfig | None, prefix: str,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.qkv_proj = QKVParallelLinear(
            spec.hidden_size, spec.head_dim, spec.num_heads, spec.num_kv_heads,
            bias=spec.qkv_bias, quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.o_proj = RowParallelLinear(
            spec.num_heads * spec.head_dim, spec.hidden_size, bias=spec.o_bias,
            quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        # NOTE: this rank's heads (all of them at tp_size 1).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.head_dim = spec.head_dim
        if spec.qk_norm:
            self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
            self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.qk_norm = spec.qk_norm
        self.attn = get_backend(backend)(
            self.num_heads, self.num_kv_heads, spec.head_dim, spec.sliding_windows[layer_idx]
        )

    def forward(
        self,
        x: torch.Tensor,
        rope: RopeInputs,
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        nq, nqk = self.num_heads, self.num_heads + self.num_kv_heads
        if rope.fused is not None and not self.qk_norm:
            # One kernel rotates q and k in place and writes k and v to the cache.
            rope.fused.rotary_and_cache(
                qkv, rope.cos_table, rope.sin_table, rope.positions, kv_cache[0], kv_cache[1],
                md.slot_mapping, self.num_heads, self.num_kv_heads, *kv_cache[2:],
            )
            q, k, v = qkv[:, :nq], qkv[:, nq:nqk], qkv[:, nqk:]
            return self.o_proj(self.attn.forward(q, k, v, kv_cache, md, kv_written=True))
        cos, sin = rope.cos_sin()
        if self.qk_norm:
            q = apply_rotary(self.q_norm(qkv[:, :nq]), cos, sin)
            k = apply_rotary(self.k_norm(qkv[:, nq:nqk]), cos, sin)
        else:
            # NOTE: q and k rotate in one pass: half the small ops per layer.
            qk = apply_rotary(qkv[:, :nqk], cos, sin)
            q, k = qk[:, :nq], qk[:, nq:]
        v = qkv[:, nqk:]
        return self.o_proj(self.attn.forward(q, k, v, kv_cache, md))


class LlamaMLP(nn.Module):
    def __init__(
        self, spec: LlamaSpec, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.gate_up_proj = MergedColumnParallelLinear(
            spec.hidden_size, [spec.intermediate_size] * 2, bias=spec.mlp_bias,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias,
            quant_config=quant_config, prefix=f"{prefix}.down_proj",
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, spec: LlamaSpec, layer_idx: int, backend: str,
        quant_config: QuantizationConfig | None, prefix: str,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.self_attn = LlamaAttention(
            spec, layer_idx, backend, quant_config, prefix=f"{prefix}.self_attn"
        )
        self.mlp = LlamaMLP(spec, quant_config, prefix=f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        rope: RopeInputs,
        kv_cache: KVCache,
        md: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm.forward_residual(x, residual)
        x = self.self_attn(x, rope, kv_cache, md)
        x, residual = self.post_attention_layernorm.forward_residual(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(
        self, spec: LlamaSpec, backend: str, quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.embed_tokens = VocabParallelEmbedding(
            spec.vocab_size, spec.hidden_size, quant_config=quant_config,
            prefix=f"{prefix}.embed_tokens",
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(spec, i, backend, quant_config, prefix=f"{prefix}.layers.{i}")
            for i in range(spec.num_layers)
        )
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


@register_model(
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"
)
class LlamaForCausalLM(nn.Module):
    packed_modules_mapping: ClassVar[dict[str, list[str]]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(
        self,
        hf_config: PretrainedConfig,
        attn_backend: str = "torch_paged",
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.spec = spec = LlamaSpec.from_hf(hf_config)
        self.hf_config, self.prefix = hf_config, prefix
        dot = f"{prefix}." if prefix else ""
        self.model = LlamaModel(spec, attn_backend, quant_config, prefix=f"{dot}model")
        if spec.tie_word_embeddings:
            self.lm_head = ParallelLMHead.tie_weights(self.model.embed_tokens)
        else:
            self.lm_head = ParallelLMHead(
                spec.vocab_size, spec.hidden_size, quant_config=quant_config,
                prefix=f"{dot}lm_head",
            )
        self.rotary: RotaryEmbedding | None = None
        self._fused_stack: FusedDecoderStack | None | object = _UNBUILT

    def init_rotary(self, max_positions: int, dtype: torch.dtype, device: torch.device) -> None:
        """Builds the cos/sin tables, with the GGUF file's rope frequency factors if any."""
        factors = getattr(self.hf_config, "rope_freq_factors", None)
        rotary = RotaryEmbedding(
            self.hf_config, self.spec.head_dim, max_positions,
            None if factors is None else torch.tensor(factors, dtype=torch.float32),
        )
        rotary.to_dtype(dtype)
        self.rotary = rotary.to(device)

    def ensure_rotary_positions(self, num_positions: int) -> None:
        """Grow the cos/sin tables (doubling) to cover positions [0, num_positions): a
        stream with attention sinks outgrows max_model_len."""
        size = self.rotary.cos.shape[0]
        if num_positions > size:
            while size < num_positions:
                size *= 2
            self.init_rotary(size, self.rotary.cos.dtype, self.rotary.cos.device)

    def set_attention_sinks(self, num_sink_tokens: int, window: int) -> None:
        """StreamingLLM: every full-attention layer reads the first `num_sink_tokens` and the
        last `window` tokens, with rotary positions taken within that cache."""
        factors = getattr(self.hf_config, "rope_freq_factors", None)
        inv_freq, _ = rope_inv_freq(
            self.hf_config, self.spec.head_dim,
            None if factors is None else torch.tensor(factors, dtype=torch.float32),
        )
        for i, layer in enumerate(self.model.layers):
            if self.spec.sliding_windows[i] is None:
                layer.self_attn.attn.set_attention_sinks(num_sink_tokens, window, inv_freq)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        md: AttentionMetadata | list[AttentionMetadata],
    ) -> torch.Tensor:
        """Flat batch [T] -> final hidden states [T, hidden] (normed). `md`: one metadata
        for every layer, or one per layer (models with several KV cache groups)."""
        x = self.model.embed_tokens(input_ids)
        fused, stack = self._fused_paths(x, kv_caches)
        layer_mds = md if isinstance(md, list) else [md] * len(kv_caches)
        cos, sin = self.rotary.cos, self.rotary.sin
        if stack is not None:
            x, residual = stack.run(x, cos, sin, positions, kv_caches, layer_mds)
        else:
            rope = RopeInputs(positions, cos, sin, fused)
            residual = None
            for layer, kv_cache, layer_md in zip(self.model.layers, kv_caches, layer_mds,
                                                 strict=True):
                x, residual = layer(x, residual, rope, kv_cache, layer_md)
        x, _ = self.model.norm.forward_residual(x, residual)
        return x

    def _fused_paths(self, x: torch.Tensor,
                     kv_caches: list[KVCache]) -> tuple[object | None, FusedDecoderStack | None]:
        """For activations x: the fused ops the layers call (None: PyTorch's ops) and the
        fused decoder stack where it runs this step (None: the layers run op by op)."""
        # NOTE: the fused rotary + cache write needs the cache in the activations' dtype
        # or quantized (--kv-cache-dtype can differ); otherwise rotary and the write run apart.
        cache_dtype = kv_caches[0][0].dtype
        fused = fused_ops_for(x) if cache_dtype == x.dtype or is_quantized(cache_dtype) else None
        stack = self.fused_stack() if fused is not None else None
        if stack is None or not stack.dtype == x.dtype == self.rotary.cos.dtype or stack.widens(x):
            return fused, None
        if len(kv_caches) != len(stack.layers):
            raise ValueError(f"{len(kv_caches)} KV caches for {len(stack.layers)} layers")
        return fused, stack

    def decode_burst(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
        md: AttentionMetadata | list[AttentionMetadata], block_table: torch.Tensor,
        block_size: int, max_steps: int, stop_ids: torch.Tensor,
        interrupt: torch.Tensor | None = None, temperature: torch.Tensor | None = None,
        exps: torch.Tensor | None = None, seeds: torch.Tensor | None = None,
        truncation: Sequence[Any] | None = None, penalties: Sequence[Any] | None = None,
    ) -> list[list[int]] | None:
        """Up to `max_steps` decode steps of B requests (one token each) in one extension
        call: the tokens `forward`, `compute_logits` and `Sampler.greedy` (or, given
        `temperature` [B], step i's draws, exps[i] or the kernel's own from seeds[i], the
        rows' `truncation` and `penalties`, `FusedDecoderStack.burst`: `Sampler.plain` or
        the full sampler) would choose step after step (the same kernels), ending after a
        step in which a row chose a
        token of `stop_ids`, or once another thread raises the uint8 [1] flag `interrupt`
        (the step under way finishes). `input_ids` / `positions` / `md`: the first step's;
        `block_table` [B, M]: the requests' blocks for every step. Per row its tokens, as
        many for every row; None where the steps would not run through the fused decode
        stack (the caller runs one step as usual)."""
        token_weights = self._token_weights()
        if token_weights is None:
            return None
        x = self.model.embed_tokens(input_ids)
        _, stack = self._fused_paths(x, kv_caches)
        if stack is None:
            return None
        cos, sin = self.rotary.cos, self.rotary.sin
        # NOTE: the rotary tables end at max_model_len, which the scheduler's steps respect.
        max_steps = min(max_steps, cos.shape[0] - int(positions.max()))
        if max_steps < 1:
            return None
        layer_mds = md if isinstance(md, list) else [md] * len(kv_caches)
        return stack.burst(x, cos, sin, positions, kv_caches, layer_mds, block_table,
                           block_size, max_steps, stop_ids, self.model.norm, token_weights,
                           interrupt, temperature, exps, seeds, truncation, penalties)

    def supports_decode_burst(self) -> bool:
        """Whether `decode_burst` can run here: the fused decode stack is built and the head
        and the token table take kernels the burst repeats."""
        return self._token_weights() is not None

    def _token_weights(self) -> tuple | None:
        stack = self.fused_stack()
        if stack is None or stack.decode is None:
            return None
        return stack.token_weights(self.model.embed_tokens, self.lm_head)

    def fused_stack(self) -> FusedDecoderStack | None:
        """The layers as whole-layer kernel calls (models/fused_decoder.py), built once for
        the current weights; None: the layers run op by op."""
        if self._fused_stack is _UNBUILT:
            self._fused_stack = FusedDecoderStack.build(self.model.layers)
        return self._fused_stack

    def _apply(self, fn, recurse: bool = True):
        # NOTE: .to() and friends replace (and repack) the weights the stack holds.
        self._fused_stack = _UNBUILT
        return super()._apply(fn, recurse)

    def process_weights_after_loading(self) -> None:
        """Lets every layer's quant method prepare its weights (e.g. the CPU repack)."""
        for module in self.modules():
            if isinstance(module, QuantizableLayer):
                module.process_weights_after_loading()
        self._fused_stack = _UNBUILT

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], source: str = "") -> None:
        """Loads checkpoint tensors (HF names) through the parameters' weight loaders,
        converting dtype one tensor at a time. Raises CheckpointError naming the tensor on
        a wrong shape, an unknown name, a tensor given twice, or one the checkpoint lacks."""
        # NOTE: some tied checkpoints still store the head: a copy of the embedding.
        ignored = frozenset({"lm_head.weight"} if self.spec.tie_word_embeddings else ())
        load_weights_by_name(
            self, _without_inv_freq(weights), self.packed_modules_mapping, ignored, source
        )


def _without_inv_freq(
    weights: Iterable[tuple[str, torch.Tensor]],
) -> Iterable[tuple[str, torch.Tensor]]:
    """Drops the rotary inverse frequencies older transformers checkpoints saved as
    `model.layers.N.self_attn.rotary_emb.inv_freq` (pagoda computes its own)."""
    for name, tensor in weights:
        if name.split(".")[-2:] != ["rotary_emb", "inv_freq"]:
            yield name, tensor
