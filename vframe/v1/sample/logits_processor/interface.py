"""vLLM's ``vllm.v1.sample.logits_processor.interface``."""

from vframe.core.sample.batch_processors import (
    AddedRequest,
    BatchUpdate,
    LogitsProcessor,
    MovedRequest,
    MoveDirectionality,
    RemovedRequest,
)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MoveDirectionality", "MovedRequest", "RemovedRequest"]
