"""Paged attention in plain PyTorch: runs on any device torch runs on.

The KV cache of one layer is ``[2, num_blocks, block_size, KVH, D]`` (keys,
then values); multi-head latent attention layers are ``torch_mla.py``'s. A token's slot is ``block_id * block_size + offset``, so the
flattened view ``[num_blocks * block_size, KVH, D]`` is indexed by slot.

The cache holds the model's dtype or, with ``kv_cache_dtype="fp8"``
(``fp8_e4m3``, ``fp8_e5m2``), float8: keys and values are rounded to it when
written (divided by the checkpoint's calibrated ``k_scale`` / ``v_scale`` where it has them,
per layer or per KV head, else scale 1.0; saturating) and upcast to the model's dtype when read,
the scales folded into the softmax scale (per head: the query) and the output
(``TorchAttentionImpl.kv_cache_domain``).

A step mixes prefills and decodes. Every request with one query token (a
decode) is served by one batched call: its keys and values are gathered through
the block table into a padded ``[B_dec, KVH, max_len, D]`` tensor and a mask
hides the padding. Each longer request (a prefill, or a chunk of one) gets its
own ``scaled_dot_product_attention`` call::

    request b:  | cached: context_lens[b] | new: query_len(b) |
    query i sits at position context_lens[b] + i and attends keys 0 .. that position
"""

from __future__ import annotations

import functools
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
from vframe.core.kv_cache_spec import is_fp8
from vframe.layers import cpu_ops


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
                    plan_prefill(qsl[b], qsl[b + 1], seq_lens[b], block_table[b], block_size, sliding_window)
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


def plan_prefill(
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
    supports_kv_cache_scales = True  # plugin API 1.19: calibrated k_scale / v_scale, see kv_cache_domain
    supports_per_head_kv_scales = True  # plugin API 1.22: per KV head, likewise

    def kv_cache_domain(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float, float | torch.Tensor]:
        """Query, key, value, softmax scale and output factor in the cache's domain: with a
        float8 cache and calibrated scales, key / k_scale and value / v_scale in float32
        (rounded once into float8 when stored), attention over the float8 values with k_scale
        folded into the softmax scale and v_scale into the output (``output * v_scale``). Per
        KV head (``k_head_scales``), ``fold_kv_head_scales``: each head's keys and values over
        its own scales, the query heads of KV head ``h`` times ``k_head_scales[h]`` and their
        outputs times ``v_head_scales[h]`` (the factor ``[H, 1]``). Else as they are (factor 1.0)."""
        if not is_fp8(kv_cache.dtype) or not self.has_kv_cache_scales:
            return query, key, value, self.scale, 1.0
        if not self.has_kv_head_scales:
            return (query, key.float() / self.k_scale, value.float() / self.v_scale, self.scale * self.k_scale,
                    self.v_scale)
        query, key, value, factor = self.fold_kv_head_scales(query, key, value)
        return query, key, value, self.scale, factor

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
        query, key, value, scale, factor = self.kv_cache_domain(query, key, value, kv_cache)
        write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        if meta.prefills:
            attend_prefills(output, query, key, value, *kv_cache_views(kv_cache), meta.prefills, scale)

        group = self.num_heads // self.num_kv_heads
        for dec in meta.decode_groups:
            n, max_len = dec.mask.shape[0], dec.mask.shape[-1]
            kv_shape = (n, max_len, self.num_kv_heads, self.head_size)
            # GQA as `group` query rows per KV head: query head h reads KV head
            # h // group, so [n, H, D] -> [n, KVH, group, D] and K/V are not repeated.
            q = query.index_select(0, dec.token_idx).view(n, self.num_kv_heads, group, self.head_size)
            k = gather_blocks(kv_cache[0], dec, query.dtype).view(kv_shape).transpose(1, 2)  # [n, KVH, L, D]
            v = gather_blocks(kv_cache[1], dec, query.dtype).view(kv_shape).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=dec.mask, scale=scale)
            output.index_copy_(0, dec.token_idx, out.reshape(n, self.num_heads, self.head_size))
        return scaled_output(output, factor)


def scaled_output(output: torch.Tensor, factor: float | torch.Tensor) -> torch.Tensor:
    """``output`` times ``kv_cache_domain``'s factor (a float, or ``[H, 1]`` per query head), in place."""
    return output if isinstance(factor, float) and factor == 1.0 else output.mul_(factor)


