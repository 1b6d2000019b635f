"""vLLM's ``vllm.v1.sample.logits_processor``: engine-wide batch-level logits processors
(``LLM(logits_processors=[...])``); implemented in ``vframe/core/sample/batch_processors.py``."""

from vframe.core.sample.batch_processors import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MovedRequest,
    MoveDirectionality,
    RemovedRequest,
)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest", "RemovedRequest"]
