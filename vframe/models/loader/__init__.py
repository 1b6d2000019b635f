"""Model loading: resolve a model name to local files, then read config, weights, tokenizer."""

from vframe.models.loader.load import (
    architecture,
    iterate_weights,
    load_hf_config,
    load_model,
    load_tokenizer,
)
from vframe.models.loader.resolve import ResolvedModel, default_cache_dir, resolve_model
from vframe.models.loader.weights import default_weight_loader, load_named_weights

__all__ = [
    "ResolvedModel",
    "architecture",
    "default_cache_dir",
    "default_weight_loader",
    "iterate_weights",
    "load_hf_config",
    "load_model",
    "load_named_weights",
    "load_tokenizer",
    "resolve_model",
]
