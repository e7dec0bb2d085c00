"""The Llama decoder stack with one kernel call per layer between attention calls.

Op by op, a decoder layer is ~12 Python-level calls (modules, op dispatch, views), each
~3-10 us of interpreter and argument parsing beside kernels that at one token per step take
~20-50 us; over 30 layers that host time is a large share of a batch-1 step. Here each
layer's dense part (o_proj, add+RMSNorm, gate_up, SiLU*mul, down, the next layer's
add+RMSNorm, qkv_proj, rotary+KV write) is one call into the C++ extension
(ops/csrc/decoder_layer_cpu.cpp), which runs the very kernels the Python layers run, in
the same order: the result is bit for bit the op-by-op one (tests/model/test_fused_decoder.py).
Attention stays the backend's call, so every step (decode, prefill, mixed) takes this path.
A decode-only step (one query row per request, one metadata for every layer, the C++ decode
attention kernel in use, no attention sinks) goes further: every layer, attention included,
is one call (`decoder_decode_stack`), the same kernels in the same order, so the Python
between the layers and the OpenMP workers' sleep in that gap go too. With one token and
every projection quantized (bf16), that call is one OpenMP region (`one_region_stack`):
each weight gets the quant extension's `GemvPlan`, whose address, with that of its
single-row product (csrc/q_gemv_abi.h), the C++ stack calls from every thread.

Eligible: every projection unquantized with a oneDNN-packed weight (bf16, or fp16 where
oneDNN packs it) or quantized with the CPU quant kernels' panel layout prepared (GGUF
native blocks, group-wise GPTQ / AWQ / RTN codes without an act_order permutation: the
calls the Python layers send to quant_cpu's q_linear), no q/k norm, tensor parallel size 1, and the fused rotary + cache write in
use (the cache in the model's dtype or quantized). Otherwise, and with
`PAGODA_DISABLE_FUSED_LAYERS=1`, the model runs op by op.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pagoda import ops
from pagoda.attention.torch_paged import TorchPagedAttention
from pagoda.ops import gemm_dispatch, quant_cpu
from pagoda.quant.gguf import GGUFEmbeddingMethod, GGUFLinearMethod
from pagoda.quant.group_quant import GroupQuantLinearMethod
from pagoda.quant.unquantized import (
    UnquantizedEmbeddingMethod,
    UnquantizedLinearMethod,
    is_packed,
)

KVCache = tuple[torch.Tensor, ...]


def _packed_dense(linear: nn.Module) -> bool:
    return (
        type(linear.quant_method) is UnquantizedLinearMethod
        and linear.tp_size == 1
        and is_packed(linear.weight)
    )


def _quant_layout(linear: nn.Module) -> Any:
    """The panel layout the Python layer's q_linear call would use, or None."""
    method, weight = linear.quant_method, getattr(linear, "quant_weight", None)
    if not isinstance(method, GGUFLinearMethod | GroupQuantLinearMethod) or weight is None:
        return None
    if linear.tp_size != 1 or getattr(weight, "perm", None) is not None:
        return None
    # NOTE: the op-by-op path takes the kernel only while it resolves (not disabled).
    return weight.kernel_data.get(quant_cpu.NAME) if quant_cpu.resolve() is not None else None


def _layout_weight(ext: Any, lay: Any, plan: int = 0, dense: torch.Tensor | None = None,
                   dense_rows: tuple[int, int] = (0, 0)) -> Any:
    """A panel layout as the extension's `QuantWeight` (the q_linear / dequant_rows
    arguments), with its GemvPlan's address and its dense copy, if any."""
    return ext.QuantWeight(codes=lay.codes, scales=lay.scales, offsets=lay.offsets,
                           bits=lay.bits, block=lay.block, group=lay.group,
                           zero_form=lay.zero_form, n=lay.shape[0], plan=plan, dense=dense,
                           dense_min_rows=dense_rows[0], dense_max_rows=dense_rows[1])


