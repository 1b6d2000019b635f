"""vLLM's module path ``vllm.outputs``: the classes live in ``vframe/core/outputs.py``
(pooling outputs in ``vframe/core/pooling_outputs.py``)."""

from vframe.core.outputs import CompletionOutput, RequestOutput
from vframe.core.pooling_outputs import (
    EmbeddingOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "PoolingOutput",
    "PoolingRequestOutput",
    "RequestOutput",
    "ScoringOutput",
    "ScoringRequestOutput",
]
