"""Quantization: the interface quantizer plugins implement (``base``) and the
choice of a run's config (``selection``). Formats are registry entries of kind
``quantizer`` (no built-in one yet); see docs/plugins.md, "Quantizers"."""

from vframe.quant.base import (
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
    set_weight_attrs,
)

__all__ = ["LinearMethodBase", "QuantizationConfig", "UnquantizedLinearMethod", "set_weight_attrs"]
