"""vLLM's module path ``vllm.outputs``: the classes live in ``vframe/core/outputs.py``."""

from vframe.core.outputs import CompletionOutput, RequestOutput

__all__ = ["CompletionOutput", "RequestOutput"]
