"""Mixture of experts: ``num_experts`` SwiGLU MLPs, each token run through the
``top_k`` its router picked, executed batched by expert.

The ``T * K`` (token, expert) pairs are sorted by expert, so that each expert's
rows are one contiguous segment; each expert multiplies its segment once::

    topk_ids  [[2, 0],        pairs sorted by expert     segment per expert
               [0, 3],   ->   (t0,e0) (t1,e0) (t0,e2)  -> e0: rows 0..1  e1: none
               [3, 2]]        (t2,e2) (t1,e3) (t2,e3)     e2: rows 2..3  e3: rows 4..5

Experts without tokens cost nothing and nothing ``[T, E, ...]`` is built: the
time follows the experts that receive tokens (their weights are read once per
step), not ``num_experts`` (``benchmarks/moe_layer.py``). Each
output row is scaled by its router weight in float32, summed per token in
float32 and cast once: transformers' default (``grouped_mm``) Mixtral numerics.

``expert_params_mapping`` and ``match_expert_weight`` map the per-expert
checkpoint names (``...experts.3.w1.weight``) onto the stacked parameters;
``ExpertWeightLoader`` loads those and transformers' stacked layout.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vframe.errors import ConfigError, ModelLoadError
from vframe.layers import cpu_ops
from vframe.layers.parallel import all_reduce, divide, get_tp_rank, get_tp_size
from vframe.quant import onednn_packed
from vframe.quant.base import QuantizationConfig

# FusedMoE.layout: how the experts' matrices are held (moe_experts' layout argument)
LAYOUT_STACKED = 0  # the stacked [E, out, in] parameters
LAYOUT_ONEDNN = 1  # each expert's matrices in oneDNN's packed layout
LAYOUT_BF16_PAIRS = 2  # each expert's matrices as cpu_ops.bf16_pairs

# (parameter name prefix, checkpoint name fragment, expert id, shard id)
ExpertParamsMapping = list[tuple[str, str, int, str]]


class FusedMoE(nn.Module):
    """num_experts experts of a SwiGLU MLP, run batched: tokens grouped by expert.

    Parameters (the experts' weights stacked, Hugging Face ``[out, in]`` each):
    ``w13_weight [E, 2I, H]`` (gate rows ``0..I-1``, then up rows ``I..2I-1``)
    and ``w2_weight [E, H, I]`` (down). Their ``weight_loader(param,
    loaded_weight, *, expert_id, shard_id)`` takes one expert's matrix with
    shard id ``"w1"`` (gate), ``"w3"`` (up) or ``"w2"`` (down).

    Under tensor parallelism every rank holds every expert, each with its
    ``I / tp_size`` share of the intermediate features (gate/up rows, down
    columns: the MLP's column/row split, expert by expert), and one all-reduce
    sums the ranks' outputs.

    After loading (in models that declare ``supports_packed_weights``, plugin API
    1.14) ``process_weights_after_loading`` replaces the stacked parameters by each
    expert's matrices packed (``w13_packed`` / ``w2_packed``, ``layout``;
    ``expert_weights()`` gives the plain form): in bfloat16 on a CPU with AVX512-BF16 as
    ``cpu_ops.bf16_pairs`` for vframe's ``bf16_gemm`` (``LAYOUT_BF16_PAIRS``), else where
    oneDNN multiplies the dtype natively in its packed layout (``LAYOUT_ONEDNN``,
    ``vframe/quant/onednn_packed.py``: the same products as ``torch.mm``, bit for bit,
    without reordering the weight on every call). Once bound (``bind_forward``) the layer
    is one C++ operator (``moe_experts``): sort, products, activation and sum. The tiny
    Mixtral of ``benchmarks/tiny_mixtral.py`` (8 experts, 512 x 1024, top 2), bfloat16,
    2 threads, one layer (``benchmarks/moe_layer.py``): stacked in Python -> bfloat16
    pairs bound, 1 token 0.38 -> 0.074 ms, 16 tokens 2.86 -> 0.89, 64 tokens 3.70 -> 2.05,
    1,024 tokens 20.5 -> 19.0 (oneDNN-packed in Python, the layer before: 0.28, 1.79,
    2.67, 20.0)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        *,
        params_dtype: torch.dtype,
        quant_config: QuantizationConfig | None = None,
        prefix: str = "",
    ) -> None:
        super().__init__()
        # None is how vframe spells "unquantized" (vframe/models/loader/load.py).
        if quant_config is not None:
            raise ConfigError(
                f"{prefix or 'FusedMoE'}: FusedMoE holds float experts; a quantized checkpoint's experts "
                f"(quantization={quant_config.get_name()!r}) are vframe.layers.quantized_moe.QuantizedExperts, "
                "which moe_experts() builds"
            )
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        # This rank's intermediate features per expert.
        self.intermediate_size = divide(
            intermediate_size, self.tp_size, f"{prefix or 'FusedMoE'}: intermediate size {intermediate_size}"
        )
        self.prefix = prefix
        self.w13_weight = nn.Parameter(
            torch.empty(num_experts, 2 * self.intermediate_size, hidden_size, dtype=params_dtype), requires_grad=False
        )  # [E, 2I, H]
        self.w2_weight = nn.Parameter(
            torch.empty(num_experts, hidden_size, self.intermediate_size, dtype=params_dtype), requires_grad=False
        )  # [E, H, I]
        self.w13_weight.weight_loader = self.weight_loader
        self.w2_weight.weight_loader = self.weight_loader
        # Each expert's matrices in a packed layout (LAYOUT_ONEDNN or LAYOUT_BF16_PAIRS), once
        # process_weights_after_loading has run; LAYOUT_STACKED: the stacked parameters.
        self.w13_packed: nn.ParameterList | None = None
        self.w2_packed: nn.ParameterList | None = None
        self.layout = LAYOUT_STACKED
        # Once bound (vframe/layers/binding.py): the experts as the C++ operator takes them.
        self._bound: BoundExperts | None = None

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, *, expert_id: int, shard_id: str
    ) -> None:
        """Place this rank's part of expert ``expert_id``'s checkpoint matrix of shard
        ``shard_id`` into ``param``."""
        inter = self.intermediate_size
        if shard_id == "w1":
            target = param.data[expert_id, :inter]
        elif shard_id == "w3":
            target = param.data[expert_id, inter:]
        elif shard_id == "w2":
            target = param.data[expert_id]
        else:
            raise ValueError(f"shard_id={shard_id!r}; expected 'w1' (gate), 'w3' (up) or 'w2' (down)")
        if param is not (self.w2_weight if shard_id == "w2" else self.w13_weight):
            raise ValueError(f"shard_id={shard_id!r} does not belong to this parameter")
        split_dim = 1 if shard_id == "w2" else 0  # down's input columns, gate/up's output rows
        if self.tp_size > 1 and loaded_weight.shape[split_dim] == inter * self.tp_size:
            loaded_weight = loaded_weight.narrow(split_dim, self.tp_rank * inter, inter)
        if target.shape != loaded_weight.shape:
            raise ModelLoadError(
                f"has shape {tuple(loaded_weight.shape)}, expert {expert_id} shard {shard_id} "
                f"expects {tuple(target.shape)}"
            )
        target.copy_(loaded_weight)

    def forward(
        self,
        hidden_states: torch.Tensor,  # [T, H]
        topk_weights: torch.Tensor,  # [T, K] float32
        topk_ids: torch.Tensor,  # [T, K] int64
    ) -> torch.Tensor:  # [T, H], in hidden_states' dtype
        """``sum_k topk_weights[t, k] * expert_{topk_ids[t, k]}(x_t)`` for every token ``t``."""
        bound = self._bound
        if bound is not None and bound.applies(hidden_states):
            # the steps below in one C++ call: the same operators on the same rows, bit for bit
            acc = bound.op(hidden_states, topk_weights.float().contiguous(), topk_ids.contiguous(), *bound.args)
            return all_reduce(acc, self.tp_size).to(hidden_states.dtype)
        routed = RoutedRows.of(hidden_states, topk_ids, self.num_experts)
        if self.w13_packed is not None:
            mm = _packed_mm if self.layout == LAYOUT_ONEDNN else _pairs_mm
            out = _grouped_swiglu(routed.x, self.w13_packed, self.w2_packed, routed.counts, mm, self.intermediate_size)
        else:
            out = _grouped_swiglu(routed.x, self.w13_weight, self.w2_weight, routed.counts, _mm, self.intermediate_size)
        return routed.combine(out, topk_weights, self.tp_size)  # out: [T*K, H]

    def process_weights_after_loading(self) -> None:
        """Each expert's gate/up and down matrices in a packed layout, in place of the stacked
        parameters (the memory is not doubled): bfloat16 pairs for ``cpu_ops.bf16_gemm`` where
        it runs (AVX512-BF16: 1.4x oneDNN's products at a decode step's 16 rows an expert,
        equal from 256), else oneDNN's layout where ``onednn_packed.packable``."""
        if self.w13_packed is not None:
            return
        w13, w2 = self.w13_weight.detach(), self.w2_weight.detach()
        if cpu_ops.bf16_pairable(w13[0]) and cpu_ops.bf16_pairable(w2[0]):
            layout, pack = LAYOUT_BF16_PAIRS, cpu_ops.bf16_pairs
        elif onednn_packed.packable(self.w13_weight):
            layout, pack = LAYOUT_ONEDNN, _onednn_pack
        else:
            return
        del self.w13_weight, self.w2_weight
        self.w13_packed = nn.ParameterList(nn.Parameter(pack(w.contiguous()), requires_grad=False) for w in w13)
        self.w2_packed = nn.ParameterList(nn.Parameter(pack(w.contiguous()), requires_grad=False) for w in w2)
        self.layout = layout

    def bind_forward(self, enabled: bool = True) -> None:
        """After loading: where the fused CPU operators run the weights' dtype, ``forward``
        hands the sort, the experts' products, their activation and the weighted sum to one
        C++ operator (``cpu_ops.cpp``'s ``moe_experts``), the experts' matrices listed once."""
        self._bound = None
        weight = self.w13_packed[0] if self.w13_packed is not None else self.w13_weight
        applies = cpu_ops.guard(weight.dtype) if enabled else None
        if applies is None or weight.device.type != "cpu":
            return
        packed = self.w13_packed is not None
        w13 = list(self.w13_packed) if packed else list(self.w13_weight.unbind(0))
        w2 = list(self.w2_packed) if packed else list(self.w2_weight.unbind(0))
        self._bound = BoundExperts(cpu_ops.operator("moe_experts"), (w13, w2, self.layout), applies)

    def expert_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The experts' weights in their stacked plain form, ``([E, 2I, H], [E, H, I])``,
        packed or not (a packed matrix's plain form is exact)."""
        if self.w13_packed is None:
            return self.w13_weight, self.w2_weight
        plain = onednn_packed.plain if self.layout == LAYOUT_ONEDNN else cpu_ops.bf16_unpairs
        return torch.stack([plain(w) for w in self.w13_packed]), torch.stack([plain(w) for w in self.w2_packed])

    def extra_repr(self) -> str:
        packed = {LAYOUT_ONEDNN: ", oneDNN-packed", LAYOUT_BF16_PAIRS: ", bfloat16 pairs"}.get(self.layout, "")
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}{packed}"


