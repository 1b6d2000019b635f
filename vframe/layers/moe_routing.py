"""DeepSeek's expert routing: top-k over experts, optionally limited to the best groups.

With ``num_expert_group`` set, the experts are split into that many equal,
contiguous groups; each token keeps only its ``topk_group`` best groups and
takes its ``top_k`` experts from those::

    scores [T, E=8], 4 groups   ->  group scores [T, 4]  ->  best 2 groups  ->  top-k among 4 experts
    | e0 e1 | e2 e3 | e4 e5 | e6 e7 |       g0 g1 g2 g3         g1, g3             e2 e3 e6 e7

DeepSeek-V2 (``scoring_func="softmax"``): the scores are the softmax of the
router logits; a group scores its best expert (``topk_method="group_limited_greedy"``;
``"greedy"`` has no groups). DeepSeek-V3 (``"sigmoid"``): the scores are
sigmoids, the per-expert ``e_score_correction_bias`` is added for choosing only
(the weights stay the unbiased scores), and a group scores the sum of its best
two. Both then optionally renormalize the chosen weights to sum to 1 and
multiply them by ``routed_scaling_factor``. Everything is float32, as in
transformers' ``DeepseekV2TopkRouter`` / ``DeepseekV3TopkRouter``.

``softmax_topk`` (Mixtral, Qwen-MoE) is in ``vframe/layers/moe.py``.
"""

from __future__ import annotations

from typing import Literal

import torch


def grouped_topk(
    router_logits: torch.Tensor,  # [T, E]
    top_k: int,
    *,
    scoring_func: Literal["softmax", "sigmoid"],
    num_expert_group: int | None = None,
    topk_group: int | None = None,
    e_score_correction_bias: torch.Tensor | None = None,  # [E]
    renormalize: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:  # weights [T, K] float32, ids [T, K] int64
    """The experts each token runs and their weights; see the module docstring."""
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)  # [T, E]
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()  # [T, E]
    else:
        raise ValueError(f"scoring_func={scoring_func!r}; expected 'softmax' or 'sigmoid'")
    choice = scores if e_score_correction_bias is None else scores + e_score_correction_bias.float()

    if num_expert_group is not None and topk_group is not None:
        num_tokens, num_experts = choice.shape
        grouped = choice.view(num_tokens, num_expert_group, num_experts // num_expert_group)  # [T, G, E/G]
        if scoring_func == "softmax":
            group_scores = grouped.max(dim=-1).values  # [T, G]
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        group_ids = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)  # [T, G]
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)  # [T, E]
        choice = choice.masked_fill(~expert_mask, float("-inf"))

    ids = choice.topk(top_k, dim=-1, sorted=False).indices  # [T, K]
    weights = scores.gather(1, ids)  # [T, K]
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
