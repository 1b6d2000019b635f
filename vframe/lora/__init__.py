"""LoRA: the batched low-rank delta added after a linear layer's ``apply`` (DESIGN.md §9).

- ``ops``: the kernel contract: ``LoRASegments`` (which tokens of a step use
  which adapter slot), ``LoRAKernel`` (the callable a kernel implements) and
  ``add_lora`` (the built-in torch kernel, registry kind ``lora_kernel``, name
  ``"torch"``); a third-party kernel is checked with ``vframe.testing.check_lora_kernel``.
- ``request``: ``LoRARequest``, which adapter a request runs with.
- ``peft``: ``load_peft_adapter``, a PEFT directory into host tensors.
- ``layers``: ``LoRALinear``, a vframe linear layer plus the step's deltas.
- ``manager``: ``LoRAManager``, which wraps a model's layers and keeps
  adapters resident in host memory and device slots.
"""

from __future__ import annotations

from vframe.lora.ops import LoRAKernel, LoRASegments, add_lora

__all__ = ["LoRAKernel", "LoRASegments", "add_lora"]
