"""Prompt types (vLLM's ``vllm.inputs``): what ``LLM.generate`` and
``LLMEngine.add_request`` take.

A prompt is a string, a list of token ids, a ``TextPrompt`` or a
``TokensPrompt``. vframe serves text-only models, so the other keys of vLLM's
prompt dicts (``multi_modal_data``, ``mm_processor_kwargs``, ``token_type_ids``)
are refused, naming the key, rather than ignored.
"""

from __future__ import annotations

from typing import Any, NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine."""

    prompt: str
    cache_salt: NotRequired[str]  # prefix-cache hits only between prompts with the same salt


class TokensPrompt(TypedDict):
    """A tokenized prompt; ``prompt`` is its text, if known (it is only reported back)."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt | dict[str, Any]
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids", "cache_salt"})
