"""Outputs of pooling requests, with vLLM's names: ``llm.encode`` returns
``PoolingRequestOutput``s (``.outputs.data``, a tensor), ``llm.embed``
``EmbeddingRequestOutput``s (``.outputs.embedding``, a list of floats),
``llm.score`` ``ScoringRequestOutput``s (``.outputs.score``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    import torch

_O = TypeVar("_O")


@dataclass
class PoolingOutput:
    data: torch.Tensor  # [E] float32 for "embed", [n, E] for "token_embed"


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> EmbeddingOutput:
        if output.data.dim() != 1:
            raise ValueError(f"an embedding is one vector; this pooling output has shape {tuple(output.data.shape)}")
        return cls(output.data.tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ScoringOutput:
    score: float


@dataclass
class PoolingRequestOutput(Generic[_O]):
    request_id: str
    outputs: _O
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, output: PoolingRequestOutput[PoolingOutput]) -> EmbeddingRequestOutput:
        return cls(output.request_id, EmbeddingOutput.from_base(output.outputs), output.prompt_token_ids)


@dataclass
class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    pass
