"""vframe: an LLM inference and serving engine, a small core plus plugins.

``from vframe import LLM, SamplingParams`` — importing vframe loads no model code,
no kernels and no plugins; those come when an engine is built.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vframe.version import PLUGIN_API_VERSION, __version__

if TYPE_CHECKING:
    from vframe.core.outputs import CompletionOutput, Logprob, RequestOutput
    from vframe.core.sample.beam_search import BeamSearchOutput
    from vframe.core.sampling_params import (
        BeamSearchParams,
        GuidedDecodingParams,
        SamplingParams,
        StructuredOutputsParams,
    )
    from vframe.core.inputs import PromptType, TextPrompt, TokensPrompt
    from vframe.engine.arg_utils import EngineArgs
    from vframe.entrypoints.llm import LLM
    from vframe.lora.request import LoRARequest

_LAZY = {
    "LLM": "vframe.entrypoints.llm",
    "SamplingParams": "vframe.core.sampling_params",
    "BeamSearchParams": "vframe.core.sampling_params",
    "StructuredOutputsParams": "vframe.core.sampling_params",
    "GuidedDecodingParams": "vframe.core.sampling_params",
    "BeamSearchOutput": "vframe.core.sample.beam_search",
    "RequestOutput": "vframe.core.outputs",
    "CompletionOutput": "vframe.core.outputs",
    "Logprob": "vframe.core.outputs",
    "EngineConfig": "vframe.core.config",
    "LLMEngine": "vframe.core.engine",
    "EngineArgs": "vframe.engine.arg_utils",
    "AsyncEngineArgs": "vframe.engine.arg_utils",
    "AsyncLLMEngine": "vframe.engine.async_llm_engine",
    "PromptType": "vframe.core.inputs",
    "TextPrompt": "vframe.core.inputs",
    "TokensPrompt": "vframe.core.inputs",
    "LoRARequest": "vframe.lora.request",
    "hookimpl": "vframe.plugins.hookspecs",
}

__all__ = ["__version__", "PLUGIN_API_VERSION", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'vframe' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