@dataclass(frozen=True)
class RoutedRows:
    """A step's (token, expert) pairs grouped by expert: ``x`` the token rows in that order
    (pairs sorted stably, so within an expert in token order), ``counts`` each expert's rows."""

    x: torch.Tensor  # [T*K, H]
    token_ids: torch.Tensor  # [T*K]: the token of each sorted pair
    order: torch.Tensor  # [T*K]: each sorted pair's index in topk_ids.reshape(-1)
    counts: torch.Tensor  # [E]

    @classmethod
    def of(cls, hidden_states: torch.Tensor, topk_ids: torch.Tensor, num_experts: int) -> RoutedRows:
        flat_ids = topk_ids.reshape(-1)  # [T*K]
        order = torch.argsort(flat_ids, stable=True)  # [T*K]
        token_ids = order // topk_ids.shape[1]
        return cls(hidden_states[token_ids], token_ids, order, torch.bincount(flat_ids, minlength=num_experts))

    def combine(self, out: torch.Tensor, topk_weights: torch.Tensor, tp_size: int) -> torch.Tensor:
        """Each pair's expert output ``out`` [T*K, H] times its router weight, summed per token in
        float32, reduced over tensor-parallel ranks once, in ``x``'s dtype: [T, H]."""
        num_tokens = topk_weights.shape[0]
        acc = cpu_ops.moe_combine(out, self.token_ids, topk_weights.reshape(-1)[self.order], num_tokens)
        return all_reduce(acc, tp_size).to(self.x.dtype)


