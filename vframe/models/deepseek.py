"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) + a mixture of
experts with shared experts, as transformers' ``DeepseekV2ForCausalLM`` and
``DeepseekV3ForCausalLM`` compute them.

MLA compresses each token's keys and values into one latent ``c_kv`` of
``R = kv_lora_rank`` elements plus a rotated key ``k_pe`` of
``P = qk_rope_head_dim`` shared by every head; only those ``R + P`` are cached.
Per head ``h``, ``kv_b_proj`` expands the latent into the no-position key
(``W_UK[h]: [dn, R]``) and the value (``W_UV[h]: [dv, R]``). Instead of
expanding every cached token, the model absorbs them (``MLAAttentionImpl``)::

    q_nope[t, h] . (W_UK[h] c_kv[s])  =  (q_nope[t, h] W_UK[h]) . c_kv[s]     query [T, H, R + P]
    sum_s p[s] W_UV[h] c_kv[s]        =  W_UV[h] (sum_s p[s] c_kv[s])         backend out [T, H, R]

so the backend attends over the latents directly; ``W_UK`` and ``W_UV`` are
views into ``kv_b_proj``'s weight, read as a tensor: a float checkpoint's in place, a
quantized checkpoint's (DeepSeek-V3's own is block FP8) dequantized once, on the first
forward pass, by the layer's quant method, as vLLM does.

The versions differ in the rotary embedding (V2: float32, pairs ``(x[2i],
x[2i+1])``; V3: the activation dtype, pairs unless ``rope_interleave=false``)
and in routing (``vframe/layers/moe_routing.py``). Layers below
``first_k_dense_replace`` have a dense SwiGLU MLP, the others the experts.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vframe.core.interfaces import AttentionBackend
from vframe.core.kv_cache_spec import KVCacheSpec, MLAAttentionSpec
from vframe.errors import ModelLoadError
from vframe.layers.embedding import lm_head, token_embedding
from vframe.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from vframe.layers.moe import ExpertWeightLoader
from vframe.layers.quantized_moe import moe_experts
from vframe.layers.moe_routing import grouped_topk
from vframe.layers.rotary import rope_frequencies, rope_parameters, yarn_get_mscale
from vframe.models.llama import LlamaMLP, RMSNorm
from vframe.models.loader.weights import load_named_weights
from vframe.quant.base import QuantizationConfig, UnquantizedLinearMethod

ARCHITECTURES = ["DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"]

_STACKED_PARAMS = [("gate_up_proj", "gate_proj", 0), ("gate_up_proj", "up_proj", 1)]

# transformers builds q_a_layernorm and kv_a_layernorm with the RMSNorm default
# eps, not the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


def mla_softmax_scale(hf_config: Any) -> float:
    """``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times ``mscale ** 2`` under
    a scaled rope with ``mscale_all_dim`` (transformers' ``yarn_apply_mscale``)."""
    scale = (hf_config.qk_nope_head_dim + hf_config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(hf_config)
    if params["rope_type"] != "default" and params.get("mscale_all_dim"):
        scale *= yarn_get_mscale(params["factor"], params["mscale_all_dim"]) ** 2
    return scale


class DeepseekRotaryEmbedding(nn.Module):
    """Rotates the ``qk_rope_head_dim`` part of queries and keys.

    ``interleaved``: dimension pairs ``(x[2i], x[2i+1])`` (DeepSeek's layout),
    else halves ``(x[i], x[i + P/2])``. The output is the rotated halves side by
    side either way: a permutation of V2's layout that leaves every ``q . k``
    unchanged, and only this model reads the cached ``k_pe``."""

    def __init__(self, hf_config: Any, rope_dim: int, *, interleaved: bool, in_float32: bool) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_frequencies(hf_config, rope_dim)  # [P/2]
        positions = torch.arange(hf_config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, P/2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor  # [max_pos, P]
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)
        self.interleaved = interleaved
        self.in_float32 = in_float32

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        q_pe: torch.Tensor,  # [T, H, P]
        k_pe: torch.Tensor,  # [T, P]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = q_pe.dtype
        compute_dtype = torch.float32 if self.in_float32 else dtype
        cos, sin = self.cos_sin_cache[positions].to(compute_dtype)[:, None].chunk(2, dim=-1)  # [T, 1, P/2]
        x = torch.cat([q_pe, k_pe[:, None]], dim=1).to(compute_dtype)  # [T, H + 1, P]: one rotation for both
        x1, x2 = (x[..., 0::2], x[..., 1::2]) if self.interleaved else x.chunk(2, dim=-1)
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)
        return rotated[:, :-1], rotated[:, -1]


