"""Llama (and Mistral, SmolLM2): a decoder of pre-norm attention + SwiGLU layers.

Every token of a step is flattened into one dimension ``T``; attention over the
paged KV cache is the backend's job. The projections are vframe's linear layers
(``vframe/layers/linear.py``): q/k/v and gate/up fused into single matmuls,
each weight created and applied by the quantization method of the run
(unquantized: plain ``F.linear``). ``load_weights`` maps the Hugging Face names
onto (fused parameter, shard id) and lets the parameters' loaders place them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from vframe.core.interfaces import AttentionBackend
from vframe.core.kv_cache_spec import KVCacheSpec, full_attention_specs
from vframe.layers import cpu_ops
from vframe.layers.embedding import lm_head, token_embedding
from vframe.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vframe.layers.rotary import rope_frequencies
from vframe.models.loader.weights import load_named_weights
from vframe.quant.base import QuantizationConfig

ARCHITECTURES = ["LlamaForCausalLM", "MistralForCausalLM"]

# (our fused projection, Hugging Face projection, shard id)
_STACKED_PARAMS = [
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
]


def get_head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


# --------------------------------------------------------------------------- #
# Rotary position embedding
# --------------------------------------------------------------------------- #


class RotaryEmbedding(nn.Module):
    """Neox-style rotation (rotate_half), as Hugging Face Llama applies it."""

    _bound: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None  # bind_forward's

    def __init__(self, hf_config: Any, head_dim: int) -> None:
        super().__init__()
        inv_freq, attention_factor = rope_frequencies(hf_config, head_dim)  # [D/2]
        positions = torch.arange(hf_config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)  # [max_pos, D/2]
        cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor  # [max_pos, D]
        self.register_buffer("cos_sin_cache", cos_sin, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [T]
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        bound = self._bound
        if bound is not None:
            return bound(positions, query, key)
        if cpu_ops.applies(query) and positions.dtype == torch.int64:  # one fused operator, bit-exact
            cpu_ops.rotary_neox_(positions, query, key, self.cos_sin_cache)
            return query, key
        return self._reference(positions, query, key)

    def bind_forward(self, enabled: bool = True) -> None:
        """After loading (``vframe.layers.binding``): the fused operator and the table looked
        up once; ``enabled=False``: looked up on every call again."""
        self._bound = None
        if not (enabled and self.cos_sin_cache.is_cpu and cpu_ops.available()):  # the operators are the CPU's
            return
        op, cos_sin, applies = cpu_ops.operator("rotary_neox_"), self.cos_sin_cache, cpu_ops.applies
        reference = self._reference

        def rotate(
            positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
        ) -> tuple[torch.Tensor, torch.Tensor]:
            if applies(query) and positions.dtype == torch.int64:
                op(positions, query, key, cos_sin)
                return query, key
            return reference(positions, query, key)

        self._bound = rotate

    def _reference(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # In the activation dtype, as transformers does: no float32 round trip.
        cos, sin = self.cos_sin_cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)  # [T, 1, D/2]
        num_heads = query.shape[1]
        qk = torch.cat([query, key], dim=1)  # [T, H + KVH, D]: one rotation for both
        x1, x2 = qk.chunk(2, dim=-1)  # [T, H + KVH, D/2] each
        rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        return rotated[:, :num_heads], rotated[:, num_heads:]


# --------------------------------------------------------------------------- #
# Layers
# --------------------------------------------------------------------------- #


class RMSNorm(nn.Module):
    _bound: Callable[[torch.Tensor], torch.Tensor] | None = None  # bind_forward's

    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bound = self._bound
        if bound is not None:
            return bound(x)
        if x.dim() == 2 and x.dtype == self.weight.dtype and cpu_ops.applies(x):
            return cpu_ops.rms_norm(x, self.weight, self.eps)  # the same expression, fused
        return self._reference(x)

    def bind_forward(self, enabled: bool = True) -> None:
        """After loading (``vframe.layers.binding``): the fused operator, the weight and what
        ``cpu_ops.applies`` asks of the weight's dtype looked up once; ``enabled=False``:
        on every call again."""
        self._bound = None
        fused = cpu_ops.guard(self.weight.dtype) if enabled and self.weight.is_cpu else None
        if fused is None:
            return
        op, weight, eps, reference = cpu_ops.operator("rms_norm"), self.weight, self.eps, self._reference

        def norm(x: torch.Tensor) -> torch.Tensor:
            return op(x, weight, eps) if x.dim() == 2 and fused(x) else reference(x)

        self._bound = norm

    def _reference(self, x: torch.Tensor) -> torch.Tensor:
        # transformers' order: normalize in float32, cast back, then scale. Written
        # out because F.rms_norm is ~3x slower on CPU in bfloat16.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class LlamaAttention(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
        layer_idx: int = 0,
    ) -> None:
        super().__init__()
        hidden_size = hf_config.hidden_size
        self.head_dim = get_head_dim(hf_config)
        qkv_bias, o_proj_bias = self.projection_biases(hf_config)
        self.qkv_proj = QKVParallelLinear(
            hidden_size,
            self.head_dim,
            hf_config.num_attention_heads,
            getattr(hf_config, "num_key_value_heads", None),
            bias=qkv_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
            params_dtype=dtype,
        )
        # This rank's heads (tensor parallelism splits them by rank).
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(
            hf_config.num_attention_heads * self.head_dim,
            hidden_size,
            bias=o_proj_bias,
            quant_config=quant_config,
            prefix=f"{prefix}.o_proj",
            params_dtype=dtype,
        )
        self.sliding_window = self.layer_sliding_window(hf_config, layer_idx)
        self.attn = attn_backend.get_impl_cls()(
            self.num_heads,
            self.head_dim,
            self.head_dim**-0.5,
            self.num_kv_heads,
            sliding_window=self.sliding_window,
        )

    # What models built on this attention change (vframe/models/qwen.py):

    @staticmethod
    def projection_biases(hf_config: Any) -> tuple[bool, bool]:
        """Whether the q/k/v projection and the o projection have a bias."""
        bias = getattr(hf_config, "attention_bias", False)
        return bias, bias

    @staticmethod
    def layer_sliding_window(hf_config: Any, layer_idx: int) -> int | None:
        """The window layer ``layer_idx`` attends over; None: every earlier token."""
        return getattr(hf_config, "sliding_window", None)

    def norm_qk(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Normalize q [T, H, D] and k [T, KVH, D] before rope: Llama does not."""
        return q, k

    def kv_cache_spec(self, block_size: int, dtype: torch.dtype) -> KVCacheSpec:
        (spec,) = full_attention_specs(1, self.num_kv_heads, self.head_dim, block_size, dtype, self.sliding_window)
        return spec

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        positions: torch.Tensor,  # [T]
        rotary_emb: RotaryEmbedding,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, E]
        num_tokens = x.shape[0]
        sizes = [self.num_heads, self.num_kv_heads, self.num_kv_heads]
        heads = self.qkv_proj(x).view(num_tokens, sum(sizes), self.head_dim)  # [T, H + 2 KVH, D]
        # [T, H, D], [T, KVH, D], [T, KVH, D]: one split of the heads (half the dispatch of
        # a split of the flat rows and three views)
        q, k, v = heads.split(sizes, dim=1)
        q, k = rotary_emb(positions, *self.norm_qk(q, k))
        out = self.attn.forward(q, k, v, kv_cache, attn_metadata)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
        intermediate_size: int | None = None,  # default: the config's (MoE models' shared experts differ)
    ) -> None:
        super().__init__()
        hidden, inter = hf_config.hidden_size, intermediate_size or hf_config.intermediate_size
        bias = getattr(hf_config, "mlp_bias", False)
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden,
            [inter, inter],
            bias=bias,
            quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj",
            params_dtype=dtype,
        )
        self.down_proj = RowParallelLinear(
            inter, hidden, bias=bias, quant_config=quant_config, prefix=f"{prefix}.down_proj", params_dtype=dtype
        )

    _fused: tuple[nn.Module, torch.Tensor] | None = None  # (gate_up_proj, its pairs) once bound

    def bind_forward(self, enabled: bool = True) -> None:
        """Bound (vframe/layers/binding.py), bfloat16 rows take the gate/up product and SwiGLU
        as one operator (``cpu_ops.bf16_gemm_silu``, bit for bit the two) where the gate/up
        weight is held as pairs; anything else, a LoRA-wrapped layer included, the two calls."""
        gate_up = self.gate_up_proj
        pairs = gate_up.silu_pairs() if enabled and isinstance(gate_up, MergedColumnParallelLinear) else None
        self._fused = None if pairs is None else (gate_up, pairs)

    def fused_pairs(self) -> torch.Tensor | None:
        """The gate/up pairs that ``bf16_gemm_silu`` takes for this MLP once bound; None where
        it makes the two calls (unbound, or its gate/up layer swapped since binding: LoRA)."""
        fused = self._fused
        return fused[1] if fused is not None and fused[0] is self.gate_up_proj else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, E] -> [T, E]
        pairs = self.fused_pairs()
        if pairs is not None and x.dim() == 2 and cpu_ops.bf16_gemm_takes(x):
            return self.down_proj(cpu_ops.bf16_gemm_silu(x, pairs))  # [T, I] -> [T, E]
        return self.down_proj(cpu_ops.silu_and_mul(self.gate_up_proj(x)))  # [T, 2I] -> [T, I] -> [T, E]


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self,
        hf_config: Any,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str,
        layer_idx: int = 0,
        attention_cls: type[LlamaAttention] = LlamaAttention,
        mlp_cls: type[nn.Module] = LlamaMLP,  # built as mlp_cls(hf_config, dtype, quant_config, prefix)
    ) -> None:
        super().__init__()
        eps = hf_config.rms_norm_eps
        self.input_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.self_attn = attention_cls(hf_config, attn_backend, dtype, quant_config, f"{prefix}.self_attn", layer_idx)
        self.post_attention_layernorm = RMSNorm(hf_config.hidden_size, eps, dtype)
        self.mlp = mlp_cls(hf_config, dtype, quant_config, f"{prefix}.mlp")

    def forward(
        self,
        x: torch.Tensor,  # [T, E]
        positions: torch.Tensor,
        rotary_emb: RotaryEmbedding,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, E]
        h = x + self.self_attn(self.input_layernorm(x), positions, rotary_emb, kv_cache, attn_metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    decode_plan: Any = None  # a DecodePlan once bound, where every layer can run in it (LlamaForCausalLM.bind_forward)

    def __init__(
        self,
        hf_config: Any,
        attn_backend: type[AttentionBackend],
        dtype: torch.dtype,
        quant_config: QuantizationConfig | None,
        prefix: str = "model",
        attention_cls: type[LlamaAttention] = LlamaAttention,
        mlp_cls: type[nn.Module] = LlamaMLP,
    ) -> None:
        super().__init__()
        self.embed_tokens = token_embedding(hf_config.vocab_size, hf_config.hidden_size, params_dtype=dtype,
                                            quant_config=quant_config, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                hf_config, attn_backend, dtype, quant_config, f"{prefix}.layers.{i}", i, attention_cls, mlp_cls
            )
            for i in range(hf_config.num_hidden_layers)
        )
        self.norm = RMSNorm(hf_config.hidden_size, hf_config.rms_norm_eps, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        rotary_emb: RotaryEmbedding,
        kv_caches: list[torch.Tensor],
        attn_metadata: Any,
    ) -> torch.Tensor:  # [T, E]
        x = self.embed_tokens(input_ids)  # [T, E]
        plan = self.decode_plan
        if plan is not None and (out := plan.run(x, positions, kv_caches, attn_metadata)) is not None:
            return self.norm(out)  # every layer in C++, a decode step (vframe/backends/cpu_paged/plan.py)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, positions, rotary_emb, kv_cache, attn_metadata)
        return self.norm(x)

    def plan_layers(self, rotary_emb: RotaryEmbedding) -> list[Any] | None:
        """The layers as a decode plan takes them, once bound; None where a layer is not
        exactly this file's (bound) decoder layer: a subclass that normalizes q / k, a
        rotary of its own, an unbound part. A mixture-of-experts MLP takes part where it
        says how (its ``plan_moe()``: Mixtral's block)."""
        from vframe.backends.cpu_paged.plan import PlanLayer

        if type(rotary_emb).forward is not RotaryEmbedding.forward or rotary_emb._bound is None:
            return None
        layers = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            moe = mlp.plan_moe() if type(mlp).forward is not LlamaMLP.forward and hasattr(mlp, "plan_moe") else None
            if (
                type(layer).forward is not LlamaDecoderLayer.forward
                or type(attn).forward is not LlamaAttention.forward
                or type(attn).norm_qk is not LlamaAttention.norm_qk
                or (type(mlp).forward is not LlamaMLP.forward and moe is None)
                or any(type(n).forward is not RMSNorm.forward or n._bound is None for n in norms)
                or any(n.eps != self.layers[0].input_layernorm.eps for n in norms)  # the plan has one eps
            ):
                return None
            mlp_linears = () if moe is not None else (mlp.gate_up_proj, mlp.down_proj)
            silu_pairs = mlp.fused_pairs() if moe is None else None  # the plan calls bf16_gemm_silu where the MLP does
            layers.append(
                PlanLayer(norms[0].weight.detach(), norms[1].weight.detach(), (attn.qkv_proj, attn.o_proj, *mlp_linears),
                          attn.attn, moe, silu_pairs)
            )
        return layers


