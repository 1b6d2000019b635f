"""Paged attention with vframe's own Triton kernels (``kernels.py``).

One step is two launches per layer, whatever mixes of prefills and decodes it
holds: one writes the step's keys and values at ``slot_mapping``, one attends
every request's new tokens over its cached and new keys (causal, GQA, variable
lengths). The cache holds the model's dtype or, with ``kv_cache_dtype="fp8"``
(``fp8_e4m3``, ``fp8_e5m2``), float8 over a checkpoint's calibrated ``k_scale`` /
``v_scale`` (else 1.0), as the torch backend stores it, bit for bit.
Multi-head latent attention layers (DeepSeek) are ``mla.py``'s. A step of
decodes only over long contexts adds a split-KV launch (flash-decoding): each
request's keys are cut into shares attended in parallel, then merged by a
third kernel.

The metadata builder turns the step into a list of programs, each up to
``block_q`` query tokens of one request::

    query_start_loc = [0, 20, 21]        (r0: 20 new tokens, r1: a decode)
    block_q = 16:  program_req   = [0, 0, 1]
                   program_q_off = [0, 16, 0]

This module imports no Triton: the kernels are imported when the first layer
is built, so the backend can be listed and refused without them.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch

from vframe.core.interfaces import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
    MLAAttentionImpl,
)
from vframe.core.kv_cache_spec import is_fp8
from vframe.utils import triton_mode

PREFILL_BLOCK_Q = 16  # query tokens per program when some request has more than one
BLOCK_SIZES = (4, 8, 16, 32, 64, 128, 256)
MIN_HEAD_SIZE, MAX_HEAD_SIZE = 16, 256
MAX_MLA_LATENT_SIZE = 1024  # kv_lora_rank + qk_rope_head_dim; DeepSeek-V2/V3: 512 + 64
# Split-KV decoding: only when every request decodes, its keys reach this many,
# and the plain launch would leave streaming multiprocessors idle.
SPLIT_MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 16


@dataclass
class TritonAttentionMetadata:
    """The plan of one step, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks] int32
    program_req: torch.Tensor  # [P] int32
    program_q_off: torch.Tensor  # [P] int32
    block_q: int  # query tokens per program: 1 when every request decodes
    max_seq_len: int
    num_sms: int  # streaming multiprocessors of the device (1 off the GPU)