class DeepseekAttention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
    ) -> None:
        super().__init__()
        hidden = hf_config.hidden_size
        total_heads = hf_config.num_attention_heads
        self.qk_nope_head_dim = hf_config.qk_nope_head_dim
        self.qk_rope_head_dim = hf_config.qk_rope_head_dim
        self.v_head_dim = hf_config.v_head_dim
        self.kv_lora_rank = hf_config.kv_lora_rank
        self.q_lora_rank = hf_config.q_lora_rank
        qk_head_dim = self.qk_nope_head_dim + self.qk_rope_head_dim
        bias = getattr(hf_config, "attention_bias", False)
        linear = dict(quant_config=quant_config, params_dtype=dtype)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(
                hidden, total_heads * qk_head_dim, bias=False, prefix=f"{prefix}.q_proj", **linear
            )
        else:
            self.q_a_proj = ReplicatedLinear(hidden, self.q_lora_rank, bias=bias, prefix=f"{prefix}.q_a_proj", **linear)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, _LATENT_NORM_EPS, dtype)
            self.q_b_proj = ColumnParallelLinear(
                self.q_lora_rank, total_heads * qk_head_dim, bias=False, prefix=f"{prefix}.q_b_proj", **linear
            )
        self.kv_a_proj_with_mqa = ReplicatedLinear(
            hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias,
            prefix=f"{prefix}.kv_a_proj_with_mqa", **linear,
        )
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, _LATENT_NORM_EPS, dtype)
        # forward reads W_UK and W_UV out of its weight (kv_b_weight)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, total_heads * (self.qk_nope_head_dim + self.v_head_dim), bias=False,
            prefix=f"{prefix}.kv_b_proj", **linear,
        )
        self.kv_b_proj.needs_plain_weight = True  # absorbed into the query and output below, read as a tensor
        self._kv_b_dequantized: torch.Tensor | None = None
        self.num_heads = self.kv_b_proj.output_size_per_partition // (self.qk_nope_head_dim + self.v_head_dim)
        self.o_proj = RowParallelLinear(
            total_heads * self.v_head_dim, hidden, bias=bias, prefix=f"{prefix}.o_proj", **linear
        )
        self.attn = attn_backend.get_mla_impl_cls()(
            self.num_heads, self.kv_lora_rank, self.qk_rope_head_dim, mla_softmax_scale(hf_config)
        )

    def kv_b_weight(self) -> torch.Tensor:  # [H * (dn + dv), R] in the model's dtype
        """``kv_b_proj``'s weight as a tensor: its parameter when unquantized, else the quant
        method's dequantized weight, computed once (after loading, on the first call)."""
        method = self.kv_b_proj.quant_method
        if isinstance(method, UnquantizedLinearMethod):
            return self.kv_b_proj.weight
        if self._kv_b_dequantized is None:
            weight = method.dequantize_weight(self.kv_b_proj)
            self._kv_b_dequantized = weight.to(self.kv_b_proj.params_dtype)
        return self._kv_b_dequantized

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        positions: torch.Tensor,  # [T]
        rotary_emb: DeepseekRotaryEmbedding,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, E]
        num_tokens, heads = x.shape[0], self.num_heads
        nope, rope, rank = self.qk_nope_head_dim, self.qk_rope_head_dim, self.kv_lora_rank
        q = self.q_proj(x) if self.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_nope, q_pe = q.view(num_tokens, heads, nope + rope).split([nope, rope], dim=-1)  # [T, H, dn], [T, H, P]
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([rank, rope], dim=-1)  # [T, R], [T, P]
        c_kv = self.kv_a_layernorm(c_kv)
        q_pe, k_pe = rotary_emb(positions, q_pe, k_pe)

        w_kv = self.kv_b_weight().view(heads, nope + self.v_head_dim, rank)
        w_uk, w_uv = w_kv.split([nope, self.v_head_dim], dim=1)  # [H, dn, R], [H, dv, R]
        query = torch.cat([torch.einsum("thd,hdr->thr", q_nope, w_uk), q_pe], dim=-1)  # [T, H, R + P]
        latent = torch.cat([c_kv, k_pe], dim=-1)  # [T, R + P]: what the cache keeps
        out = self.attn.forward(query, latent, kv_cache, attn_metadata)  # [T, H, R]
        out = torch.einsum("thr,hvr->thv", out, w_uv)  # [T, H, dv]
        return self.o_proj(out.reshape(num_tokens, heads * self.v_head_dim))


