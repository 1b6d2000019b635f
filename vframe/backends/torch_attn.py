"""Paged attention in plain PyTorch: runs on any device torch runs on.

The KV cache of one layer is ``[2, num_blocks, block_size, KVH, D]`` (keys,
then values). A token's slot is ``block_id * block_size + offset``, so the
flattened view ``[num_blocks * block_size, KVH, D]`` is indexed by slot.

A step mixes prefills and decodes. Every request with one query token (a
decode) is served by one batched call: its keys and values are gathered through
the block table into a padded ``[B_dec, KVH, max_len, D]`` tensor and a mask
hides the padding. Each longer request (a prefill, or a chunk of one) gets its
own ``scaled_dot_product_attention`` call::

    request b:  | cached: context_lens[b] | new: query_len(b) |
    query i sits at position context_lens[b] + i and attends keys 0 .. that position
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vframe.core.interfaces import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass
class PrefillSpan:
    """One request with more than one query token in this step."""

    query_start: int
    query_end: int
    context_len: int  # tokens cached before this step
    # Only when there is cached context: keys must come from the cache.
    slots: torch.Tensor | None  # [seq_len] int64, the request's slots in position order
    attn_mask: torch.Tensor | None  # [query_len, seq_len] bool, True = attend


@dataclass
class TorchAttentionMetadata:
    """The plan of one step, built once and shared by every layer."""

    common: CommonAttentionMetadata
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    num_actual_tokens: int
    prefills: list[PrefillSpan]
    decode_token_idx: torch.Tensor | None  # [B_dec] int64, the decodes' rows in the flat batch
    decode_slots: torch.Tensor | None  # [B_dec, max_len] int64, padding points at slot 0
    decode_mask: torch.Tensor | None  # [B_dec, 1, 1, max_len] bool, True = attend

    @classmethod
    def from_common(
        cls, common: CommonAttentionMetadata, sliding_window: int | None = None
    ) -> TorchAttentionMetadata:
        qsl = common.query_start_loc_cpu
        seq_lens = common.seq_lens_cpu
        device = common.slot_mapping.device
        block_table = common.block_table.to(device=device, dtype=torch.long)
        block_size = common.block_size

        prefills: list[PrefillSpan] = []
        decode_reqs: list[int] = []
        for b in range(common.num_reqs):
            query_len = qsl[b + 1] - qsl[b]
            if query_len == 1:
                decode_reqs.append(b)
            elif query_len > 1:
                prefills.append(
                    _plan_prefill(qsl[b], qsl[b + 1], seq_lens[b], block_table[b], block_size, sliding_window)
                )

        decode_token_idx = decode_slots = decode_mask = None
        if decode_reqs:
            reqs = torch.tensor(decode_reqs, dtype=torch.long, device=device)
            max_len = max(seq_lens[b] for b in decode_reqs)
            positions = torch.arange(max_len, device=device)  # [L]
            lens = torch.tensor([seq_lens[b] for b in decode_reqs], device=device)  # [B_dec]
            valid = positions[None, :] < lens[:, None]  # [B_dec, L]
            if sliding_window is not None:
                valid &= positions[None, :] > lens[:, None] - 1 - sliding_window
            slots = _slots(block_table[reqs], positions, block_size)  # [B_dec, L]
            decode_token_idx = torch.tensor([qsl[b] for b in decode_reqs], dtype=torch.long, device=device)
            decode_slots = torch.where(valid, slots, 0)
            decode_mask = valid[:, None, None, :]

        return cls(
            common=common,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            num_actual_tokens=common.num_actual_tokens,
            prefills=prefills,
            decode_token_idx=decode_token_idx,
            decode_slots=decode_slots,
            decode_mask=decode_mask,
        )


def _slots(
    block_table: torch.Tensor,  # [..., max_blocks] int64
    positions: torch.Tensor,  # [L] int64
    block_size: int,
) -> torch.Tensor:  # [..., L] int64
    block_idx = (positions // block_size).clamp(max=block_table.shape[-1] - 1)
    return block_table[..., block_idx] * block_size + positions % block_size


def _plan_prefill(
    query_start: int,
    query_end: int,
    seq_len: int,
    block_table: torch.Tensor,  # [max_blocks] int64
    block_size: int,
    sliding_window: int | None,
) -> PrefillSpan:
    query_len = query_end - query_start
    context_len = seq_len - query_len
    if context_len == 0 and sliding_window is None:
        # Keys are exactly this step's keys: plain causal attention, no gather.
        return PrefillSpan(query_start, query_end, 0, None, None)
    device = block_table.device
    key_pos = torch.arange(seq_len, device=device)  # [S]
    query_pos = torch.arange(context_len, seq_len, device=device)  # [Q]
    mask = key_pos[None, :] <= query_pos[:, None]  # [Q, S]
    if sliding_window is not None:
        mask &= key_pos[None, :] > query_pos[:, None] - sliding_window
    slots = _slots(block_table, key_pos, block_size)  # [S]
    return PrefillSpan(query_start, query_end, context_len, slots, mask)


class TorchAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> TorchAttentionMetadata:
        return TorchAttentionMetadata.from_common(common)


class TorchAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        attn_metadata: Any,  # TorchAttentionMetadata (or CommonAttentionMetadata, planned here)
    ) -> torch.Tensor:  # [T, H, D]
        meta = attn_metadata
        if isinstance(meta, CommonAttentionMetadata):
            meta = TorchAttentionMetadata.from_common(meta, self.sliding_window)
        elif self.sliding_window is not None:
            # The shared plan has no window; a windowed layer plans its own masks.
            meta = TorchAttentionMetadata.from_common(meta.common, self.sliding_window)

        n = meta.num_actual_tokens
        key_cache = kv_cache[0].view(-1, self.num_kv_heads, self.head_size)  # [num_slots, KVH, D]
        value_cache = kv_cache[1].view(-1, self.num_kv_heads, self.head_size)
        key_cache.index_copy_(0, meta.slot_mapping, key[:n])
        value_cache.index_copy_(0, meta.slot_mapping, value[:n])

        # SDPA gets 4-D [batch, heads, len, D] inputs: on CPU only those take the flash kernel.
        output = torch.zeros_like(query)  # padding rows past n stay zero
        for span in meta.prefills:
            q = query[span.query_start : span.query_end].transpose(0, 1)[None]  # [1, H, Q, D]
            if span.slots is None:
                k = key[span.query_start : span.query_end].transpose(0, 1)[None]  # [1, KVH, Q, D]
                v = value[span.query_start : span.query_end].transpose(0, 1)[None]
                out = F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, scale=self.scale, enable_gqa=True
                )
            else:
                k = key_cache.index_select(0, span.slots).transpose(0, 1)[None]  # [1, KVH, S, D]
                v = value_cache.index_select(0, span.slots).transpose(0, 1)[None]
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=span.attn_mask, scale=self.scale, enable_gqa=True
                )
            output[span.query_start : span.query_end] = out[0].transpose(0, 1)  # [Q, H, D]

        if meta.decode_token_idx is not None:
            num_decodes, max_len = meta.decode_slots.shape
            gather_shape = (num_decodes, max_len, self.num_kv_heads, self.head_size)
            slots = meta.decode_slots.flatten()
            q = query.index_select(0, meta.decode_token_idx)[:, :, None, :]  # [B_dec, H, 1, D]
            k = key_cache.index_select(0, slots).view(gather_shape).transpose(1, 2)  # [B_dec, KVH, L, D]
            v = value_cache.index_select(0, slots).view(gather_shape).transpose(1, 2)
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=meta.decode_mask, scale=self.scale, enable_gqa=True
            )
            output.index_copy_(0, meta.decode_token_idx, out[:, :, 0, :])  # [B_dec, H, D]
        return output


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return TorchAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchAttentionImpl

    @classmethod
    def validate_configuration(
        cls,
        *,
        head_size: int,
        dtype: torch.dtype,
        device: str,
        block_size: int,
        use_mla: bool = False,
    ) -> list[str]:
        reasons = []
        if use_mla:
            reasons.append("the torch backend does not implement MLA (multi-head latent attention)")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"the torch backend supports float32, bfloat16 and float16, not {dtype}")
        if head_size <= 0:
            reasons.append(f"head_size must be positive, got {head_size}")
        if block_size <= 0:
            reasons.append(f"block_size must be positive, got {block_size}")
        return reasons

    @classmethod
    def check_available(cls) -> list[str]:
        return []
