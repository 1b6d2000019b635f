"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache, in plain PyTorch.

One layer's cache is ``[num_blocks, block_size, R + P]``: per token the
normalized latent ``c_kv`` (``R = kv_lora_rank``) then the rotated shared key
(``P = qk_rope_head_dim``). The model has absorbed the up-projections, so this
is multi-query attention with a single key "head" of ``R + P`` whose first
``R`` elements are the value too::

    query [T, H, R + P] . cache[s] [R + P]  ->  softmax over s  ->  weights . cache[s, :R]  ->  [T, H, R]

A float8 cache (``kv_cache_dtype="fp8"``) holds the latent rounded to float8,
upcast when read, exactly as ``torch_attn.py`` treats keys and values. The latent is
one cache, key and value at once: a checkpoint's calibrated ``k_scale`` scales all of
it (as vLLM's MLA caches do), stored ``fp8(latent / k_scale)``, the scale folded into
the softmax scale and the output; a ``v_scale`` other than 1.0 or ``k_scale`` has no
tensor to apply to and is refused at load (the model runner).

The step plan (prefill spans, length-sorted decode groups, masks, gathered
block ids) is the torch backend's ``TorchAttentionMetadata``: the same
positions and slots, only the row a slot holds is different.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from vframe.backends.torch_attn import TorchAttentionMetadata, as_cached, gather_blocks, store_rows, upcast
from vframe.core.interfaces import CommonAttentionMetadata, MLAAttentionImpl
from vframe.core.kv_cache_spec import is_fp8


class TorchMLAImpl(MLAAttentionImpl):
    supports_kv_cache_scales = True  # plugin API 1.19: k_scale over the whole latent

    def forward(
        self,
        query: torch.Tensor,  # [T, H, R + P]
        latent: torch.Tensor,  # [T, R + P]
        kv_cache: torch.Tensor,  # [num_blocks, block_size, R + P]
        attn_metadata: Any,  # TorchAttentionMetadata (or CommonAttentionMetadata, planned here)
    ) -> torch.Tensor:  # [T, H, R]
        meta = attn_metadata
        if isinstance(meta, CommonAttentionMetadata):
            meta = TorchAttentionMetadata.from_common(meta)
        rank = self.kv_lora_rank
        n = meta.num_actual_tokens
        slots = kv_cache.view(-1, self.latent_size)  # [num_slots, R + P]
        latent, factor = latent_cache_domain(self, latent, kv_cache)
        scale = self.scale * factor
        store_rows(slots, meta.slot_mapping, latent[:n])

        output = query.new_zeros(query.shape[0], self.num_heads, rank)  # padding rows past n stay zero
        for span in meta.prefills:
            q = query[span.query_start : span.query_end].transpose(0, 1)[None]  # [1, H, Q, R + P]
            if span.slots is None:
                k = as_cached(latent[span.query_start : span.query_end], slots.dtype).to(query.dtype)[None, None]
                out = F.scaled_dot_product_attention(
                    q, k, k[..., :rank], is_causal=True, scale=scale, enable_gqa=True
                )  # k: [1, 1, Q, R + P]
            else:
                k = upcast(slots.index_select(0, span.slots), query.dtype)[None, None]  # [1, 1, S, R + P]
                out = F.scaled_dot_product_attention(
                    q, k, k[..., :rank], attn_mask=span.attn_mask, scale=scale, enable_gqa=True
                )
            output[span.query_start : span.query_end] = out[0].transpose(0, 1)  # [Q, H, R]

        for dec in meta.decode_groups:
            count, max_len = dec.mask.shape[0], dec.mask.shape[-1]
            # All H query heads share the one latent "head": [n, 1, H, R + P].
            q = query.index_select(0, dec.token_idx)[:, None]
            k = gather_blocks(kv_cache, dec, query.dtype).view(count, 1, max_len, self.latent_size)  # [n, 1, L, R + P]
            out = F.scaled_dot_product_attention(q, k, k[..., :rank], attn_mask=dec.mask, scale=scale)
            output.index_copy_(0, dec.token_idx, out[:, 0])  # [n, H, R]
        return output if factor == 1.0 else output.mul_(factor)


def latent_cache_domain(
    impl: MLAAttentionImpl, latent: torch.Tensor, kv_cache: torch.Tensor
) -> tuple[torch.Tensor, float]:
    """The latent as the cache stores it, and the scale it is stored over: with a float8
    cache and a calibrated ``k_scale``, ``latent / k_scale`` in float32 (rounded once into
    float8 when stored) and ``k_scale``, which attention folds into the softmax scale and
    the output; else the latent as it is and 1.0."""
    if is_fp8(kv_cache.dtype) and impl.k_scale != 1.0:
        return latent.float() / impl.k_scale, impl.k_scale
    return latent, 1.0
