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

Under tensor parallelism (``tensor_parallel_size > 1``) the unquantized
embedding and head are split by vocabulary rows instead::

    VocabParallelEmbedding  input_ids [T] -> [T, hidden]  this rank's rows, zeros elsewhere, all-reduce
    ParallelLMHead          x [T, hidden] -> [T, vocab]   this rank's columns, all-gather

Rank ``r`` of ``R`` holds rows ``[r * S, (r + 1) * S)`` with ``S = ceil(vocab / R)``;
the last rank's rows past ``vocab`` are zero padding, cut from the gathered logits. A
quantized embedding (GGUF's) stays whole on every rank, as a quantized LM head does: its
lookups need no all-reduce, its tied head gives every rank all the logits.
"""

from __future__ import annotations

import torch
from torch import nn

from vframe.errors import ModelLoadError
from vframe.layers.linear import ReplicatedLinear
from vframe.layers.parallel import all_gather, all_reduce, get_tp_rank, get_tp_size
from vframe.quant.base import EmbeddingMethodBase, QuantizationConfig


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


class VocabParallelEmbedding(nn.Module):
    """``weight[input_ids]`` with the ``[vocab, hidden]`` weight split by rows over
    the tensor-parallel ranks: each rank looks up the ids it holds, zeros the
    rest, and one all-reduce sums the ranks' rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype, prefix: str = "") -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.rows_per_rank = -(-num_embeddings // self.tp_size)
        self.row_start = self.tp_rank * self.rows_per_rank
        self.weight = nn.Parameter(
            torch.empty(self.rows_per_rank, embedding_dim, dtype=params_dtype), requires_grad=False
        )  # [S, hidden]
        self.weight.weight_loader = self.weight_loader

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        local = input_ids - self.row_start  # [T]
        outside = (local < 0) | (local >= self.rows_per_rank)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        x.masked_fill_(outside.unsqueeze(-1), 0)
        return all_reduce(x, self.tp_size)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Keep this rank's rows of the whole ``[vocab, hidden]`` checkpoint tensor."""
        if shard_id is not None:
            raise ValueError(f"{self.prefix!r} is a token embedding, not a fused layer; got shard id {shard_id!r}")
        expected = (self.num_embeddings, self.embedding_dim)
        if tuple(loaded_weight.shape) != expected:
            raise ModelLoadError(f"has shape {tuple(loaded_weight.shape)}, the model expects {expected}")
        rows = loaded_weight[self.row_start : self.row_start + self.rows_per_rank]
        param.data.zero_()
        param.data[: rows.shape[0]].copy_(rows)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows={self.row_start}+{self.rows_per_rank}, tp={self.tp_size}"


class ParallelLMHead(nn.Module):
    """Logits ``x W^T`` with ``W`` split by vocabulary rows as in
    ``VocabParallelEmbedding`` (tied: the embedding's own shard); every rank
    ends with the whole ``[T, vocab]``."""

    def __init__(
        self,
        hidden_size: int,
        vocab_size: int,
        *,
        params_dtype: torch.dtype,
        tied_to: VocabParallelEmbedding | None = None,
        prefix: str = "lm_head",
    ) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp_size = get_tp_size()
        if tied_to is not None:
            self.weight = tied_to.weight
        else:
            shard = VocabParallelEmbedding(vocab_size, hidden_size, params_dtype=params_dtype, prefix=prefix)
            self.weight = shard.weight  # [S, hidden], loaded by the same row split

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, vocab]
        local = nn.functional.linear(x, self.weight)  # [T, S]
        return all_gather(local, self.tp_size)[..., : self.vocab_size]


def unquantized_embedding(num_embeddings: int, embedding_dim: int, *, params_dtype: torch.dtype, prefix: str) -> nn.Module:
    """The token embedding of an unquantized model: ``nn.Embedding`` on one rank,
    split by vocabulary rows over the ranks of a tensor-parallel group."""
    if get_tp_size() > 1:
        return VocabParallelEmbedding(num_embeddings, embedding_dim, params_dtype=params_dtype, prefix=prefix)
    # An explicit, uninitialised weight skips Embedding's random init.
    weight = torch.empty(num_embeddings, embedding_dim, dtype=params_dtype)
    return nn.Embedding(num_embeddings, embedding_dim, _weight=weight)


def token_embedding(
    vocab_size: int, hidden_size: int, *, params_dtype: torch.dtype, quant_config: QuantizationConfig | None,
    prefix: str,
) -> nn.Module:
    """A model's token embedding: a ``VocabEmbedding`` where the quantizer keeps the table
    quantized (``get_embedding_method``: GGUF), else ``unquantized_embedding``'s."""
    method = None if quant_config is None else quant_config.get_embedding_method(prefix)
    if method is None:
        return unquantized_embedding(vocab_size, hidden_size, params_dtype=params_dtype, prefix=prefix)
    return VocabEmbedding(vocab_size, hidden_size, method, params_dtype=params_dtype, prefix=prefix)


def lm_head(
    hidden_size: int,
    vocab_size: int,
    *,
    params_dtype: torch.dtype,
    embedding: nn.Module,
    tied: bool,
    quant_config: QuantizationConfig | None,
) -> nn.Module:
    """The LM head beside ``embedding``, as the checkpoint stores it:

    * a quantized embedding (``VocabEmbedding``): tied, through its own tensor
      (``TiedLMHead``); untied, a linear layer of the same format;
    * an untied head the quantization config quantizes on its own
      (``QuantizationConfig.quantizes_lm_head``: compressed-tensors or GPTQ
      checkpoints that quantize ``lm_head``): a linear layer, whole on every rank;
    * otherwise ``unquantized_lm_head``."""
    if isinstance(embedding, VocabEmbedding):
        if tied:
            return TiedLMHead(embedding)  # one quantized tensor serves both
        return ReplicatedLinear(
            hidden_size, vocab_size, bias=False, quant_config=quant_config, prefix="lm_head", params_dtype=params_dtype
        )
    if quant_config is not None and not tied and quant_config.quantizes_lm_head():
        return ReplicatedLinear(
            hidden_size, vocab_size, bias=False, quant_config=quant_config, prefix="lm_head", params_dtype=params_dtype
        )
    return unquantized_lm_head(hidden_size, vocab_size, params_dtype=params_dtype, embedding=embedding, tied=tied)


def unquantized_lm_head(
    hidden_size: int, vocab_size: int, *, params_dtype: torch.dtype, embedding: nn.Module, tied: bool
) -> nn.Module:
    """The LM head beside ``unquantized_embedding``'s ``embedding``, sharing its
    weight when ``tied``."""
    if isinstance(embedding, VocabParallelEmbedding):
        return ParallelLMHead(hidden_size, vocab_size, params_dtype=params_dtype, tied_to=embedding if tied else None)
    head = ReplicatedLinear(hidden_size, vocab_size, bias=False, prefix="lm_head", params_dtype=params_dtype)
    if tied:
        head.weight = embedding.weight
    return head
