"""A decode plan: a Llama-style model's decoder layers run in C++ for decode steps.

A batch-1 decode step of a small model is some 30 short operator calls a layer; with every
layer bound (``vframe/layers/binding.py``) the Python around them is still about 100 us a
layer (module calls, views, splits, residual adds, ``torch.ops`` dispatch), a quarter of a
GGUF step of SmolLM2. Where every part of a layer can be called from C++ the model builds
a plan once, after binding (``LlamaForCausalLM.bind_forward``): the ``DecodePlan`` class of
``vframe/layers/csrc/cpu_ops.cpp`` holds each layer's norm weights and its four linears as
their bound functions describe them (``vframe.quant.native_call``: an operator and its
arguments) and runs a whole step's layers with no Python in between: the same operators in
the same order with the same arguments as the bound layers, so the same result bit for bit
(tests/backends/test_decode_plan.py). A mixture-of-experts MLP (Mixtral's block, its
``plan_moe()``) takes part as its router linear, ``softmax_topk`` and its bound experts'
``moe_experts`` operator, in place of gate_up and down.

The plan takes a step when it is all decodes on this backend (one query token per request,
no padding rows), of at most ``max_tokens`` tokens (the smallest row limit of the
linears' operators), outside autograd and tracing;
anything else runs the layers, and so does every step while a forward hook is registered on
any module the plan stands in for (or globally): the layers call hooks, the plan cannot.
``VFRAME_DECODE_PLAN=0`` turns it off.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.modules.module as module_hooks
from torch import nn

from vframe.backends.cpu_paged.backend import CpuPagedAttentionImpl, CpuPagedMetadata
from vframe.layers import cpu_ops
from vframe.layers.moe import PlanMoe
from vframe.quant.native_call import NativeCall, native_call

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PlanLayer:
    """What one decoder layer hands the plan (``LlamaModel.plan_layers``)."""

    input_norm: torch.Tensor  # [E], the RMSNorm weights
    post_norm: torch.Tensor  # [E]
    linears: tuple[Any, ...]  # qkv, o, gate_up, down: the layers (LinearBase); qkv, o where moe is set
    attention: Any  # the layer's attention impl
    moe: PlanMoe | None = None  # a mixture-of-experts MLP in place of gate_up and down
    silu_pairs: torch.Tensor | None = None  # gate_up's bf16 pairs: bf16_gemm_silu in place of gate_up + SwiGLU


def enabled() -> bool:
    return os.environ.get("VFRAME_DECODE_PLAN", "1") != "0"


def _native(linear: Any) -> NativeCall | None:
    """The operator call a bound single-rank linear layer says it is."""
    if getattr(linear, "tp_size", 1) != 1:
        return None
    return native_call(getattr(linear, "_bound", None))


def _call_args(call: NativeCall) -> tuple[str, str, list[Any], torch.Tensor | None]:
    """``call`` as the C++ plan takes a bound linear: operator name, overload, arguments, bias."""
    # an empty list cannot cross as Any: None stands for it (the plan makes the schema's empty list)
    args = [None if isinstance(a, list | tuple) and not a else a for a in call.args]
    return call.op._schema.name, call.op._overloadname, args, call.bias


class DecodePlan:
    """The C++ plan of a model's layers and the steps it takes."""

    def __init__(self, handle: Any, max_tokens: int, dtype: torch.dtype, modules: Iterable[nn.Module] = ()) -> None:
        self.handle = handle
        self.max_tokens = max_tokens
        self.dtype = dtype
        # The forward hooks of the modules the plan stands in for, and the global ones: a hook
        # registered on any of them (now or later) sends steps to the layers, which call it.
        self._hooks = (
            module_hooks._global_forward_hooks, module_hooks._global_forward_pre_hooks,
            *(d for m in modules for d in (m._forward_hooks, m._forward_pre_hooks)),
        )

    @classmethod
    def build(
        cls,
        layers: list[PlanLayer],
        *,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        cos_sin_cache: torch.Tensor,  # [max_pos, D] float32, the rotary table
        dtype: torch.dtype,
        modules: Iterable[nn.Module] = (),  # every module the plan stands in for (their hooks)
    ) -> DecodePlan | None:
        """The plan of ``layers``, or None (logged) where some part cannot run in it."""
        reason = cls._refusal(layers, dtype)
        if reason is not None:
            logger.debug("no decode plan: %s", reason)
            return None
        scale = layers[0].attention.scale
        handle = torch.classes.vframe_cpu_ops.DecodePlan(num_heads, num_kv_heads, head_dim, scale, eps, cos_sin_cache)
        limits = [sys.maxsize]
        for layer in layers:
            attention = layer.attention
            handle.add_layer(layer.input_norm, layer.post_norm, attention.sliding_window or 0, attention.k_scale,
                             attention.v_scale)
            if attention.has_kv_head_scales:  # plugin API 1.22
                handle.set_head_scales(*attention.kv_head_scales("cpu"))
            for linear in layer.linears:
                call = _native(linear)
                handle.add_linear(*_call_args(call))
                limits.append(call.max_rows or sys.maxsize)
            if layer.silu_pairs is not None:
                handle.set_silu_pairs(layer.silu_pairs)
            if (moe := layer.moe) is not None:
                call = _native(moe.router)
                handle.add_moe(*_call_args(call), moe.top_k, moe.renormalize, *moe.experts.args)
                limits.append(call.max_rows or sys.maxsize)
        return cls(handle, min(limits), dtype, modules)

    @staticmethod
    def _refusal(layers: list[PlanLayer], dtype: torch.dtype) -> str | None:
        if not enabled():
            return "VFRAME_DECODE_PLAN=0"
        if not layers:
            return "no layers"
        if cpu_ops.guard(dtype) is None:
            return f"the fused CPU operators do not run {dtype}"
        scale = layers[0].attention.scale
        for i, layer in enumerate(layers):
            attention = layer.attention
            if type(attention).forward is not CpuPagedAttentionImpl.forward:
                return f"layer {i}'s attention is {type(attention).__name__}, not cpu_paged's"
            if attention.scale != scale:
                return f"layer {i}'s attention scale differs from layer 0's"
            for linear in (*layer.linears, *((layer.moe.router,) if layer.moe is not None else ())):
                if _native(linear) is None:
                    return f"{getattr(linear, 'prefix', linear)} has no native bound call"
            if layer.silu_pairs is not None and (layer.moe is not None or dtype != torch.bfloat16):
                return f"layer {i}'s bf16_gemm_silu pairs need a bfloat16 dense MLP"
            if layer.moe is not None and layer.moe.experts.op is not cpu_ops.operator("moe_experts"):
                return f"layer {i}'s experts are not bound to moe_experts"
            if any(t.dtype != dtype or not t.is_contiguous() for t in (layer.input_norm, layer.post_norm)):
                return f"layer {i}'s norm weights are not contiguous {dtype}"
        return None

    def run(
        self,
        x: torch.Tensor,  # [T, E], the embedded tokens
        positions: torch.Tensor,  # [T]
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor | None:  # [T, E] before the final norm; None: the step is not the plan's
        meta = attn_metadata
        tokens = x.shape[0]
        if (
            type(meta) is not CpuPagedMetadata
            or meta.decode_req_ids.shape[0] != tokens
            or meta.num_actual_tokens != tokens
            or tokens > self.max_tokens
            or x.dtype != self.dtype
            or positions.dtype != torch.int64
            or torch.is_grad_enabled()
            or torch.compiler.is_compiling()
            or any(self._hooks)
        ):
            return None
        return self.handle.run(
            x, positions, kv_caches, meta.slot_mapping, meta.block_table, meta.seq_lens,
            meta.decode_req_ids, meta.decode_rows,
        )  # fmt: skip
