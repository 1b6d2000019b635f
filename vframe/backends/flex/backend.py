"""Paged attention with PyTorch's FlexAttention (``torch.nn.attention.flex_attention``).

The KV cache of one layer is ``[2, num_blocks, block_size, KVH, D]``, the torch
backend's layout. A step's keys and values are written with ``index_copy_`` at
``slot_mapping``; then one ``flex_attention`` call attends all the step's query
tokens (packed, ``[1, H, T, D]``) over the KV blocks the step's requests hold.

The plan (built once per step, shared by every layer):

* ``used``: the physical blocks any request of the step holds (up to
  ``ceil(seq_len / block_size)`` each), gathered into a compact key/value tensor
  ``[1, KVH, U * block_size, D]``; compact block ``u`` is physical ``used[u]``.
* a ``BlockMask`` built directly with ``BlockMask.from_kv_blocks`` (the mask is
  never evaluated over the cache to find blocks): query tiles of
  ``Q_BLOCK_SIZE`` tokens, KV tiles of one cache block; tile ``i`` lists the
  compact blocks of every request with a token in it;
* a ``mask_mod``: query ``q`` is request ``q_req[q]`` at position ``q_pos[q]``;
  key ``k`` is compact block ``k // block_size``, at logical position
  ``logical[blk] * block_size + k % block_size`` (a block sits at the same
  logical index in every request that holds it); allowed iff ``owner[r, blk]``,
  that position ``<= q_pos`` (hence ``< seq_len``), and inside the sliding
  window when the layer has one.

Slots never written (the tail of a request's last block) may hold anything,
NaN included; masked scores become ``-inf``, but a probability of 0 times a NaN
value is still NaN, so the gathered values of those slots are zeroed (on the
compact copy; the cache itself is left as it is).

This first version calls ``flex_attention`` eagerly (PyTorch's unfused
reference path, which materialises the ``[H, T, U * block_size]`` scores): it is
correct on CPU and GPU but not fast. A compiled path
(``torch.compile(flex_attention, dynamic=True)``) is left for later.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vframe.core.interfaces import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vframe.core.kv_cache_spec import refuse_fp8_kv_cache

Q_BLOCK_SIZE = 128  # query tokens per BlockMask row tile
BLOCK_SIZES = (16, 32, 64, 128)  # FlexAttention's KV tiles are one cache block: at least 16


@dataclass
class FlexAttentionMetadata:
    """The plan of one step, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    num_actual_tokens: int
    block_size: int
    used: torch.Tensor  # [U] int64, physical blocks in compact order
    slot_valid: torch.Tensor  # [U * block_size] bool, written slots of the compact blocks
    q_req: torch.Tensor  # [T] int64, request of each query token
    q_pos: torch.Tensor  # [T] int64, absolute position of each query token
    owner: torch.Tensor  # [B, U] bool, request r holds compact block u
    logical: torch.Tensor  # [U] int64, logical index of each compact block
    kv_num_blocks: torch.Tensor  # [1, 1, num_q_tiles] int32
    kv_indices: torch.Tensor  # [1, 1, num_q_tiles, U] int32
    block_masks: dict[int | None, Any] = field(default_factory=dict)  # per sliding window

    def block_mask(self, sliding_window: int | None) -> Any:
        """The ``BlockMask`` for layers with this sliding window (built once per step)."""
        if sliding_window not in self.block_masks:
            from torch.nn.attention.flex_attention import BlockMask

            self.block_masks[sliding_window] = BlockMask.from_kv_blocks(
                self.kv_num_blocks,
                self.kv_indices,
                BLOCK_SIZE=(Q_BLOCK_SIZE, self.block_size),
                mask_mod=self._mask_mod(sliding_window),
                seq_lengths=(self.num_actual_tokens, self.used.shape[0] * self.block_size),
            )
        return self.block_masks[sliding_window]

    def _mask_mod(self, sliding_window: int | None) -> Callable:
        q_req, q_pos, owner, logical, bs = self.q_req, self.q_pos, self.owner, self.logical, self.block_size

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            blk = kv_idx // bs
            pos = logical[blk] * bs + kv_idx % bs
            qp = q_pos[q_idx]
            ok = owner[q_req[q_idx], blk] & (pos <= qp)
            if sliding_window is not None:
                ok = ok & (pos > qp - sliding_window)
            return ok

        return mask_mod

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        device = common.slot_mapping.device
        bs = common.block_size
        qsl, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
        table = common.block_table.cpu().tolist()  # one host copy per step
        num_reqs, n = common.num_reqs, common.num_actual_tokens

        req_blocks = [table[r][: -(-seq_lens[r] // bs)] for r in range(num_reqs)]
        used = sorted({p for blocks in req_blocks for p in blocks})
        compact = {p: u for u, p in enumerate(used)}
        num_used = len(used)
        owner = torch.zeros(num_reqs, num_used, dtype=torch.bool)
        logical = torch.zeros(num_used, dtype=torch.long)
        filled = torch.zeros(num_used, dtype=torch.long)  # written slots per compact block
        for r, blocks in enumerate(req_blocks):
            for i, p in enumerate(blocks):
                u = compact[p]
                owner[r, u] = True
                logical[u] = i
                filled[u] = max(int(filled[u]), min(bs, seq_lens[r] - i * bs))
        slot_valid = (torch.arange(bs)[None, :] < filled[:, None]).flatten()

        q_req = torch.zeros(n, dtype=torch.long)
        q_pos = torch.zeros(n, dtype=torch.long)
        for r in range(num_reqs):
            a, b = qsl[r], qsl[r + 1]
            q_req[a:b] = r
            q_pos[a:b] = torch.arange(seq_lens[r] - (b - a), seq_lens[r])

        num_tiles = max(1, -(-n // Q_BLOCK_SIZE))
        kv_num_blocks = torch.zeros(1, 1, num_tiles, dtype=torch.int32)
        kv_indices = torch.zeros(1, 1, num_tiles, max(1, num_used), dtype=torch.int32)
        for t in range(num_tiles):
            lo, hi = t * Q_BLOCK_SIZE, min(n, (t + 1) * Q_BLOCK_SIZE)
            reqs = [r for r in range(num_reqs) if qsl[r] < hi and qsl[r + 1] > lo]
            tile = sorted({compact[p] for r in reqs for p in req_blocks[r]})
            kv_num_blocks[0, 0, t] = len(tile)
            kv_indices[0, 0, t, : len(tile)] = torch.tensor(tile, dtype=torch.int32)

        def dev(x: torch.Tensor) -> torch.Tensor:
            return x.to(device)

        return cls(
            slot_mapping=common.slot_mapping[:n].long(),
            num_actual_tokens=n,
            block_size=bs,
            used=dev(torch.tensor(used, dtype=torch.long)),
            slot_valid=dev(slot_valid),
            q_req=dev(q_req),
            q_pos=dev(q_pos),
            owner=dev(owner),
            logical=dev(logical),
            kv_num_blocks=dev(kv_num_blocks),
            kv_indices=dev(kv_indices),
        )


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        return FlexAttentionMetadata.from_common(common)


class FlexAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        attn_metadata: Any,  # FlexAttentionMetadata (or CommonAttentionMetadata, planned here)
    ) -> torch.Tensor:  # [T, H, D]
        from torch.nn.attention.flex_attention import flex_attention

        meta = attn_metadata
        if isinstance(meta, CommonAttentionMetadata):
            meta = FlexAttentionMetadata.from_common(meta)
        n = meta.num_actual_tokens
        kvh, d = self.num_kv_heads, self.head_size
        kv_cache[0].view(-1, kvh, d).index_copy_(0, meta.slot_mapping, key[:n])
        kv_cache[1].view(-1, kvh, d).index_copy_(0, meta.slot_mapping, value[:n])

        output = torch.zeros_like(query)  # padding rows past n stay zero
        if n == 0:
            return output
        num_keys = meta.used.shape[0] * meta.block_size
        k = kv_cache[0].index_select(0, meta.used).view(1, num_keys, kvh, d).transpose(1, 2)  # [1, KVH, S, D]
        v = kv_cache[1].index_select(0, meta.used).view(1, num_keys, kvh, d)
        v = v.masked_fill(~meta.slot_valid[None, :, None, None], 0).transpose(1, 2)  # unwritten slots: 0, not NaN
        q = query[:n].transpose(0, 1)[None]  # [1, H, T, D]
        block_mask = meta.block_mask(self.sliding_window)
        with warnings.catch_warnings():  # eager on purpose (see the module docstring)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(q, k, v, block_mask=block_mask, scale=self.scale, enable_gqa=True)
        output[:n] = out[0].transpose(0, 1)
        return output


class FlexAttentionBackend(AttentionBackend):
    name = "flex"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlexAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlexAttentionImpl

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
        reasons = refuse_fp8_kv_cache("flex", kv_cache_dtype)
        if use_mla:
            reasons.append("the flex backend has no multi-head latent attention (MLA) path; use 'torch' or 'triton'")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"the flex backend supports float32, bfloat16 and float16, not {dtype}")
        elif dtype == torch.float16 and device == "cpu":
            reasons.append("the flex backend does not run float16 on the CPU; use dtype='bfloat16' or 'float32'")
        if head_size <= 0:
            reasons.append(f"head_size must be positive, got {head_size}")
        if block_size not in BLOCK_SIZES:
            reasons.append(
                f"block_size {block_size} is not supported by the flex backend (FlexAttention's KV tiles "
                "are one cache block, at least 16 tokens); use one of " + ", ".join(map(str, BLOCK_SIZES))
            )
        return reasons

    @classmethod
    def check_available(cls) -> list[str]:
        try:
            found = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return [
                f"this torch ({torch.__version__}) has no torch.nn.attention.flex_attention; "
                "needs torch 2.5 or newer"
            ]
        return []
