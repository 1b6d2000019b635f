"""Model loading: resolve a model name to local files, then read config, weights, tokenizer."""

from vframe.models.loader.load import (
    architecture,
    iterate_weights,
    load_hf_config,
    load_model,
    load_tokenizer,
)
from vframe.models.loader.resolve import ResolvedModel, default_cache_dir, resolve_model

__all__ = [
    "ResolvedModel",
    "architecture",
    "default_cache_dir",
    "iterate_weights",
    "load_hf_config",
    "load_model",
    "load_tokenizer",
    "resolve_model",
]
