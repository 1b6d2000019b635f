"""LoRA: the batched low-rank delta added after a linear layer's ``apply`` (DESIGN.md §9).

For now this is the kernel contract only: ``LoRASegments`` (which tokens of a
step use which adapter slot), ``LoRAKernel`` (the callable a kernel
implements) and ``add_lora`` (the built-in torch kernel). Loading adapters and
the layer wrappers come with multi-LoRA serving; kernels (Triton, punica-style
SGMV/BGMV) will then be selectable by name. Until then a third-party kernel is
typed against ``LoRAKernel`` and checked with ``vframe.testing.check_lora_kernel``.
"""

from __future__ import annotations

from vframe.lora.ops import LoRAKernel, LoRASegments, add_lora

__all__ = ["LoRAKernel", "LoRASegments", "add_lora"]
