"""A token embedding whose ``[vocab, hidden]`` weight a quantization method owns,
and the LM head that multiplies by it (vLLM's ``VocabParallelEmbedding`` and
``ParallelLMHead`` with a ``quant_method``, on one rank).

Models build these only when the run's quantization config supplies an
embedding method (``QuantizationConfig.get_embedding_method``); otherwise they
keep ``nn.Embedding`` and an unquantized ``ReplicatedLinear`` head::

    VocabEmbedding   input_ids [T]   -> [T, hidden]   quant_method.embedding: only the looked-up rows
    TiedLMHead       x [T, hidden]   -> [T, vocab]    quant_method.apply on the embedding's own weight

A tied head holds the embedding module itself, so one quantized tensor serves
both and is loaded, processed and counted once (``nn.Module.modules`` and
``parameters`` visit a shared module once).
"""

from __future__ import annotations

import torch
from torch import nn

from vframe.errors import ModelLoadError
from vframe.quant.base import EmbeddingMethodBase


class VocabEmbedding(nn.Module):
    """``weight[input_ids]`` with the weight kept as ``quant_method`` stores it.

    To the method it looks like a linear layer of ``embedding_dim`` inputs and
    ``num_embeddings`` outputs (``input_size_per_partition``,
    ``output_partition_sizes``), unfused and on one rank."""

    shard_ids: tuple[str | int, ...] = ()
    tp_rank, tp_size = 0, 1

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        quant_method: EmbeddingMethodBase,
        *,
        params_dtype: torch.dtype | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.input_size, self.output_size = embedding_dim, num_embeddings
        self.input_size_per_partition = embedding_dim
        self.output_partition_sizes = [num_embeddings]
        self.quant_method = quant_method
        quant_method.create_weights(
            self, embedding_dim, [num_embeddings], embedding_dim, num_embeddings, self.params_dtype
        )
        for param in self.parameters(recurse=False):
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader

    @property
    def output_size_per_partition(self) -> int:
        return self.num_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.quant_method.embedding(self, input_ids)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise ValueError(f"{self.prefix!r} is a token embedding, not a fused layer; got shard id {shard_id!r}")
        if param.shape != loaded_weight.shape:
            raise ModelLoadError(
                f"has shape {tuple(loaded_weight.shape)}, the model expects {tuple(param.shape)}"
            )
        param.data.copy_(loaded_weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, method={type(self.quant_method).__name__}"


class TiedLMHead(nn.Module):
    """The LM head of a model that ties it to its token embedding: logits through
    the embedding's quantized weight, which stays one tensor."""

    def __init__(self, embedding: VocabEmbedding) -> None:
        super().__init__()
        self.embedding = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, vocab]
        return self.embedding.quant_method.apply(self.embedding, x)