class LlamaForCausalLM(nn.Module):
    # Checkpoint modules fused into one of ours (what LoRA adapters target by name).
    packed_modules_mapping: dict[str, list[str]] = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    attention_cls: type[LlamaAttention] = LlamaAttention  # what a subclass swaps (vframe/models/qwen.py)
    mlp_cls: type[nn.Module] = LlamaMLP  # MixtralSparseMoeBlock in vframe/models/mixtral.py
    supports_packed_weights = True  # no linear weight is read as a tensor (vframe/quant/onednn_packed.py)
    supports_tensor_parallel = True  # heads, MLP columns and vocabulary split by rank (DESIGN.md §9)
    supports_cuda_graphs = True  # a decode step's forward has no host sync (vframe/core/worker/cuda_graphs.py)

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
        # Parameters start uninitialised (torch.empty; load_weights fills every one):
        # random init of a multi-billion-parameter model would cost minutes.
        self.model = LlamaModel(
            hf_config, attn_backend, dtype, quant_config, attention_cls=self.attention_cls, mlp_cls=self.mlp_cls
        )
        self.lm_head = lm_head(
            hf_config.hidden_size, hf_config.vocab_size, params_dtype=dtype,
            embedding=self.model.embed_tokens, tied=self.tie_word_embeddings, quant_config=quant_config,
        )  # fmt: skip
        self.rotary_emb = RotaryEmbedding(hf_config, get_head_dim(hf_config))

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

    def bind_forward(self, enabled: bool = True) -> None:
        """After every layer is bound (``vframe.layers.binding`` binds children first): the
        decode plan of ``vframe/backends/cpu_paged/plan.py`` where every layer can run in it."""
        self.model.decode_plan = None
        layers = self.model.plan_layers(self.rotary_emb) if enabled else None
        if layers is None:
            return
        from vframe.backends.cpu_paged.plan import DecodePlan

        attn = self.model.layers[0].self_attn
        self.model.decode_plan = DecodePlan.build(
            layers, num_heads=attn.num_heads, num_kv_heads=attn.num_kv_heads, head_dim=attn.head_dim,
            eps=self.model.layers[0].input_layernorm.eps, cos_sin_cache=self.rotary_emb.cos_sin_cache, dtype=self.dtype,
            modules=[*self.model.layers.modules(), self.rotary_emb],
        )  # fmt: skip

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        return [layer.self_attn.kv_cache_spec(block_size, dtype) for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors; returns the names of the parameters now
        fully loaded (a fused one once every shard has arrived)."""
        weights = (
            (name, tensor)
            for name, tensor in weights
            if "rotary_emb.inv_freq" not in name and not (name == "lm_head.weight" and self.tie_word_embeddings)
        )
        return load_named_weights(self, weights, _STACKED_PARAMS)
