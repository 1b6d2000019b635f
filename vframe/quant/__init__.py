"""Quantization: the interface quantizer plugins implement (``base``), the
choice of a run's config (``selection``) and the built-in formats (``gptq``,
``awq``, ``fp8``, ``compressed_tensors``, ``gguf`` with its block formats in
``gguf_dequant``; ``packing`` unpacks their int32 words; ``onednn_packed``
prepacks unquantized bfloat16 weights for oneDNN on the CPU). Formats are registry
entries of kind ``quantizer``; see docs/plugins.md, "Quantizer", and
docs/quantization.md."""

from vframe.quant.base import (
    EmbeddingMethodBase,
    LinearMethodBase,
    QuantizationConfig,
    UnquantizedLinearMethod,
    register_weight,
    set_weight_attrs,
)

__all__ = [
    "EmbeddingMethodBase",
    "LinearMethodBase",
    "QuantizationConfig",
    "UnquantizedLinearMethod",
    "register_weight",
    "set_weight_attrs",
]
