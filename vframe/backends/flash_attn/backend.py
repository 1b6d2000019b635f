"""Paged attention with the ``flash-attn`` package (FlashAttention-2, NVIDIA GPUs).

One step is one write and one kernel launch per layer:

* the step's keys and values go into the cache at ``slot_mapping`` (an
  indexed copy; flash-attn's own cache-append writes contiguous runs only);
* a step with any prefill calls ``flash_attn_varlen_func`` with the block
  table: every request's new tokens attend causally over its cached and new
  keys, variable lengths packed as ``cu_seqlens``;
* a step of decodes only calls ``flash_attn_with_kvcache``, whose split-KV
  (flash-decoding) path spreads long contexts over the GPU.

The cache layout is vframe's standard ``(2, num_blocks, block_size, KVH, D)``:
``kv_cache[0]`` and ``kv_cache[1]`` are the paged key and value tensors
flash-attn takes. Its paged kernels need ``block_size`` to be a multiple of
256 (``validate_configuration`` says so), so this backend runs with
``block_size=256``; ``attention_backend='auto'`` with the default block size
of 16 takes the Triton backend instead.

This module imports no ``flash_attn``; ``check_available`` looks for the
package without importing it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch

from vframe.core.interfaces import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vframe.core.kv_cache_spec import refuse_fp8_kv_cache

PAGE_MULTIPLE = 256  # flash-attn's paged kernels: block_size % 256 == 0
MAX_HEAD_SIZE = 256
MIN_CAPABILITY = (8, 0)  # FlashAttention-2: Ampere and newer


@dataclass
class FlashAttentionMetadata:
    """The plan of one step, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [B + 1] int32: cu_seqlens_q
    seq_start_loc: torch.Tensor  # [B + 1] int32: cu_seqlens_k, cumulative seq_lens
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    max_query_len: int
    max_seq_len: int


class FlashAttentionMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> FlashAttentionMetadata:
        seq_lens = common.seq_lens.to(torch.int32)
        seq_start_loc = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
        torch.cumsum(seq_lens, 0, dtype=torch.int32, out=seq_start_loc[1:])
        return FlashAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            num_actual_tokens=common.num_actual_tokens,
            query_start_loc=common.query_start_loc.to(torch.int32),
            seq_start_loc=seq_start_loc,
            seq_lens=seq_lens,
            block_table=common.block_table.to(torch.int32).contiguous(),
            max_query_len=common.max_query_len,
            max_seq_len=common.max_seq_len,
        )


class FlashAttentionImpl(AttentionImpl):
    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window)
        import flash_attn

        self.flash_attn = flash_attn
        # flash-attn's window counts keys left of the query; vframe's includes the query.
        self.window_size = (-1, -1) if sliding_window is None else (sliding_window - 1, 0)

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        attn_metadata: FlashAttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        meta = attn_metadata
        n = meta.num_actual_tokens
        key_cache, value_cache = kv_cache.unbind(0)  # [num_blocks, block_size, KVH, D] each
        key_cache.view(-1, self.num_kv_heads, self.head_size).index_copy_(0, meta.slot_mapping, key[:n])
        value_cache.view(-1, self.num_kv_heads, self.head_size).index_copy_(0, meta.slot_mapping, value[:n])
        if meta.max_query_len == 1:
            out = self.flash_attn.flash_attn_with_kvcache(
                query[:n].unsqueeze(1),  # [B, 1, H, D]
                key_cache,
                value_cache,
                cache_seqlens=meta.seq_lens,
                block_table=meta.block_table,
                softmax_scale=self.scale,
                causal=True,
                window_size=self.window_size,
            ).squeeze(1)
        else:
            out = self.flash_attn.flash_attn_varlen_func(
                query[:n],
                key_cache,
                value_cache,
                cu_seqlens_q=meta.query_start_loc,
                cu_seqlens_k=meta.seq_start_loc,
                max_seqlen_q=meta.max_query_len,
                max_seqlen_k=meta.max_seq_len,
                softmax_scale=self.scale,
                causal=True,
                window_size=self.window_size,
                block_table=meta.block_table,
            )
        if query.shape[0] == n:
            return out
        output = torch.zeros_like(query)  # padding rows
        output[:n] = out
        return output


class FlashAttentionBackend(AttentionBackend):
    name = "flash_attn"
    # A decode step reads seq_lens and block_table (views of the step's tensors: already int32
    # and contiguous) through flash_attn_with_kvcache, whose split count follows the block
    # table's width (max_model_len / block_size in a graph). seq_start_loc, computed in build,
    # serves prefills only, which never replay.
    supports_cuda_graphs = True

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlashAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlashAttentionImpl

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
        reasons = refuse_fp8_kv_cache("flash_attn", kv_cache_dtype)
        if device != "cuda":
            reasons.append(f"the flash_attn backend runs on device 'cuda', not {device!r}")
        if dtype not in (torch.float16, torch.bfloat16):
            reasons.append(f"flash-attn supports float16 and bfloat16, not {dtype}")
        if use_mla:
            reasons.append("the flash_attn backend has no multi-head latent attention path; use triton or torch")
        elif head_size % 8 or head_size > MAX_HEAD_SIZE:
            reasons.append(
                f"head_size {head_size} is not supported by flash-attn; use a multiple of 8 up to {MAX_HEAD_SIZE}"
            )
        if block_size % PAGE_MULTIPLE:
            reasons.append(
                f"block_size {block_size}: flash-attn's paged KV cache needs a multiple of {PAGE_MULTIPLE}; "
                f"set block_size={PAGE_MULTIPLE}"
            )
        return reasons

    @classmethod
    def check_available(cls) -> list[str]:
        reasons = []
        if not torch.cuda.is_available():
            reasons.append(
                f"needs an NVIDIA GPU of compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}; "
                "no CUDA device is visible"
            )
        elif torch.cuda.get_device_capability() < MIN_CAPABILITY:
            major, minor = torch.cuda.get_device_capability()
            reasons.append(
                f"needs an NVIDIA GPU of compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}; "
                f"this one is {major}.{minor}"
            )
        if importlib.util.find_spec("flash_attn") is None:
            reasons.append(
                "package flash-attn not installed (pip install flash-attn --no-build-isolation; "
                "it compiles against the installed torch and CUDA)"
            )
        return reasons