@dataclass(frozen=True)
class BoundExperts:
    """A bound ``FusedMoE``'s operator and what follows ``(x, topk_weights, topk_ids)`` in
    its call: ``(w13 list, w2 list, layout)``; ``applies(x)``: whether ``x`` may take it.
    A decode plan calls the same operator from C++ (``vframe/backends/cpu_paged/plan.py``)."""

    op: torch._ops.OpOverload
    args: tuple[list[torch.Tensor], list[torch.Tensor], int]
    applies: Callable[[torch.Tensor], bool]


@dataclass(frozen=True)
class PlanMoe:
    """What a mixture-of-experts MLP hands a decode plan: its router linear (a bound layer),
    ``softmax_topk``'s ``top_k`` and ``renormalize``, and its bound experts."""

    router: Any
    top_k: int
    renormalize: bool
    experts: BoundExperts


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor:  # [out, in] -> oneDNN's packed [out, in]
    return torch.ops.mkldnn._reorder_linear_weight(weight)


def _mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:  # out = x weight^T
    torch.mm(x, weight.t(), out=out)


def _packed_mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:  # the same, weight packed
    out.copy_(onednn_packed.packed_linear(x, weight, None))


def _pairs_mm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor) -> None:  # the same, weight as bf16 pairs
    out.copy_(cpu_ops.bf16_gemm(x, weight))


