"""vLLM's module path ``vllm.inputs``: the types live in ``vframe/core/inputs.py``."""

from vframe.core.inputs import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
