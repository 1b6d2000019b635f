"""Layers bound to their loaded tensors.

A decode step of a small model is a few hundred short operator calls; around each, a
layer's ``forward`` looks up its parameters and buffers through ``nn.Module``'s
``__getattr__``, asks its quantization method, then its quant kernel, which operator
to call and with which tensors, and checks what cannot change between calls. Once the
weights are loaded and processed nothing of that changes, so the loader asks each
module once: a module with a ``bind_forward(enabled=True)`` method looks everything up
then and keeps a function that its ``forward`` calls from then on (the linear layers
through their method's ``bind``, plugin API 1.12; RMSNorm and the rotary embedding
themselves). The bound path computes exactly what the unbound one does, bit for bit
(tests/layers/test_binding.py).

Children are bound before their parents, so that a parent may build on what its children
bound: ``LlamaForCausalLM`` builds a decode plan from its bound layers
(``vframe/backends/cpu_paged/plan.py``, plugin API 1.13).

``VFRAME_BIND_LAYERS=0`` leaves every layer unbound (for comparisons). A module must not
change its tensors after it is bound; anything that does calls ``bind_model`` again.
"""

from __future__ import annotations

import os

from torch import nn


def bind_model(model: nn.Module, enabled: bool | None = None) -> int:
    """Bind (or with ``enabled=False`` unbind) every module of ``model`` that has a
    ``bind_forward``; ``None``: as ``VFRAME_BIND_LAYERS`` says (default on). Returns how
    many modules were asked."""
    if enabled is None:
        enabled = os.environ.get("VFRAME_BIND_LAYERS", "1") != "0"
    count = 0
    for module in reversed(list(model.modules())):  # children first: a parent may build on their bound functions
        bind_forward = getattr(module, "bind_forward", None)
        if callable(bind_forward):
            bind_forward(enabled)
            count += 1
    return count
