"""Read a resolved model: its config, architecture, weights, tokenizer; build the module."""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vframe.core.interfaces import AttentionBackend
from vframe.errors import ConfigError, ModelLoadError
from vframe.models.config import ModelConfig
from vframe.models.loader.resolve import ResolvedModel
from vframe.models.loader.weights import process_weights_after_loading
from vframe.quant.base import QuantizationConfig


def architecture(resolved: ResolvedModel, hf_overrides: dict[str, Any] | None = None) -> str:
    """The model class name the checkpoint declares (``config.architectures[0]``)."""
    architectures = getattr(load_hf_config(resolved, hf_overrides), "architectures", None)
    if not architectures:
        raise ModelLoadError(
            f"{resolved.model_dir / 'config.json'} has no 'architectures' list; "
            'add e.g. "architectures": ["LlamaForCausalLM"]'
        )
    return architectures[0]


def load_hf_config(resolved: ResolvedModel, hf_overrides: dict[str, Any] | None = None) -> ModelConfig:
    """The checkpoint's ``config.json`` with transformers' defaults for its model type,
    and the fields of ``hf_overrides`` (the engine setting) in place of the file's."""
    return ModelConfig.from_file(resolved.model_dir / "config.json", hf_overrides)


def iterate_weights(resolved: ResolvedModel) -> Iterator[tuple[str, torch.Tensor]]:
    """``(hf_name, tensor)`` for every tensor of every safetensors file, memory-mapped."""
    from safetensors import SafetensorError, safe_open

    for path in resolved.weight_files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{path}: corrupt safetensors file ({e})") from e


def load_tokenizer(resolved: ResolvedModel, tokenizer_override: str | None = None) -> Any:
    """A fast transformers tokenizer, from ``tokenizer_override`` (a directory or a
    .gguf file) when given, else from the model directory."""
    from transformers import AutoTokenizer

    if tokenizer_override is None:
        source = resolved.model_dir
    else:
        source = Path(tokenizer_override).expanduser()
        if not source.exists():
            raise ModelLoadError(
                f"tokenizer={tokenizer_override!r}: not a file or directory; vframe does not download tokenizers"
            )
    try:
        if source.is_file():
            return AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
        if (source / "tokenizer.json").is_file():
            # The generic fast tokenizer reads tokenizer.json directly; AutoTokenizer
            # would first import transformers' model registry (~1.5 s of start-up).
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(str(source), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(source), local_files_only=True)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(
            f"{source}: no usable tokenizer ({e}); pass tokenizer=<directory with tokenizer.json>"
        ) from e


def load_model(
    resolved: ResolvedModel,
    model_cls: type[nn.Module],
    attn_backend: type[AttentionBackend],
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    quant_config: QuantizationConfig | None = None,
    hf_overrides: dict[str, Any] | None = None,
) -> nn.Module:
    """Build ``model_cls(hf_config, attn_backend, dtype[, quant_config=...])`` on
    ``device``, load every parameter, then let each layer's quantization method
    finish its weights. ``quant_config=None`` runs unquantized, and a model class
    that does not take ``quant_config`` (plugin API < 1.2) can only run so.
    ``hf_overrides`` replace fields of ``config.json`` (see ``load_hf_config``)."""
    hf_config = load_hf_config(resolved, hf_overrides)
    kwargs: dict[str, Any] = {}
    if quant_config is not None:
        if "quant_config" not in inspect.signature(model_cls).parameters:
            raise ConfigError(
                f"model class {model_cls.__module__}.{model_cls.__qualname__} takes no quant_config, "
                f"so it cannot run quantized ({quant_config.get_name()}); drop the quantization setting"
            )
        kwargs["quant_config"] = quant_config
    with torch.device(device):
        model = model_cls(hf_config, attn_backend, dtype, **kwargs)
    loaded = model.load_weights(iterate_weights(resolved))
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{resolved.source}: the checkpoint has no weights for {shown}")
    process_weights_after_loading(model)
    return model.eval().requires_grad_(False)
