"""How C++ calls a bound linear without Python (plugin API 1.13).

A function that ``LinearMethodBase.bind`` or ``QuantLinearKernel.bind`` returns may say
what it computes as one operator call: ``with_native(product, NativeCall(op, args, bias,
max_rows))`` promises that ``op(x, *args)``, plus ``bias`` when it is given, is
``product(x)`` bit for bit for every ``x`` of the layer's dtype with at most ``max_rows``
rows (``None``: any number). A decode plan (``vframe/backends/cpu_paged/plan.py``) then
calls ``op`` through the dispatcher from C++ with no Python in between; a bound function
that says nothing keeps its layer on the Python path, which is always correct.
``vframe.testing.quant``'s kits check the promise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class NativeCall:
    """A bound linear's product as one registered operator's call: ``op(x, *args)``, then
    ``+ bias`` when ``bias`` is given, for ``x`` of at most ``max_rows`` rows. Attach it with
    ``with_native``; calling the instance computes it in Python (what the kits compare).

    Attributes:
        op: a registered operator overload (``torch.ops.namespace.name.overload``), called
            from C++ through the dispatcher with ``x`` first.
        args: what follows ``x``: tensors (the layer's buffers, looked up once), numbers,
            strings, dtypes, lists and ``None``, in the operator's order.
        bias: ``[out]``, added to the operator's result (``out + bias``); ``None`` where the
            layer has none or ``op`` takes it among ``args``.
        max_rows: the most rows of ``x`` the call computes the bound function's result for
            (a kernel that hands larger batches to another path); ``None``: any number.
    """

    op: torch._ops.OpOverload
    args: tuple[Any, ...]
    bias: torch.Tensor | None = None
    max_rows: int | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.op(x, *self.args)
        return out if self.bias is None else out + self.bias


def with_native(product: Any, call: NativeCall) -> Any:
    """``product`` (a function of ``x``), saying that ``call`` computes what it does."""
    product.native = call
    return product


def native_call(product: Any) -> NativeCall | None:
    """What ``with_native`` attached to ``product``; None when nothing was."""
    call = getattr(product, "native", None)
    return call if isinstance(call, NativeCall) else None


def native_result(product: Any, x: torch.Tensor) -> torch.Tensor | None:
    """What the operator call ``product`` says it is computes for ``x``; None where it says
    nothing or ``x`` has more rows than it promises (the conformance kits compare it with
    ``product(x)``)."""
    call = native_call(product)
    if call is None or (call.max_rows is not None and x.shape[0] > call.max_rows):
        return None
    return call(x)
