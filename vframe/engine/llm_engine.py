"""vLLM's module path ``vllm.engine.llm_engine``: the engine is ``vframe/core/engine.py``."""

from vframe.core.engine import LLMEngine

__all__ = ["LLMEngine"]
