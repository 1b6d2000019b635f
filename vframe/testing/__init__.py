"""The plugin conformance kit: checks a plugin author runs in their own tests.

vframe runs the same checks on its built-ins (``tests/testing/``,
``tests/backends/test_torch_attn.py``), and ``vframe plugins --check NAME``
runs their quick forms on an installed plugin. Each check raises
``AssertionError`` with what went wrong, so it reads as a failed test under
pytest; nothing here needs pytest.

``vframe.testing.attention``
    ``check_attention_backend(backend, *, dtype, device, quick)``: paged
    attention against a float32 reference, within ``ATTENTION_TOLERANCES``.
``vframe.testing.models``
    ``assert_matches_transformers(model, prompts, ...)``: greedy generation
    against transformers, token for token up to a near tie.
``vframe.testing.logits``
    ``check_logits_processor(processor, ...)``: shape, dtype, device, no NaN,
    determinism, empty history.
``vframe.testing.lifecycle``
    ``check_lifecycle_hooks(plugin)``: a real engine raises every lifecycle
    hook with every finish reason; none of the plugin's hooks may raise.
``vframe.testing.scheduler``
    ``check_scheduler(scheduler="default", *, policy="fcfs", quick=False)`` and
    ``check_scheduling_policy(policy, *, quick=False)``.
``vframe.testing.quant``
    ``check_quant_method(quantizer, ...)``: a quantizer's linear method on every
    layer kind against plain PyTorch.
``vframe.testing.quant_kernel``
    ``check_quant_kernel(kernel, *, dtype, device, quick)``: a quantized linear
    kernel against ``IntWeight.dequantize`` on random packed weights.
``vframe.testing.lora``
    ``check_lora_kernel(kernel=add_lora, *, dtype, device, quick)``: a LoRA
    kernel against ``reference_add_lora``, within ``LORA_TOLERANCES``.
``vframe.testing.quick``
    ``run_quick_checks(name, kind=None)``: what ``vframe plugins --check`` runs.

The names above are importable from ``vframe.testing`` itself; each submodule
is imported on first use, so ``import vframe.testing`` imports no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "ATTENTION_TOLERANCES": "attention",
    "check_attention_backend": "attention",
    "reference_attention": "attention",
    "assert_matches_transformers": "models",
    "check_lifecycle_hooks": "lifecycle",
    "LORA_TOLERANCES": "lora",
    "check_lora_kernel": "lora",
    "reference_add_lora": "lora",
    "check_logits_processor": "logits",
    "make_plugin_context": "logits",
    "check_quant_method": "quant",
    "check_quant_kernel": "quant_kernel",
    "check_scheduler": "scheduler",
    "check_scheduling_policy": "scheduler",
    "run_quick_checks": "quick",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'vframe.testing' has no attribute {name!r}")
    return getattr(importlib.import_module(f"vframe.testing.{module}"), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
