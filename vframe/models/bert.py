"""BERT: an encoder of post-norm bidirectional attention + GELU layers (all-MiniLM-L6-v2).

An encoder-only model runs under the pooling runner (``runner="pooling"``) and
never decodes, so it keeps no KV cache (``uses_kv_cache = False``): each prompt
is encoded in one forward pass, every token attending to every token of its own
prompt with plain SDPA. The runner hands ``forward`` the step's
``CommonAttentionMetadata`` (``query_start_loc`` separates the prompts) in place
of a backend's metadata, and no caches. Parameter names follow the Hugging Face
checkpoint (``encoder.layer.N.attention.self.query`` ...), with q/k/v fused.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vframe.core.interfaces import AttentionBackend, CommonAttentionMetadata
from vframe.errors import ModelLoadError
from vframe.layers.linear import QKVParallelLinear, ReplicatedLinear
from vframe.models.loader.weights import load_named_weights

ARCHITECTURES = ["BertModel"]

# (our fused projection, Hugging Face projection, shard id)
_STACKED_PARAMS = [("qkv_proj", "query", "q"), ("qkv_proj", "key", "k"), ("qkv_proj", "value", "v")]
# Checkpoint tensors BERT embedding models do not use: the [CLS] classifier
# ("pooler", not the sentence pooler) and a buffer of 0..max_pos-1.
_UNUSED_WEIGHTS = ("pooler.", "embeddings.position_ids")
_ACTIVATIONS = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}


def _linear(in_features: int, out_features: int, prefix: str, dtype: torch.dtype) -> ReplicatedLinear:
    return ReplicatedLinear(in_features, out_features, bias=True, prefix=prefix, params_dtype=dtype)


class BertEmbeddings(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size, dtype=dtype)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size, dtype=dtype)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps, dtype=dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # [T] -> [T, E]
        # One segment per prompt: every token has token type 0.
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings.weight[0]
        return self.LayerNorm(x)


class BertSelfAttention(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, self.head_dim, self.num_heads, bias=True, prefix=f"{prefix}.qkv_proj",
            params_dtype=dtype,
        )

    def forward(self, x: torch.Tensor, seq_lens: list[int], valid: torch.Tensor) -> torch.Tensor:  # [T, E]
        """``valid``: ``[B, L]`` bool, which of the padded positions hold tokens."""
        q, k, v = self.qkv_proj(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)  # [T, H, D] each

        def pad(t: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, L, D]
            return nn.utils.rnn.pad_sequence(t.split(seq_lens), batch_first=True).transpose(1, 2)

        # Each query sees the real keys of its own prompt.
        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=valid[:, None, None, :])
        return out.transpose(1, 2)[valid].reshape(x.shape)  # [B, L, H, D] -> [T, E]


class BertLayer(nn.Module):
    def __init__(self, config: Any, dtype: torch.dtype, prefix: str) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        self.attention = nn.Module()
        self.attention.self = BertSelfAttention(config, dtype, f"{prefix}.attention.self")
        self.attention.output = nn.Module()
        self.attention.output.dense = _linear(hidden, hidden, f"{prefix}.attention.output.dense", dtype)
        self.attention.output.LayerNorm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.intermediate = nn.Module()
        self.intermediate.dense = _linear(hidden, config.intermediate_size, f"{prefix}.intermediate.dense", dtype)
        self.output = nn.Module()
        self.output.dense = _linear(config.intermediate_size, hidden, f"{prefix}.output.dense", dtype)
        self.output.LayerNorm = nn.LayerNorm(hidden, eps=eps, dtype=dtype)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, seq_lens: list[int], valid: torch.Tensor) -> torch.Tensor:  # [T, E]
        attn = self.attention
        x = attn.output.LayerNorm(x + attn.output.dense(attn.self(x, seq_lens, valid)))
        return self.output.LayerNorm(x + self.output.dense(self.act(self.intermediate.dense(x))))


class BertModel(nn.Module):
    """The encoder; its output, one row per token, is what the pooler reduces."""

    uses_kv_cache = False
    # vLLM's default for BERT embedding models; a checkpoint's sentence-transformers
    # Pooling config (1_Pooling/config.json) takes precedence (vframe/layers/pooler.py).
    default_pooling_type = "CLS"

    def __init__(self, hf_config: Any, attn_backend: type[AttentionBackend], dtype: torch.dtype) -> None:
        super().__init__()
        if hf_config.hidden_act not in _ACTIVATIONS:
            raise ModelLoadError(
                f"BertModel: hidden_act={hf_config.hidden_act!r} is not supported; use one of {sorted(_ACTIVATIONS)}"
            )
        if getattr(hf_config, "position_embedding_type", "absolute") != "absolute":
            raise ModelLoadError(
                f"BertModel: position_embedding_type={hf_config.position_embedding_type!r} is not supported; "
                "only 'absolute'"
            )
        self.config = hf_config
        self.dtype = dtype
        self.embeddings = BertEmbeddings(hf_config, dtype)
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(
            BertLayer(hf_config, dtype, f"encoder.layer.{i}") for i in range(hf_config.num_hidden_layers)
        )

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64, 0.. within each prompt
        kv_caches: list[torch.Tensor],  # unused: nothing is cached
        attn_metadata: CommonAttentionMetadata,
    ) -> torch.Tensor:  # [T, E]
        qsl = attn_metadata.query_start_loc_cpu
        seq_lens = [end - start for start, end in zip(qsl, qsl[1:])]
        lengths = torch.tensor(seq_lens, device=input_ids.device)
        valid = torch.arange(max(seq_lens), device=input_ids.device) < lengths[:, None]  # [B, L]
        x = self.embeddings(input_ids, positions)
        for layer in self.encoder.layer:
            x = layer(x, seq_lens, valid)
        return x

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load Hugging Face-named tensors (with or without a ``bert.`` prefix);
        returns the names of the parameters now fully loaded."""
        weights = (
            (name.removeprefix("bert."), tensor)
            for name, tensor in weights
            if not name.removeprefix("bert.").startswith(_UNUSED_WEIGHTS)
        )
        return load_named_weights(self, weights, _STACKED_PARAMS)