def _linears(layer: nn.Module) -> tuple[nn.Module, ...]:
    attn, mlp = layer.self_attn, layer.mlp
    return (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)


def _eligible(layer: nn.Module, dtype: torch.dtype) -> bool:
    attn = layer.self_attn
    linears = _linears(layer)
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    return (
        not attn.qk_norm
        and all(_packed_dense(m) or _quant_layout(m) is not None for m in linears)
        and all(n.weight.dtype == dtype and n.weight.is_contiguous() for n in norms)
    )


class FusedDecoderStack:
    """The layers of one model as extension `DecoderLayer`s plus their attention backends.

    `qkv`, `mlp` and `mlp_qkv` are the extension's calls, as instance attributes so that a
    profiler (benchmarks/step_timer.py) can time them."""

    def __init__(self, ext: Any, layers: Sequence[nn.Module], dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.first_norm = layers[0].input_layernorm
        self.attns = [layer.self_attn.attn for layer in layers]
        # The quant extension's GemvPlans, which the DecoderLayers point to: kept alive here.
        self._plans: list[Any] = []
        self.layers = [self._layer(ext, layer) for layer in layers]
        self.has_dense = any(_packed_dense(m) for layer in layers for m in _linears(layer))
        self.qkv: Callable[..., Any] = ext.decoder_qkv
        self.mlp: Callable[..., Any] = ext.decoder_mlp
        self.mlp_qkv: Callable[..., Any] = ext.decoder_mlp_qkv
        self.decode_stack: Callable[..., Any] = ext.decoder_decode_stack
        # NOTE: only the plain paged backend's decode path is what the C++ loop repeats.
        self.decode = (
            ext.DecoderStack(self.layers, [a.scale for a in self.attns],
                             [-1 if a.sliding_window is None else int(a.sliding_window)
                              for a in self.attns],
                             gemv_fn=self._gemv_fn())
            if all(type(a) is TorchPagedAttention for a in self.attns) else None
        )
        self._decode_kernel: dict[tuple[torch.dtype, int], bool] = {}
        self.decode_steps = 0  # steps run by decode_stack (tests, diagnostics)
        self.decode_burst: Callable[..., Any] = ext.decoder_decode_burst
        self._ext = ext
        self._token_weights: tuple[Any, Any] | None | bool = False  # False: not built

    @staticmethod
    def _gemv_fn() -> int:
        """The quant extension's single-row product for the one-region decode stack
        (csrc/q_gemv_abi.h); 0 where that extension does not run here."""
        qext = quant_cpu.resolve()
        return 0 if qext is None else int(qext.gemv_part_address())

    def _weight(self, ext: Any, linear: nn.Module, k: int | None = None) -> Any:
        lay = _quant_layout(linear)
        if lay is None:
            return linear.weight
        plan = quant_cpu.resolve().GemvPlan(
            codes=lay.codes, scales=lay.scales, offsets=lay.offsets, bits=lay.bits,
            block=lay.block, group=lay.group, zero_form=lay.zero_form, n=lay.shape[0],
            k=linear.input_size if k is None else k)
        self._plans.append(plan)
        # NOTE: quant/gguf.py's dense copy, for the products of the rows it serves
        dense, rows = getattr(linear, "dense_weight", None), getattr(linear, "dense_rows", None)
        return _layout_weight(ext, lay, plan=plan.address, dense=dense,
                              dense_rows=rows if dense is not None else (0, 0))

    def token_weights(self, embed: nn.Module, head: nn.Module) -> tuple[Any, Any] | None:
        """(the LM head, the token table) as the extension's weights for a decode burst
        (`decoder_decode_burst`): the products `compute_logits` and the lookups
        `embed_tokens` run, built once. None where either takes a path the burst does not
        repeat (a float32 model, a head that is not packed, a K-quant table)."""
        if self._token_weights is False:
            with torch.no_grad():
                self._token_weights = self._build_token_weights(embed, head)
        return self._token_weights

    def _build_token_weights(self, embed: nn.Module, head: nn.Module) -> tuple[Any, Any] | None:
        ext, dtype = self._ext, self.dtype
        if dtype != torch.bfloat16 or embed.tp_size != 1 or head.tp_size != 1:
            return None
        method = head.quant_method
        if _quant_layout(head) is not None:
            head_w = self._weight(ext, head, k=head.embedding_dim)
        elif type(method) is UnquantizedEmbeddingMethod and head.packed_logits_weight is not None:
            head_w = head.packed_logits_weight
        elif type(method) is UnquantizedLinearMethod and is_packed(head.weight):
            head_w = head.weight
        else:
            return None
        method, table = embed.quant_method, getattr(embed, "quant_weight", None)
        if type(method) is GGUFEmbeddingMethod and table is not None and table.raw is None:
            # NOTE: the lookups quant_cpu.dequantize_rows serves (its conditions).
            lay = table.layout
            if quant_cpu.resolve() is None or lay.group != lay.block:
                return None
            embed_w = _layout_weight(ext, lay)
        elif (type(method) is UnquantizedEmbeddingMethod and embed.weight.dtype == dtype
              and embed.weight.is_contiguous()):
            embed_w = embed.weight.detach()
        else:
            return None
        return head_w, embed_w

    def burst(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
        kv_caches: Sequence[KVCache], mds: Sequence[Any], block_table: torch.Tensor,
        block_size: int, max_steps: int, stop_ids: torch.Tensor, norm: nn.Module,
        token_weights: tuple[Any, Any], interrupt: torch.Tensor | None = None,
        temperature: torch.Tensor | None = None, exps: torch.Tensor | None = None,
        seeds: torch.Tensor | None = None, truncation: Sequence[Any] | None = None,
        penalties: Sequence[Any] | None = None,
    ) -> list[list[int]] | None:
        """Up to `max_steps` tokens of each decode row in one call (`decoder_decode_burst`),
        from x, their tokens' embeddings, ending after a step in which a row chose a token
        of `stop_ids`, and none started after the uint8 [1] flag `interrupt` is raised: per
        row its tokens (as many for every row). Greedy, or with `temperature` [B] float32
        the race of `Sampler.plain` with step i's draws: exps[i] of `exps` [>= max_steps, B,
        V] float32, or the kernel's own from seeds[i][row] of `seeds` [>= max_steps, B]
        int64 where that is >= 0, over what the rows' `truncation` (`Truncation`: top_k,
        top_p, min_p [B]) leaves, on the logits as the rows' `penalties` (`Penalties`, whose
        seen and counts tables the call updates) leave them, where given. None where this
        step would not run as `decoder_decode_stack` (the caller then runs it as usual)."""
        if not self._decodes_in_one_call(x, kv_caches, mds):
            return None
        head_w, embed_w = token_weights
        pos0 = positions.to(torch.int64).contiguous()
        tokens = self.decode_burst(self.decode, x, cos, sin, pos0, kv_caches, block_table,
                                   block_size, norm.weight, norm.eps, head_w, embed_w,
                                   stop_ids, max_steps, interrupt, temperature, exps, seeds,
                                   *(truncation or (None,) * 3), *(penalties or (None,) * 8))
        self.decode_steps += tokens.shape[0]
        return tokens.t().tolist()

    def _layer(self, ext: Any, layer: nn.Module) -> Any:
        attn, mlp = layer.self_attn, layer.mlp
        return ext.DecoderLayer(
            input_norm=layer.input_layernorm.weight.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            qkv_w=self._weight(ext, attn.qkv_proj), o_w=self._weight(ext, attn.o_proj),
            gate_up_w=self._weight(ext, mlp.gate_up_proj),
            down_w=self._weight(ext, mlp.down_proj),
            qkv_b=attn.qkv_proj.bias, o_b=attn.o_proj.bias,
            gate_up_b=mlp.gate_up_proj.bias, down_b=mlp.down_proj.bias,
            eps=layer.post_attention_layernorm.eps, num_heads=attn.num_heads,
            num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
        )

    @classmethod
    def build(cls, layers: Sequence[nn.Module]) -> FusedDecoderStack | None:
        """The stack for these layers' current weights; None where a layer is not eligible
        or the extension's whole-layer calls do not run here."""
        if not layers:
            return None
        dtype = layers[0].input_layernorm.weight.dtype
        probe = layers[0].input_layernorm.weight
        ext = ops.decoder_layers_for(probe)
        if ext is None or not all(_eligible(layer, dtype) for layer in layers):
            return None
        # NOTE: the norms' eps must agree: each DecoderLayer carries one (the model's).
        if any(layer.input_layernorm.eps != layer.post_attention_layernorm.eps
               for layer in layers):
            return None
        with torch.no_grad():
            return cls(ext, layers, dtype)

    def widens(self, x: torch.Tensor) -> bool:
        """Whether x has enough rows that this CPU's dense bf16 products run in float32
        (ops/gemm_dispatch.py): the extension's GEMMs are oneDNN's bf16 ones, so the model
        then runs op by op, where that dispatch happens. Prefill-sized batches only: the
        host time the stack saves is negligible beside their GEMMs."""
        return self.has_dense and x.shape[0] >= gemm_dispatch.active_min_rows

    def run(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
        kv_caches: Sequence[KVCache], mds: Sequence[Any],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embeddings x [T, hidden] -> (last layer's output, residual), exactly what the
        layers return op by op. The caller has checked that the fused rotary + cache write
        applies (cos/sin and the caches as `ops.fused_ops_for` requires)."""
        layers, attns = self.layers, self.attns
        kv, md = kv_caches[0], mds[0]
        if self._decodes_in_one_call(x, kv_caches, mds):
            self.decode_steps += 1
            # NOTE: the first input norm runs in the call; x is also the residual it updates.
            out = self.decode_stack(self.decode, x, x, cos, sin, positions, kv_caches,
                                    md.slot_mapping, md.decode_block_tables, md.decode_seq_lens)
            return out, x
        residual, x = x, self.first_norm(x)
        q, k, v = self.qkv(layers[0], x, cos, sin, positions, kv[0], kv[1], md.slot_mapping,
                           *(kv[2:] or (None, None)))
        last = len(layers) - 1
        for i in range(last):
            out = attns[i].forward(q, k, v, kv_caches[i], mds[i], kv_written=True)
            kv, md = kv_caches[i + 1], mds[i + 1]
            q, k, v = self.mlp_qkv(layers[i], layers[i + 1], out, residual, cos, sin,
                                   positions, kv[0], kv[1], md.slot_mapping,
                                   *(kv[2:] or (None, None)))
        out = attns[last].forward(q, k, v, kv_caches[last], mds[last], kv_written=True)
        return self.mlp(layers[last], out, residual), residual

    def _decodes_in_one_call(self, x: torch.Tensor, kv_caches: Sequence[KVCache],
                             mds: Sequence[Any]) -> bool:
        """Whether this step is decode-only and every layer's attention would take the C++
        decode kernel, so that `decoder_decode_stack` repeats exactly the per-layer path."""
        md = mds[0]
        if (self.decode is None or md.prefills or md.num_decode_tokens != x.shape[0]
                or any(m is not md for m in mds)
                or any(a.sinks is not None for a in self.attns)):
            return False
        key = (x.dtype, id(kv_caches[0][0]))
        runs = self._decode_kernel.get(key)
        if runs is None:
            # NOTE: the backend's decode rows call ops.paged_attention with [T, H, D] queries.
            attn = self.attns[0]
            q = x.new_empty(0, attn.num_heads, attn.head_dim)
            chosen = [ops.paged_attention.select_kernel(q, *kv[:2]) for kv in kv_caches]
            runs = self._decode_kernel[key] = all(
                c is not None and c[0].name == "cpp" for c in chosen)
        return runs
