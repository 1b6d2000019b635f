"""Read a resolved model: its config, architecture, weights, tokenizer; build the module."""

from __future__ import annotations

import inspect
import json
import logging
import math
import mmap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vframe.core.interfaces import AttentionBackend
from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.binding import bind_model
from vframe.models.config import ModelConfig
from vframe.models.loader.resolve import ResolvedModel
from vframe.models.loader.weights import process_weights_after_loading
from vframe.quant.base import QuantizationConfig, UnquantizedLinearMethod

logger = logging.getLogger(__name__)


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
    """``(hf_name, tensor)`` for every tensor of every safetensors file.

    Each tensor is a view of the memory-mapped file, not a copy: the file's pages
    are read when a weight loader copies from them, so a tensor-parallel rank that
    keeps rows ``[a, b)`` of a matrix reads those rows' pages only, and no rank holds
    a whole checkpoint tensor beside its parameters. (The mapping is private:
    nothing can write to the file through it.)"""
    for path in resolved.weight_files:
        try:
            yield from _mapped_tensors(path)
        except (ValueError, KeyError, OSError) as e:
            raise ModelLoadError(f"{path}: corrupt safetensors file ({e})") from e


# safetensors dtype names (its format's header) -> torch
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


def _mapped_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of one safetensors file as views of its mapping. The format: an
    8-byte little-endian header size, a JSON header ``name -> {dtype, shape,
    data_offsets}`` (offsets into the bytes after the header), then the data."""
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    header_size = int.from_bytes(mapped[:8], "little")
    if not 0 < header_size <= len(mapped) - 8:
        raise ValueError(f"header size {header_size} does not fit a file of {len(mapped)} bytes")
    header = json.loads(mapped[8 : 8 + header_size])
    data_start = 8 + header_size
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise ValueError(f"tensor {name!r} has dtype {entry['dtype']!r}, which vframe does not read")
        begin, end = entry["data_offsets"]
        shape = entry["shape"]
        count = math.prod(shape)
        if end - begin != count * dtype.itemsize or data_start + end > len(mapped):
            raise ValueError(f"tensor {name!r}: data_offsets {entry['data_offsets']} do not hold shape {shape}")
        if count == 0:
            yield name, torch.empty(shape, dtype=dtype)
            continue
        yield name, torch.frombuffer(mapped, dtype=dtype, count=count, offset=data_start + begin).view(shape)


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
    finish its weights and bind the layers, on ``device``: the model must not be moved
    afterwards (its bound layers would keep the old tensors). ``quant_config=None``
    runs unquantized, and a model class that does not take ``quant_config`` (plugin
    API < 1.2) can only run so.
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
    loaded = model.load_weights(_checkpoint_weights(resolved, quant_config, hf_config))
    missing = sorted({name for name, _ in model.named_parameters()} - loaded)
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise ModelLoadError(f"{resolved.source}: the checkpoint has no weights for {shown}")
    # Whatever the model made on the host (tables built with numpy, a loader's CPU copy)
    # moves now: processing decides by the weights' device (no oneDNN packing on a GPU),
    # and bound layers keep the tensors they were bound to.
    model.to(device)
    process_weights_after_loading(model)
    bind_model(model)
    if quant_config is None:
        logger.info("loaded %s: %.1f MiB of weights", resolved.source, weight_bytes(model) / 2**20)
    else:
        quantized = sum(weight_bytes(m) for m in quantized_linear_layers(model))
        logger.info(
            "loaded %s: %.1f MiB of weights, %.1f MiB of them in %s-quantized layers",
            resolved.source, weight_bytes(model) / 2**20, quantized / 2**20, quant_config.get_name(),
        )
    return model.eval().requires_grad_(False)


def weight_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s weights as they sit in memory: its parameters (a tied
    tensor once) and the buffers of its linear layers and their submodules (where
    quantization methods and quant kernels keep repacked weights); not caches such
    as rotary tables."""
    tensors = {_identity(p): p for p in module.parameters()}
    for m in module.modules():
        if getattr(m, "quant_method", None) is not None:
            tensors.update((_identity(b), b) for b in m.buffers())
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _identity(t: torch.Tensor) -> int:
    # oneDNN-packed weights (vframe/quant/onednn_packed.py) are opaque: no data_ptr
    return id(t) if t.is_mkldnn else t.data_ptr()


def quantized_linear_layers(model: nn.Module) -> list[nn.Module]:
    """The layers whose quantization method is not the unquantized default."""
    return [
        m for m in model.modules()
        if getattr(m, "quant_method", None) is not None and not isinstance(m.quant_method, UnquantizedLinearMethod)
    ]


def _checkpoint_weights(
    resolved: ResolvedModel, quant_config: QuantizationConfig | None, hf_config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors to load: the safetensors files, or for ``quantization="gguf"``
    the GGUF file itself with its linear weights still quantized."""
    if quant_config is None:
        return iterate_weights(resolved)
    if quant_config.get_name() != "gguf":
        rename = quant_config.checkpoint_tensor_name
        return ((rename(name), tensor) for name, tensor in iterate_weights(resolved))
    if resolved.gguf_file is None:
        raise ConfigError(
            f"quantization='gguf' reads a .gguf file; model={str(resolved.source)!r} is a Hugging Face "
            "directory: pass the .gguf file, or drop the quantization setting"
        )
    from vframe.models.loader.gguf import iterate_gguf_quantized

    return iterate_gguf_quantized(resolved.gguf_file, hf_config)
