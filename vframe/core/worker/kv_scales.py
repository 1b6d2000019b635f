"""``cache.calculate_kv_scales``: a float8 KV cache's scales computed at start-up.

vLLM's option of that name: each attention layer's ``k_scale`` / ``v_scale`` (plugin API
1.19) from one forward of random tokens, before the engine serves anything, then fixed::

    k_scale = max |K| / K_SCALE_CONSTANT        v_scale = max |V| / V_SCALE_CONSTANT

over the keys and values the layer is given in that forward (this rank's heads; a
multi-head latent attention layer's ``k_scale`` over its latent, the one cache, as vLLM's
MLA layers take it from the latent). The constants are vLLM's: 200 and 100 leave e4m3's
largest value (448) 2.2 and 4.5 times the batch's largest key and value. The forward is
a prefill of one request over the cache's first blocks, which no request holds yet
(their contents are overwritten before anything reads them); the checkpoint's own
scales, per layer or per head, are replaced.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from vframe.core.interfaces import AttentionImpl, AttentionMetadataBuilder, CommonAttentionMetadata, MLAAttentionImpl

logger = logging.getLogger(__name__)

K_SCALE_CONSTANT = 200.0
V_SCALE_CONSTANT = 100.0
CALIBRATION_TOKENS = 512  # the random batch's length, at most (also capped by the cache and max_model_len)
SEED = 0  # the same tokens on every tensor-parallel rank and every start


def calculate_kv_scales(
    model: nn.Module,
    impls: list[AttentionImpl | MLAAttentionImpl],
    kv_caches: list[torch.Tensor],
    builder: AttentionMetadataBuilder,
    *,
    block_size: int,
    num_blocks: int,
    vocab_size: int,
    max_len: int,
    device: torch.device,
) -> int:
    """Set every impl's ``k_scale`` / ``v_scale`` from one forward of random tokens (see the
    module); returns the number of tokens."""
    tokens = min(CALIBRATION_TOKENS, num_blocks * block_size, max_len)
    generator = torch.Generator().manual_seed(SEED)
    input_ids = torch.randint(0, vocab_size, (tokens,), generator=generator).to(device)
    positions = torch.arange(tokens, device=device)
    blocks = -(-tokens // block_size)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor([0, tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([tokens], dtype=torch.int32, device=device),
        context_lens=torch.zeros(1, dtype=torch.int32, device=device),
        block_table=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        slot_mapping=torch.arange(tokens, dtype=torch.int64, device=device),
        num_reqs=1,
        num_actual_tokens=tokens,
        max_query_len=tokens,
        max_seq_len=tokens,
        block_size=block_size,
        query_start_loc_cpu=[0, tokens],
        seq_lens_cpu=[tokens],
    )
    for impl in impls:
        impl.forward = _measuring(impl)  # an instance attribute over the class's method, for one call
    try:
        with torch.inference_mode():
            model(input_ids, positions, kv_caches, builder.build(common))
    finally:
        for impl in impls:
            vars(impl).pop("forward", None)
    return tokens


def _measuring(impl: AttentionImpl | MLAAttentionImpl) -> Any:
    """``impl.forward`` that first sets the layer's scales from what it is given."""
    forward = type(impl).forward.__get__(impl)

    if isinstance(impl, MLAAttentionImpl):
        def measure(query: torch.Tensor, latent: torch.Tensor, *rest: Any) -> torch.Tensor:
            impl.k_scale = _scale(latent, K_SCALE_CONSTANT)
            return forward(query, latent, *rest)
        return measure

    def measure(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *rest: Any) -> torch.Tensor:
        impl.k_scale, impl.v_scale = _scale(key, K_SCALE_CONSTANT), _scale(value, V_SCALE_CONSTANT)
        impl.k_head_scales = impl.v_head_scales = None
        vars(impl).pop("_kv_head_scales", None)  # kv_head_scales' kept copy of the old ones
        return forward(query, key, value, *rest)
    return measure


def _scale(x: torch.Tensor, constant: float) -> float:
    """``max |x| / constant``; 1.0 where the batch gave the layer nothing but zeros."""
    amax = float(x.detach().abs().max()) if x.numel() else 0.0
    return amax / constant if amax > 0 else 1.0
