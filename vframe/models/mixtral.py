"""Mixtral: Llama (``vframe/models/llama.py``) with a sparse mixture of experts
in place of each layer's MLP.

Each token's router logits (``gate``, ``H -> E``, unquantized) pick its
``num_experts_per_tok`` experts by softmax; their weights are renormalized to sum
to 1 and the experts run batched by expert (``vframe/layers/moe.py``)::

    h [T, H] -> gate -> logits [T, E] -> softmax, top-k -> weights, ids [T, K]
             -> FusedMoE(h, weights, ids) -> [T, H]

Checkpoints name the block ``block_sparse_moe`` and the experts
``experts.{e}.w1`` (gate), ``w3`` (up), ``w2`` (down); transformers >= 5 names
them ``mlp`` and ``experts.gate_up_proj`` / ``experts.down_proj`` in memory, and
llm-compressor (0.14, on transformers 5) saves quantized experts as
``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``. All load (the last read as
``w1`` / ``w3`` / ``w2``). ``router_jitter_noise`` only applies in training and is ignored.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vframe.core.interfaces import AttentionBackend
from vframe.errors import ModelLoadError
from vframe.layers.linear import ReplicatedLinear
from vframe.layers.moe import ExpertWeightLoader, PlanMoe, softmax_topk
from vframe.layers.quantized_moe import moe_experts
from vframe.models.llama import LlamaForCausalLM
from vframe.quant.base import QuantizationConfig

ARCHITECTURES = ["MixtralForCausalLM"]


class MixtralSparseMoeBlock(nn.Module):
    def __init__(
        self, hf_config: Any, dtype: torch.dtype, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        self.top_k = hf_config.num_experts_per_tok
        num_experts = hf_config.num_local_experts
        # Routing stays unquantized, as quantized checkpoints keep it.
        self.gate = ReplicatedLinear(
            hf_config.hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate", params_dtype=dtype
        )
        self.experts = moe_experts(
            num_experts,
            hf_config.hidden_size,
            hf_config.intermediate_size,
            params_dtype=dtype,
            quant_config=quant_config,
            prefix=f"{prefix}.experts",
            names=("w1", "w3", "w2"),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        router_logits = self.gate(x)  # [T, E]
        topk_weights, topk_ids = softmax_topk(router_logits, self.top_k, renormalize=True)  # [T, K] each
        return self.experts(x, topk_weights, topk_ids)

    def plan_moe(self) -> PlanMoe | None:
        """This block as a decode plan runs it (``LlamaModel.plan_layers``), once bound; None
        where the plan cannot: a subclass's forward, tensor parallelism, experts not bound."""
        bound = self.experts._bound
        if type(self).forward is not MixtralSparseMoeBlock.forward or bound is None or self.experts.tp_size != 1:
            return None
        return PlanMoe(self.gate, self.top_k, True, bound)


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_cls = MixtralSparseMoeBlock
    supports_cuda_graphs = False  # the experts' routing sizes its work from the routed token counts

    def __init__(
        self,
        hf_config: Any,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        check_moe_config(hf_config)
        super().__init__(hf_config, attn_backend, dtype, quant_config)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        experts = ExpertWeightLoader(self, self.config.num_local_experts, gate="w1", down="w2", up="w3")
        others = (
            (name, tensor)
            for name, tensor in ((_vframe_name(name), tensor) for name, tensor in weights)
            if not experts.load(name, tensor)
        )
        loaded = super().load_weights(others)
        return loaded | experts.loaded()


# llm-compressor's names for an expert's projections -> the released checkpoints'
_EXPERT_PROJECTIONS = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_EXPERT_PROJECTION = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.")


def _vframe_name(name: str) -> str:
    """A checkpoint tensor's name as vframe's Mixtral holds it: the block is ``mlp``, an
    expert's projections ``w1`` / ``w3`` / ``w2``."""
    name = name.replace(".block_sparse_moe.", ".mlp.")
    return _EXPERT_PROJECTION.sub(lambda m: f".experts.{m[1]}.{_EXPERT_PROJECTIONS[m[2]]}.", name)


def check_moe_config(hf_config: Any) -> None:
    """The rule ``config.json``'s per-field checks cannot express:
    ``1 <= num_experts_per_tok <= num_local_experts``."""
    num_experts = hf_config.num_local_experts
    top_k = hf_config.num_experts_per_tok
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= num_experts:
        raise ModelLoadError(
            f"config.json: invalid value for 'num_experts_per_tok': {json.dumps(top_k)} "
            f"(expected an integer from 1 to num_local_experts={num_experts})"
        )
