"""Mixture-of-experts layers of a quantized checkpoint: each expert's projections are
linear layers of the checkpoint's quantizer.

``FusedMoE`` (``moe.py``) stacks every expert's float matrices into two parameters and runs
them as one operator; a quantized checkpoint stores each expert's gate, up and down
projection as separate packed modules (GPTQ ``qweight`` / ``scales``, AWQ, compressed-tensors,
FP8 with block scales as DeepSeek-V3's, ModelOpt, ...). ``QuantizedExperts`` holds them as
the checkpoint names them::

    model.layers.1.mlp.experts.3.gate_proj   ColumnParallelLinear(H -> I), the quantizer's method
    model.layers.1.mlp.experts.3.up_proj     ColumnParallelLinear(H -> I)
    model.layers.1.mlp.experts.3.down_proj   RowParallelLinear(I -> H), its partial sums kept

(Mixtral: ``w1``, ``w3``, ``w2``), so each quantizer matches, loads and multiplies them as it
does a dense layer, on the same quant kernels. ``forward`` is ``FusedMoE``'s: the routed
(token, expert) pairs sorted by expert, each expert's rows through ``down(silu(gate(x)) *
up(x))``, the results weighted and summed per token (``cpu_ops.moe_combine``), one
all-reduce over tensor-parallel ranks at the end. ``moe_experts`` builds whichever the
checkpoint needs; the router stays a float layer in both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vframe.layers.linear import ColumnParallelLinear, RowParallelLinear
from vframe.layers.moe import FusedMoE, RoutedRows
from vframe.layers.parallel import get_tp_size
from vframe.quant.base import QuantizationConfig


def moe_experts(
    num_experts: int,
    hidden_size: int,
    intermediate_size: int,
    *,
    params_dtype: torch.dtype,
    quant_config: QuantizationConfig | None,
    prefix: str,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> nn.Module:
    """The experts of one MoE layer: ``FusedMoE`` for a float checkpoint, ``QuantizedExperts``
    (each expert's ``names`` = gate, up, down projections as its own quantized layers) for a
    quantized one. Both are called as ``experts(x [T, H], topk_weights [T, K], topk_ids [T, K])``."""
    if quant_config is None:
        return FusedMoE(num_experts, hidden_size, intermediate_size, params_dtype=params_dtype, prefix=prefix)
    return QuantizedExperts(num_experts, hidden_size, intermediate_size, params_dtype=params_dtype,
                            quant_config=quant_config, prefix=prefix, names=names)


class QuantizedExpert(nn.Module):
    """One expert's SwiGLU MLP, its three projections named as the checkpoint names them."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        names: tuple[str, str, str],
        quant_config: QuantizationConfig,
        params_dtype: torch.dtype,
        prefix: str,
    ) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        for name in (gate, up):
            self.add_module(name, ColumnParallelLinear(hidden_size, intermediate_size, bias=False,
                                                       quant_config=quant_config, prefix=f"{prefix}.{name}",
                                                       params_dtype=params_dtype))
        self.add_module(down, RowParallelLinear(intermediate_size, hidden_size, bias=False, quant_config=quant_config,
                                                prefix=f"{prefix}.{down}", params_dtype=params_dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, H] -> [n, H]: this rank's partial sums
        gate, up, down = (getattr(self, name) for name in self.names)
        h = F.silu(gate(x)) * up(x)  # [n, I / tp]
        if down.tp_size == 1:
            return down(h)
        return down.quant_method.apply(down, h, None)  # summed over ranks once, by QuantizedExperts


class QuantizedExperts(nn.ModuleList):
    """``num_experts`` ``QuantizedExpert`` modules, item ``e`` at the checkpoint's
    ``experts.{e}`` (see the module docstring)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        params_dtype: torch.dtype,
        quant_config: QuantizationConfig,
        prefix: str,
        names: tuple[str, str, str],
    ) -> None:
        super().__init__(
            QuantizedExpert(hidden_size, intermediate_size, names, quant_config, params_dtype, f"{prefix}.{e}")
            for e in range(num_experts)
        )
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.tp_size = get_tp_size()
        self.prefix = prefix
        self._bound = None  # no fused operator: models that plan their MoE layers take the Python path

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, K] float32
        topk_ids: torch.Tensor,  # [T, K] int64
    ) -> torch.Tensor:  # [T, H], in hidden_states' dtype
        """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x_t)`` for every token ``t``."""
        routed = RoutedRows.of(hidden_states, topk_ids, self.num_experts)
        out = torch.empty_like(routed.x)  # [T*K, H]
        start = 0
        for expert, count in zip(self, routed.counts.tolist()):
            if count:
                out[start : start + count] = expert(routed.x[start : start + count])
            start += count
        return routed.combine(out, topk_weights, self.tp_size)

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, quantized per expert"