def _grouped_swiglu(
    x: torch.Tensor,  # [S, H], rows grouped by expert
    w13: Sequence[torch.Tensor],  # E x [2I, H]: stacked, or packed one by one
    w2: Sequence[torch.Tensor],  # E x [H, I]
    counts: torch.Tensor,  # [E] rows of each expert
    mm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],  # mm(x, weight, out): out = x weight^T
    intermediate_size: int,  # I
) -> torch.Tensor:  # [S, H]
    """Each expert's SwiGLU MLP over its segment of rows: one matrix product per
    expert that has rows, the activation once over all rows. On CPU (torch 2.13)
    this is as fast as ``F.grouped_mm`` (same products, bit for bit) and does not
    visit the experts without rows; see ``benchmarks/moe_layer.py``."""
    starts = (counts.cumsum(0) - counts).tolist()
    segments = [(e, start, start + n) for e, (start, n) in enumerate(zip(starts, counts.tolist())) if n]
    gate_up = torch.empty(x.shape[0], 2 * intermediate_size, dtype=x.dtype, device=x.device)  # [S, 2I]
    for e, start, end in segments:
        mm(x[start:end], w13[e], gate_up[start:end])
    act = cpu_ops.silu_and_mul(gate_up)  # [S, I]
    out = torch.empty(x.shape[0], x.shape[1], dtype=x.dtype, device=x.device)  # [S, H]
    for e, start, end in segments:
        mm(act[start:end], w2[e], out[start:end])
    return out


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Mixtral / Qwen-MoE routing: softmax over experts in float32, then the
    ``top_k`` largest, optionally rescaled to sum to 1 per token.

    ``router_logits [T, E]`` -> ``(weights [T, K] float32, ids [T, K] int64)``."""
    probs = torch.softmax(router_logits.float(), dim=-1)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, K] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def expert_params_mapping(num_experts: int, gate: str, down: str, up: str) -> ExpertParamsMapping:
    """``(parameter name prefix, checkpoint name fragment, expert id, shard id)``
    for every expert's gate, up and down matrix, e.g.
    ``("experts.w13_weight", "experts.3.w1.", 3, "w1")``. Mixtral: ``gate="w1",
    down="w2", up="w3"``; DeepSeek and Qwen-MoE: ``"gate_proj", "down_proj", "up_proj"``."""
    return [
        (param, f"experts.{expert_id}.{name}.", expert_id, shard_id)
        for expert_id in range(num_experts)
        for param, name, shard_id in (
            ("experts.w13_weight", gate, "w1"),
            ("experts.w2_weight", down, "w2"),
            ("experts.w13_weight", up, "w3"),
        )
    ]


# "...experts.3.w1.weight": the module path before, the expert id, the projection.
_EXPERT_WEIGHT = re.compile(r"^(?P<parent>(?:.*\.)?)(?P<fragment>experts\.\d+\.[^.]+\.)weight$")


def match_expert_weight(name: str, mapping: ExpertParamsMapping) -> tuple[str, int, str] | None:
    """``(parameter name, expert id, shard id)`` of a per-expert checkpoint name,
    ``None`` for any other name::

        model.layers.0.block_sparse_moe.experts.3.w1.weight
        -> ("model.layers.0.block_sparse_moe.experts.w13_weight", 3, "w1")
    """
    return _match(name, {fragment: (param, e, s) for param, fragment, e, s in mapping})


def _match(name: str, by_fragment: dict[str, tuple[str, int, str]]) -> tuple[str, int, str] | None:
    # One regex and one dict lookup per name: a DeepSeek-V3 checkpoint has ~45,000
    # expert tensors and 768 (expert, shard) fragments per layer.
    found = _EXPERT_WEIGHT.match(name)
    if found is None or (target := by_fragment.get(found["fragment"])) is None:
        return None  # "shared_experts.0.x" does not match: the fragment starts a module name
    param, expert_id, shard_id = target
    return found["parent"] + param, expert_id, shard_id


class ExpertWeightLoader:
    """Places a checkpoint's expert tensors into a model's ``FusedMoE`` parameters,
    in either layout, and tracks which parameters have every (expert, shard):

    * per expert, as released checkpoints name them: ``...experts.3.w1.weight``
      (Mixtral) or ``...experts.3.gate_proj.weight`` (DeepSeek, Qwen-MoE);
    * stacked, as transformers >= 5 names them in memory: ``...experts.gate_up_proj``
      ``[E, 2I, H]`` (gate rows, then up rows) and ``...experts.down_proj`` ``[E, H, I]``.
    """

    def __init__(self, model: nn.Module, num_experts: int, gate: str, down: str, up: str) -> None:
        self.by_fragment = {f: (p, e, s) for p, f, e, s in expert_params_mapping(num_experts, gate, down, up)}
        self.params = dict(model.named_parameters())
        self.needed = {
            "w13_weight": {(e, s) for e in range(num_experts) for s in ("w1", "w3")},
            "w2_weight": {(e, "w2") for e in range(num_experts)},
        }
        self.seen: dict[str, set[tuple[int, str]]] = {}
        # A quantized checkpoint's experts (QuantizedExperts) are layers named as its tensors are:
        # each of its tensors goes to the parameter of the same name, through that layer's loader.
        self.quantized_projection = re.compile(rf"^(?:.*\.)?experts\.\d+\.(?:{gate}|{down}|{up})\.[^.]+$")
        self.quantized_loaded: set[str] = set()

    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Load ``name`` if it is an expert tensor; whether it was."""
        param = self.params.get(name)
        if param is not None and self.quantized_projection.match(name):
            param.weight_loader(param, tensor)
            self.quantized_loaded.add(name)
            return True
        match = _match(name, self.by_fragment)
        if match is not None:
            self._place(*match, tensor)
            return True
        parent, _, leaf = name.rpartition("experts.")
        if leaf == "gate_up_proj" and (not parent or parent.endswith(".")):
            for expert_id, (gate, up) in enumerate(t.chunk(2, dim=0) for t in tensor):  # [I, H] each
                self._place(f"{parent}experts.w13_weight", expert_id, "w1", gate)
                self._place(f"{parent}experts.w13_weight", expert_id, "w3", up)
            return True
        if leaf == "down_proj" and (not parent or parent.endswith(".")):
            for expert_id, down in enumerate(tensor):  # [H, I]
                self._place(f"{parent}experts.w2_weight", expert_id, "w2", down)
            return True
        return False

    def loaded(self) -> set[str]:
        """The expert parameters that have all their (expert, shard) tensors."""
        stacked = {name for name, seen in self.seen.items() if seen >= self.needed[name.rpartition(".")[2]]}
        return stacked | self.quantized_loaded

    def _place(self, param_name: str, expert_id: int, shard_id: str, tensor: torch.Tensor) -> None:
        param = self.params.get(param_name)
        if param is None:
            raise ModelLoadError(f"checkpoint expert tensor for {param_name!r} has no place in the model")
        try:
            param.weight_loader(param, tensor, expert_id=expert_id, shard_id=shard_id)
        except ModelLoadError as e:
            raise ModelLoadError(f"{param_name} (expert {expert_id}, {shard_id}) {e}") from None
        self.seen.setdefault(param_name, set()).add((expert_id, shard_id))