def plan_programs(query_start_loc: list[int], block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """``(program_req, program_q_off)``: each request's new tokens in chunks of ``block_q``."""
    query_lens = np.diff(np.asarray(query_start_loc, dtype=np.int64))  # [B]
    per_req = -(-query_lens // block_q)  # [B]
    program_req = np.repeat(np.arange(len(query_lens), dtype=np.int32), per_req)  # [P]
    first = np.repeat(np.cumsum(per_req) - per_req, per_req)  # [P]: index of the request's first program
    program_q_off = ((np.arange(len(program_req)) - first) * block_q).astype(np.int32)
    return program_req, program_q_off


class TritonAttentionMetadataBuilder(AttentionMetadataBuilder):
    def __init__(self, config: Any, device: torch.device) -> None:
        super().__init__(config, device)
        self.num_sms = 1
        if device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count

    def build(self, common: CommonAttentionMetadata) -> TritonAttentionMetadata:
        block_q = 1 if common.max_query_len == 1 else PREFILL_BLOCK_Q
        program_req, program_q_off = plan_programs(common.query_start_loc_cpu, block_q)
        device = common.query_start_loc.device
        return TritonAttentionMetadata(
            slot_mapping=common.slot_mapping[: common.num_actual_tokens],
            num_actual_tokens=common.num_actual_tokens,
            query_start_loc=common.query_start_loc.to(torch.int32),
            seq_lens=common.seq_lens.to(torch.int32),
            block_table=common.block_table.to(torch.int32),
            program_req=torch.from_numpy(program_req).to(device),
            program_q_off=torch.from_numpy(program_q_off).to(device),
            block_q=block_q,
            max_seq_len=common.max_seq_len,
            num_sms=self.num_sms,
        )


class TritonAttentionImpl(AttentionImpl):
    supports_kv_cache_scales = True  # plugin API 1.19: the kernels write over and read times them
    supports_per_head_kv_scales = True  # plugin API 1.22: per KV head, around the kernels (fold_kv_head_scales)

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window)
        self.kernels = _load_kernels()

    def num_splits(self, meta: TritonAttentionMetadata) -> int:
        """Shares of each request's keys attended in parallel (1: no split)."""
        if meta.block_q != 1:
            return 1
        idle = meta.num_sms // max(1, meta.program_req.shape[0] * self.num_kv_heads)
        return max(1, min(MAX_SPLITS, idle, meta.max_seq_len // SPLIT_MIN_KEYS_PER_SPLIT))

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        attn_metadata: TritonAttentionMetadata,
    ) -> torch.Tensor:  # [T, H, D]
        meta = attn_metadata
        n = meta.num_actual_tokens
        # The kernels index the head dimension with unit stride.
        query, key, value = (x if x.stride(-1) == 1 else x.contiguous() for x in (query, key, value))
        k_scale, v_scale, factor = self.k_scale, self.v_scale, None
        if is_fp8(kv_cache.dtype) and self.has_kv_head_scales:
            # per KV head (plugin API 1.22): applied around the kernels, which then run at scale 1.0
            query, key, value, factor = self.fold_kv_head_scales(query, key, value)
            k_scale = v_scale = 1.0
        self.kernels.write_kv(key[:n], value[:n], kv_cache, meta.slot_mapping, k_scale, v_scale)
        output = torch.empty_like(query)
        if output.shape[0] > n:
            output[n:].zero_()  # padding rows
        self.kernels.paged_attention(
            output[:n],
            query[:n],
            kv_cache,
            meta.block_table,
            meta.seq_lens,
            meta.query_start_loc,
            meta.program_req,
            meta.program_q_off,
            block_q=meta.block_q,
            scale=self.scale,
            sliding_window=self.sliding_window,
            num_splits=self.num_splits(meta),
            k_scale=k_scale,
            v_scale=v_scale,
        )
        return output if factor is None else output.mul_(factor)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    # A decode step's metadata: views of the step's tensors plus program_req = 0..B-1 and
    # program_q_off = 0, which depend on B alone; splits are chosen from max_seq_len.
    supports_cuda_graphs = True

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return TritonAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl

    @classmethod
    def get_mla_impl_cls(cls) -> type[MLAAttentionImpl]:
        from vframe.backends.triton.mla import TritonMLAImpl

        return TritonMLAImpl

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
        reasons = []
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"the triton backend supports float32, bfloat16 and float16, not {dtype}")
        if use_mla:  # head_size: the latent's kv_lora_rank + qk_rope_head_dim
            if not MIN_HEAD_SIZE <= head_size <= MAX_MLA_LATENT_SIZE:
                reasons.append(
                    f"an MLA latent of {head_size} (kv_lora_rank + qk_rope_head_dim) is not supported by the "
                    f"triton backend; use {MIN_HEAD_SIZE} to {MAX_MLA_LATENT_SIZE}"
                )
        elif not MIN_HEAD_SIZE <= head_size <= MAX_HEAD_SIZE:
            reasons.append(
                f"head_size {head_size} is not supported by the triton backend; use {MIN_HEAD_SIZE} to {MAX_HEAD_SIZE}"
            )
        if block_size not in BLOCK_SIZES:
            reasons.append(
                f"block_size {block_size} is not supported by the triton backend; use one of "
                + ", ".join(map(str, BLOCK_SIZES))
            )
        if device == "cpu" and not triton_mode.interpreted():
            reasons.append(
                "the triton backend runs on NVIDIA GPUs (device='cuda'); on the CPU only under "
                "TRITON_INTERPRET=1, Triton's interpreter, which is for tests"
            )
        elif device not in ("cpu", "cuda"):
            reasons.append(f"the triton backend runs on device 'cuda', not {device!r}")
        elif device == "cuda" and dtype == torch.bfloat16 and torch.cuda.is_available():
            major, minor = torch.cuda.get_device_capability()
            if major < 8:
                reasons.append(
                    f"bfloat16 needs an NVIDIA GPU of compute capability 8.0 or newer, this one is "
                    f"{major}.{minor}; use dtype='float16'"
                )
        return reasons

    @classmethod
    def check_available(cls) -> list[str]:
        return triton_mode.unavailable("its kernels")


def _load_kernels() -> ModuleType:
    """The kernels module (refuses a ``TRITON_INTERPRET`` that changed since Triton was imported)."""
    return triton_mode.load_kernels("vframe.backends.triton.kernels")
