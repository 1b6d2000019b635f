"""Paged attention in plain PyTorch: runs on any device torch runs on.

The KV cache of one layer is ``[2, num_blocks, block_size, KVH, D]`` (keys,
then values); multi-head latent attention layers are ``torch_mla.py``'s. A token's slot is ``block_id * block_size + offset``, so the
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
    MLAAttentionImpl,
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
class DecodeGroup:
    """Requests with one query token and similar lengths, attended in one call."""

    token_idx: torch.Tensor  # [n] int64, the decodes' rows in the flat batch
    block_ids: torch.Tensor  # [n * max_blocks] int64, block tables, flattened
    mask: torch.Tensor  # [n, 1, 1, max_blocks * block_size] bool, True = attend
    unwritten_rows: torch.Tensor  # [num_unwritten] int64, gathered slots to zero (see _plan_decodes)


# Decodes are sorted by length and split into this many groups: each group pads
# only to its own longest request, which on CPU halves the attention time of a
# batch whose lengths spread widely.
_NUM_DECODE_GROUPS = 4


@dataclass
class TorchAttentionMetadata:
    """The plan of one step, built once and shared by every layer."""

    common: CommonAttentionMetadata
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    num_actual_tokens: int
    prefills: list[PrefillSpan]
    decode_groups: list[DecodeGroup]

    @classmethod
    def from_common(
        cls, common: CommonAttentionMetadata, sliding_window: int | None = None, plan_decodes: bool = True
    ) -> TorchAttentionMetadata:
        """The plan of ``common``'s step; ``plan_decodes=False`` leaves ``decode_groups``
        empty, for a backend that attends the decodes its own way."""
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

        if not plan_decodes:
            decode_reqs = []
        decode_reqs.sort(key=lambda b: seq_lens[b])
        num_groups = min(_NUM_DECODE_GROUPS, len(decode_reqs))
        bounds = [g * len(decode_reqs) // max(num_groups, 1) for g in range(num_groups + 1)]
        decode_groups = [
            _plan_decodes(decode_reqs[lo:hi], qsl, seq_lens, block_table, block_size, sliding_window)
            for lo, hi in zip(bounds, bounds[1:])
        ]

        return cls(
            common=common,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            num_actual_tokens=common.num_actual_tokens,
            prefills=prefills,
            decode_groups=decode_groups,
        )


def _plan_decodes(
    reqs: list[int],
    query_start_loc: list[int],
    seq_lens: list[int],
    block_table: torch.Tensor,  # [B, max_blocks] int64
    block_size: int,
    sliding_window: int | None,
) -> DecodeGroup:
    # Whole blocks are gathered (a few KB each, not one row per token). Gathered
    # slots past a request's length may hold NaN (never written, or left there by
    # another request), which the mask's zero probability does not cancel
    # (0 * NaN = NaN). So table padding reads the request's own first block, fully
    # written unless it is its only block, and what is still unwritten is zeroed
    # after the gather: usually just the tail of the last block.
    device = block_table.device
    max_blocks = -(-max(seq_lens[b] for b in reqs) // block_size)
    positions = torch.arange(max_blocks * block_size, device=device)  # [L]
    lens = torch.tensor([seq_lens[b] for b in reqs], device=device)  # [n]
    valid = positions[None, :] < lens[:, None]  # [n, L]
    if sliding_window is not None:
        valid &= positions[None, :] > lens[:, None] - 1 - sliding_window
    block_idx = torch.arange(max_blocks, device=device)[None, :]  # [1, max_blocks]
    own_blocks = -(-lens[:, None] // block_size)  # [n, 1]
    src_block = torch.where(block_idx < own_blocks, block_idx, 0)  # [n, max_blocks]
    src_pos = (src_block[:, :, None] * block_size + torch.arange(block_size, device=device)).flatten(1)  # [n, L]
    rows = torch.tensor(reqs, dtype=torch.long, device=device)
    return DecodeGroup(
        token_idx=torch.tensor([query_start_loc[b] for b in reqs], dtype=torch.long, device=device),
        block_ids=block_table[rows[:, None], src_block].flatten(),
        mask=valid[:, None, None, :],
        unwritten_rows=(src_pos >= lens[:, None]).flatten().nonzero().squeeze(1),
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

        output = torch.zeros_like(query)  # padding rows past n stay zero
        key_cache, value_cache = write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        attend_prefills(output, query, key, value, key_cache, value_cache, meta.prefills, self.scale)

        group = self.num_heads // self.num_kv_heads
        for dec in meta.decode_groups:
            n, max_len = dec.mask.shape[0], dec.mask.shape[-1]
            kv_shape = (n, max_len, self.num_kv_heads, self.head_size)
            # GQA as `group` query rows per KV head: query head h reads KV head
            # h // group, so [n, H, D] -> [n, KVH, group, D] and K/V are not repeated.
            q = query.index_select(0, dec.token_idx).view(n, self.num_kv_heads, group, self.head_size)
            k = gather_blocks(kv_cache[0], dec).view(kv_shape).transpose(1, 2)  # [n, KVH, L, D]
            v = gather_blocks(kv_cache[1], dec).view(kv_shape).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dec.mask, scale=self.scale)
            output.index_copy_(0, dec.token_idx, out.reshape(n, self.num_heads, self.head_size))
        return output


def write_kv_cache(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [num_actual_tokens] int64
) -> tuple[torch.Tensor, torch.Tensor]:  # key and value caches, each [num_slots, KVH, D]
    """Store the step's new keys and values at their slots."""
    n = slot_mapping.shape[0]
    key_cache = kv_cache[0].view(-1, *key.shape[1:])
    value_cache = kv_cache[1].view(-1, *value.shape[1:])
    key_cache.index_copy_(0, slot_mapping, key[:n])
    value_cache.index_copy_(0, slot_mapping, value[:n])
    return key_cache, value_cache


def attend_prefills(
    output: torch.Tensor,  # [T, H, D], written at each span's rows
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    key_cache: torch.Tensor,  # [num_slots, KVH, D]
    value_cache: torch.Tensor,  # [num_slots, KVH, D]
    prefills: list[PrefillSpan],
    scale: float,
) -> None:
    """One SDPA call per request with more than one query token."""
    # SDPA gets 4-D [batch, heads, len, D] inputs: on CPU only those take the flash kernel.
    for span in prefills:
        q = query[span.query_start : span.query_end].transpose(0, 1)[None]  # [1, H, Q, D]
        if span.slots is None:
            k = key[span.query_start : span.query_end].transpose(0, 1)[None]  # [1, KVH, Q, D]
            v = value[span.query_start : span.query_end].transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            k = key_cache.index_select(0, span.slots).transpose(0, 1)[None]  # [1, KVH, S, D]
            v = value_cache.index_select(0, span.slots).transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=span.attn_mask, scale=scale, enable_gqa=True)
        output[span.query_start : span.query_end] = out[0].transpose(0, 1)  # [Q, H, D]


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]: one layer's keys or values
    dec: DecodeGroup,
) -> torch.Tensor:  # [n * max_blocks, block_size, KVH, D], zero wherever nothing was written
    blocks = cache.index_select(0, dec.block_ids)
    blocks.view(-1, *cache.shape[2:]).index_fill_(0, dec.unwritten_rows, 0)
    return blocks


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
    def get_mla_impl_cls(cls) -> type[MLAAttentionImpl]:
        from vframe.backends.torch_mla import TorchMLAImpl

        return TorchMLAImpl

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
