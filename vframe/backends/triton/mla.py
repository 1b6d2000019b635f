"""The Triton backend's multi-head latent attention (``mla_kernels.py``).

One layer's cache is ``[num_blocks, block_size, R + P]``, as the torch
backend's: the step's latents are written at ``slot_mapping`` with one indexed
copy, then one launch attends every request's new tokens over its cached and
new latents, with the step plan of ``TritonAttentionMetadata`` (programs of
``block_q`` query tokens). A float8 cache holds ``fp8(latent / k_scale)`` (a
checkpoint's calibrated scale, else 1.0), as the torch backend stores it.
"""

from __future__ import annotations

import torch

from vframe.backends.torch_attn import store_rows
from vframe.backends.torch_mla import latent_cache_domain
from vframe.backends.triton.backend import TritonAttentionMetadata
from vframe.core.interfaces import MLAAttentionImpl


class TritonMLAImpl(MLAAttentionImpl):
    supports_kv_cache_scales = True  # plugin API 1.19: k_scale over the whole latent

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float) -> None:
        super().__init__(num_heads, kv_lora_rank, qk_rope_head_dim, scale)
        from vframe.backends.triton.backend import _load_kernels

        _load_kernels()  # refuses a TRITON_INTERPRET that changed since Triton was imported
        from vframe.backends.triton import mla_kernels

        self.kernels = mla_kernels

    def forward(
        self,
        query: torch.Tensor,  # [T, H, R + P]
        latent: torch.Tensor,  # [T, R + P]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, R + P]
        attn_metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:  # [T, H, R]
        meta = attn_metadata
        n = meta.num_actual_tokens
        latent, k_scale = latent_cache_domain(self, latent[:n], kv_cache)
        store_rows(kv_cache.view(-1, self.latent_size), meta.slot_mapping, latent)
        query = query if query.stride(-1) == 1 else query.contiguous()
        output = query.new_empty(query.shape[0], self.num_heads, self.kv_lora_rank)
        if output.shape[0] > n:
            output[n:].zero_()  # padding rows
        self.kernels.mla_attention(
            output[:n],
            query[:n],
            kv_cache,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            meta.program_req,
            meta.program_q_off,
            block_q=meta.block_q,
            kv_lora_rank=self.kv_lora_rank,
            scale=self.scale,
            k_scale=k_scale,
        )
        return output
