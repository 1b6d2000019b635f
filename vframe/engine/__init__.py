"""vLLM's module paths ``vllm.engine.arg_utils`` and ``vllm.engine.llm_engine``;
the engine itself is ``vframe/core/engine.py``."""
