"""vLLM's ``vllm.engine.async_llm_engine.AsyncLLMEngine``, which in vLLM's v1
engine is ``AsyncLLM`` under its older name; so it is here
(``vframe/v1/engine/async_llm.py``). vframe's own asyncio engine, under the same
name, is ``vframe.core.async_engine.AsyncLLMEngine``."""

from vframe.v1.engine.async_llm import AsyncLLM as AsyncLLMEngine

__all__ = ["AsyncLLMEngine"]