def write_kv_cache(
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [num_actual_tokens] int64
) -> None:
    """Store the step's new keys and values at their slots: ``cpu_ops.store_kv`` (one C++
    call for both) where it takes them, else an ``index_copy_`` into each cache's view."""
    if cpu_ops.stores_kv(key, value, kv_cache, slot_mapping):
        cpu_ops.store_kv(key, value, kv_cache, slot_mapping)
        return
    n = slot_mapping.shape[0]
    key_cache, value_cache = kv_cache_views(kv_cache)
    store_rows(key_cache, slot_mapping, key[:n])
    store_rows(value_cache, slot_mapping, value[:n])


def kv_cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value caches of ``kv_cache`` ([2, num_blocks, block_size, KVH, D]) as
    rows of slots, each [num_slots, KVH, D]."""
    return kv_cache[0].flatten(0, 1), kv_cache[1].flatten(0, 1)


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to the cache's ``dtype``; a float8 cache saturates at the
    format's largest finite value, as vLLM's cache kernels do (``x`` already divided by a
    calibrated scale: ``TorchAttentionImpl.kv_cache_domain``)."""
    if not is_fp8(dtype):
        return x.to(dtype)
    limit = torch.finfo(dtype).max
    return x.clamp(-limit, limit).to(dtype)


def as_cached(x: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``x`` as attention reads it back from a cache of ``cache_dtype``: this step's
    own keys are attended with the very rounding of the cached ones, so a result
    does not depend on whether a token came from the cache or the step."""
    return upcast(to_cache_dtype(x, cache_dtype), x.dtype) if is_fp8(cache_dtype) else x


def upcast(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache ``rows`` in the model's ``dtype``. Float8 goes through a 256-entry
    table: on CPU (torch 2.13) that is 6x faster than ``.to`` for e4m3."""
    if not is_fp8(rows.dtype):
        return rows.to(dtype)
    table = _upcast_table(rows.dtype, dtype, rows.device)
    return table.index_select(0, rows.view(torch.uint8).flatten().int()).view(rows.shape)


@functools.cache
def _upcast_table(cache_dtype: torch.dtype, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)  # [256], every float8 bit pattern
    return codes.view(cache_dtype).to(dtype).to(device)  # exact: NaN codes stay NaN


def store_rows(
    cache_rows: torch.Tensor,  # [num_slots, ...]
    slot_mapping: torch.Tensor,  # [n] int64
    rows: torch.Tensor,  # [n, ...] in the model's dtype
) -> None:
    rows = to_cache_dtype(rows, cache_rows.dtype)
    if is_fp8(cache_rows.dtype):  # torch 2.13 has no CPU index_copy_ for float8: copy the bytes
        cache_rows, rows = cache_rows.view(torch.uint8), rows.view(torch.uint8)
    cache_rows.index_copy_(0, slot_mapping, rows)


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
    """One SDPA call per request with more than one query token. ``key`` / ``value`` may be
    float32 (``kv_cache_domain``'s scaled ones): attended as stored, in the query's dtype."""
    # SDPA gets 4-D [batch, heads, len, D] inputs: on CPU only those take the flash kernel.
    for span in prefills:
        q = query[span.query_start : span.query_end].transpose(0, 1)[None]  # [1, H, Q, D]
        if span.slots is None:
            k = as_cached(key[span.query_start : span.query_end], key_cache.dtype).to(query.dtype)
            v = as_cached(value[span.query_start : span.query_end], value_cache.dtype).to(query.dtype)
            k, v = k.transpose(0, 1)[None], v.transpose(0, 1)[None]  # [1, KVH, Q, D]
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            k = upcast(key_cache.index_select(0, span.slots), query.dtype).transpose(0, 1)[None]  # [1, KVH, S, D]
            v = upcast(value_cache.index_select(0, span.slots), query.dtype).transpose(0, 1)[None]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=span.attn_mask, scale=scale, enable_gqa=True)
        output[span.query_start : span.query_end] = out[0].transpose(0, 1)  # [Q, H, D]


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]: one layer's keys or values
    dec: DecodeGroup,
    dtype: torch.dtype,
) -> torch.Tensor:  # [n * max_blocks, block_size, KVH, D] in dtype, zero wherever nothing was written
    blocks = upcast(cache.index_select(0, dec.block_ids), dtype)
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
        kv_cache_dtype: str = "auto",
    ) -> list[str]:
        # Every kv_cache_dtype the config accepts: float8 rows are stored and upcast here.
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