@dataclass(frozen=True)
class Routing:
    """How a DeepSeek MoE layer picks experts: ``grouped_topk``'s settings."""

    top_k: int
    scoring_func: str
    num_expert_group: int | None
    topk_group: int | None
    renormalize: bool
    routed_scaling_factor: float

    @classmethod
    def v2(cls, hf_config: Any) -> Routing:
        method = hf_config.topk_method
        if method not in ("greedy", "group_limited_greedy"):
            raise ModelLoadError(
                f"topk_method={method!r} is not a DeepSeek-V2 routing; expected 'greedy' or 'group_limited_greedy'"
            )
        grouped = method == "group_limited_greedy"
        # transformers' DeepseekV2TopkRouter ignores norm_topk_prob (false in every V2 release).
        return cls(
            hf_config.num_experts_per_tok, "softmax", hf_config.n_group if grouped else None,
            hf_config.topk_group if grouped else None, False, hf_config.routed_scaling_factor,
        )

    @classmethod
    def v3(cls, hf_config: Any) -> Routing:
        return cls(
            hf_config.num_experts_per_tok, "sigmoid", hf_config.n_group, hf_config.topk_group,
            bool(hf_config.norm_topk_prob), hf_config.routed_scaling_factor,
        )

    def check(self, num_experts: int) -> None:
        if self.num_expert_group is None:
            return
        if num_experts % self.num_expert_group:
            raise ModelLoadError(f"n_group={self.num_expert_group} does not divide n_routed_experts={num_experts}")
        per_group = num_experts // self.num_expert_group
        if self.topk_group is None or self.topk_group * per_group < self.top_k:
            raise ModelLoadError(
                f"topk_group={self.topk_group} groups of {per_group} experts hold fewer than "
                f"num_experts_per_tok={self.top_k}; raise topk_group"
            )


