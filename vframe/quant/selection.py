"""Pick and build the quantization config of a run: the ``quantization`` setting,
else the method a quantized checkpoint names in its ``config.json``."""

from __future__ import annotations

from typing import Any

import torch

from vframe.errors import ConfigError
from vframe.plugins import get_registry
from vframe.quant.base import QuantizationConfig

AUTO = "auto"  # the checkpoint's own quant_method, like no setting


def build_quant_config(
    name: str | None, hf_config: Any, *, dtype: torch.dtype, device: torch.device, quant_kernel: str | None = None
) -> QuantizationConfig | None:
    """The ``QuantizationConfig`` for ``quantization=name`` on a checkpoint whose
    config is ``hf_config``; ``None`` runs unquantized.

    With ``name=None`` (or ``"auto"``) a checkpoint that carries
    ``quantization_config`` uses the quantizer registered under its
    ``quant_method``; there is no silent fallback to loading packed tensors as floats.
    ``quant_kernel`` (the setting) names the kernel its integer layers run on."""
    hf_quant_config: dict[str, Any] | None = getattr(hf_config, "quantization_config", None)
    registry = get_registry("quantizer")
    if name is None or name == AUTO:
        if hf_quant_config is None:
            return None
        name = hf_quant_config.get("quant_method")
        if name not in registry:
            known = ", ".join(registry.names()) or "(none)"
            raise ConfigError(
                f"the checkpoint is quantized (config.json quantization_config.quant_method={name!r}) "
                f"and no quantizer of that name is registered (known: {known}); install a quantizer "
                "plugin for it, or set quantization=<a known name>"
            )
    config_cls: type[QuantizationConfig] = registry.load(name)
    reasons = config_cls.validate_configuration(dtype=dtype, device=device)
    if reasons:
        raise ConfigError(f"quantization={name!r} cannot serve this configuration: " + "; ".join(reasons))
    config = config_cls.from_config(hf_quant_config)
    config.quant_kernel = quant_kernel
    return config
