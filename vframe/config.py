"""vLLM's ``vllm.config``: ``VllmConfig`` is vframe's ``EngineConfig`` (what an
engine-wide logits processor receives as ``vllm_config``; its fields are vframe's
sections, ``docs/configuration.md``, not vLLM's)."""

from vframe.core.config import EngineConfig

VllmConfig = EngineConfig

__all__ = ["EngineConfig", "VllmConfig"]