class DeepseekGate(nn.Module):
    """The router: ``weight [num_experts, E]`` and, for V3, the float32
    ``e_score_correction_bias [num_experts]`` that steers the choice only."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype, *, with_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        bias = nn.Parameter(torch.empty(num_experts), requires_grad=False) if with_bias else None
        self.register_parameter("e_score_correction_bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, num_experts] float32
        return F.linear(x.float(), self.weight.float())  # in float32, as transformers


class DeepseekMoE(nn.Module):
    """Routed experts plus ``n_shared_experts`` always-on ones (one wider SwiGLU MLP)."""

    def __init__(
        self, hf_config: Any, routing: Routing, dtype: torch.dtype, quant_config: QuantizationConfig | None, prefix: str
    ) -> None:
        super().__init__()
        num_experts, hidden = hf_config.n_routed_experts, hf_config.hidden_size
        routing.check(num_experts)
        self.routing = routing
        self.gate = DeepseekGate(num_experts, hidden, dtype, with_bias=routing.scoring_func == "sigmoid")
        self.experts = moe_experts(
            num_experts, hidden, hf_config.moe_intermediate_size,
            params_dtype=dtype, quant_config=quant_config, prefix=f"{prefix}.experts",
        )
        shared_size = hf_config.moe_intermediate_size * (hf_config.n_shared_experts or 0)
        self.shared_experts = (
            LlamaMLP(hf_config, dtype, quant_config, f"{prefix}.shared_experts", shared_size) if shared_size else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        r = self.routing
        weights, ids = grouped_topk(
            self.gate(x), r.top_k, scoring_func=r.scoring_func, num_expert_group=r.num_expert_group,
            topk_group=r.topk_group, e_score_correction_bias=self.gate.e_score_correction_bias,
            renormalize=r.renormalize, routed_scaling_factor=r.routed_scaling_factor,
        )  # [T, K] each
        out = self.experts(x, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts(x)


class DeepseekDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        routing: Routing,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        layer_idx: int,
    ) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_idx}"
        eps, hidden = hf_config.rms_norm_eps, hf_config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps, dtype)
        self.self_attn = DeepseekAttention(hf_config, attn_backend, dtype, quant_config, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype)
        if layer_idx >= (hf_config.first_k_dense_replace or 0):
            self.mlp: nn.Module = DeepseekMoE(hf_config, routing, dtype, quant_config, f"{prefix}.mlp")
        else:
            self.mlp = LlamaMLP(hf_config, dtype, quant_config, f"{prefix}.mlp")

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        positions: torch.Tensor,
        rotary_emb: DeepseekRotaryEmbedding,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, E]
        h = x + self.self_attn(self.input_layernorm(x), positions, rotary_emb, kv_cache, attn_metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekModel(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        routing: Routing,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
    ) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(hf_config.vocab_size, hf_config.hidden_size, params_dtype=dtype,
                                            quant_config=quant_config, prefix="model.embed_tokens")
        self.layers = nn.ModuleList(
            DeepseekDecoderLayer(hf_config, routing, attn_backend, dtype, quant_config, i)
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        rotary_emb: DeepseekRotaryEmbedding,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, E]
        x = self.embed_tokens(input_ids)  # [T, E]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, rotary_emb, kv_cache, attn_metadata)
        return self.norm(x)


class DeepseekV2ForCausalLM(nn.Module):
    supports_packed_weights = True  # kv_b_proj, read as a tensor, is marked needs_plain_weight
    # Heads, MLP columns, experts' intermediate features and vocabulary split by rank;
    # every rank caches the whole latent (it is not per head).
    supports_tensor_parallel = True

    def __init__(
        self,
        hf_config: Any,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None = None,
    ) -> None:
        super().__init__()
        self.config = hf_config
        self.dtype = dtype
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = DeepseekModel(hf_config, self._routing(hf_config), attn_backend, dtype, quant_config)
        self.lm_head = lm_head(
            hf_config.hidden_size, hf_config.vocab_size, params_dtype=dtype,
            embedding=self.model.embed_tokens, tied=self.tie_word_embeddings, quant_config=quant_config,
        )
        self.rotary_emb = self._rotary_embedding(hf_config)

    @staticmethod
    def _routing(hf_config: Any) -> Routing:
        return Routing.v2(hf_config)

    @staticmethod
    def _rotary_embedding(hf_config: Any) -> DeepseekRotaryEmbedding:
        # transformers' V2 rotates in complex float32 (torch.polar), always on pairs.
        return DeepseekRotaryEmbedding(hf_config, hf_config.qk_rope_head_dim, interleaved=True, in_float32=True)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        kv_caches: list[torch.Tensor],  # one per layer
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, E]
        return self.model(input_ids, positions, self.rotary_emb, kv_caches, attn_metadata)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:  # [N, E] -> [N, V] float32
        return self.lm_head(hidden_states).float()

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        spec = MLAAttentionSpec(block_size, dtype, self.config.kv_lora_rank, self.config.qk_rope_head_dim)
        return [spec] * len(self.model.layers)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the names of the parameters now
        fully loaded. Experts come one matrix each (``experts.3.gate_proj.weight``)
        or stacked as transformers holds them (``experts.gate_up_proj``,
        ``experts.down_proj``). A V3 multi-token-prediction layer
        (``model.layers.{num_hidden_layers}...``) is not used and skipped."""
        experts = ExpertWeightLoader(self, self.config.n_routed_experts, "gate_proj", "down_proj", "up_proj")
        rest = (
            (name, tensor)
            for name, tensor in weights
            if "rotary_emb.inv_freq" not in name
            and not (name == "lm_head.weight" and self.tie_word_embeddings)
            and not self._is_next_token_layer(name)
            and not experts.load(name, tensor)
        )
        return load_named_weights(self, rest, _STACKED_PARAMS) | experts.loaded()

    def _is_next_token_layer(self, name: str) -> bool:
        parts = name.split(".", 3)
        if parts[:2] != ["model", "layers"] or len(parts) < 3 or not parts[2].isdigit():
            return False
        first = self.config.num_hidden_layers
        return first <= int(parts[2]) < first + (getattr(self.config, "num_nextn_predict_layers", 0) or 0)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    @staticmethod
    def _routing(hf_config: Any) -> Routing:
        return Routing.v3(hf_config)

    @staticmethod
    def _rotary_embedding(hf_config: Any) -> DeepseekRotaryEmbedding:
        interleaved = getattr(hf_config, "rope_interleave", True)
        return DeepseekRotaryEmbedding(hf_config, hf_config.qk_rope_head_dim, interleaved=interleaved, in_float32=False)
