"""Vocabulary-parallel embedding and LM head (vLLM's contract), at tp_size 1 for now.

Rank r of tp_size holds the table rows [r * n, (r + 1) * n) of the vocabulary (n =
vocab / tp_size); the loader copies that slice of the checkpoint's full table. No padding:
the table keeps the checkpoint's exact shape, so `state_dict()` round-trips.

NOTE: at tp_size > 1 the lookup (mask + all-reduce) and the logits (all-gather) need
communication pagoda does not have yet; they raise.
"""

from __future__ import annotations

import torch
from torch import nn

from pagoda.layers.linear import divide, load_shard, load_whole, packed_units
from pagoda.quant.base import QuantizableLayer, QuantizationConfig, QuantizeMethodBase
from pagoda.quant.unquantized import UnquantizedEmbeddingMethod, UnquantizedLinearMethod


class VocabParallelEmbedding(QuantizableLayer):
    """Token ids [...] -> rows [..., embedding_dim]; `compute_logits` when it is a tied head."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
        params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        super().__init__()
        self._quant_config = quant_config
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.prefix, self.tp_rank, self.tp_size = prefix, tp_rank, tp_size
        self.num_embeddings_per_partition = divide(num_embeddings, tp_size)
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        # NOTE: set by ParallelLMHead.tie_weights: the table then also computes logits.
        self.computes_logits = False
        self.packed_logits_weight: torch.Tensor | None = None
        self.quant_method = self._make_quant_method()
        self.quant_method.create_weights(
            self, embedding_dim, [self.num_embeddings_per_partition], embedding_dim,
            num_embeddings, params_dtype or torch.get_default_dtype(),
            weight_loader=self.weight_loader,
        )

    def _make_quant_method(self) -> QuantizeMethodBase:
        # NOTE: lookups need `embedding()`: the unquantized table method's, or the one of a
        # config's `get_embedding_method`.
        config = self._quant_config
        method = config.get_embedding_method(self, self.prefix) if config else None
        return method or UnquantizedEmbeddingMethod()

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        """Copy this rank's vocabulary rows along the parameter's `output_dim` (a quantized
        LM head's tensors may hold the vocabulary along dim 1, or packed)."""
        dim = getattr(param, "output_dim", 0)
        if dim is None:
            load_whole(param, loaded_weight)
            return
        n, start, full = packed_units(param, dim, self.num_embeddings_per_partition,
                                      self.vocab_start_index, self.num_embeddings)
        load_shard(param, loaded_weight, dim, start, n, full)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._require_single_rank("an embedding lookup")
        return self.quant_method.embedding(self, input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, embedding_dim] -> logits [T, num_embeddings]."""
        self._require_single_rank("computing logits")
        return self.quant_method.apply(self, hidden)

    def _require_single_rank(self, what: str) -> None:
        if self.tp_size > 1:
            raise NotImplementedError(
                f"{self.prefix}: {what} at tp_size {self.tp_size} needs tensor-parallel "
                "communication, which pagoda does not have yet"
            )

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings_per_partition}, {self.embedding_dim}, "
            f"tp={self.tp_rank}/{self.tp_size}, quant_method={type(self.quant_method).__name__}"
        )


class ParallelLMHead(VocabParallelEmbedding):
    """The LM head: a vocabulary-parallel [vocab, hidden] matrix used only for logits, so
    its quant method may repack it (there are no lookups)."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *,
        quant_config: QuantizationConfig | None = None, prefix: str = "",
        params_dtype: torch.dtype | None = None, tp_rank: int = 0, tp_size: int = 1,
    ) -> None:
        super().__init__(
            num_embeddings, embedding_dim, quant_config=quant_config, prefix=prefix,
            params_dtype=params_dtype, tp_rank=tp_rank, tp_size=tp_size,
        )

    def _make_quant_method(self) -> QuantizeMethodBase:
        config = self._quant_config
        method = config.get_quant_method(self, self.prefix) if config else None
        return method or UnquantizedLinearMethod()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError(f"{self.prefix}: an LM head computes logits (compute_logits)")

    @staticmethod
    def tie_weights(embed_tokens: VocabParallelEmbedding) -> VocabParallelEmbedding:
        """Tied embeddings: the head is the embedding table itself; returns the module to
        use as the head (the table, now also computing logits)."""
        embed_tokens.computes_logits = True
        return embed_tokens
