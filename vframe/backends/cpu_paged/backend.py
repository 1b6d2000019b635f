"""Paged attention on the CPU without gathers.

Every request's keys and values are read where they lie in the cache, through its block
table: no copy of whole blocks into padded tensors, no mask over the padding. A step's
decodes (one query token each) go to ``torch.ops.vframe_cpu.paged_decode_attention``, which
reads each K/V row once for all the query heads that share it; its prefills (a prompt, or a
chunk of one over its cached prefix) to ``paged_prefill_attention``, causal within each
request (and its sliding window), a tile of query tokens and their heads against each K/V row.
Where the kernel scores a tile's rows one dot product at a time (AVX2 CPUs), past
``KERNEL_MAX_SEQ_LEN`` tokens of context a prefill in a layer without a window is attended
as the ``torch`` backend does (SDPA, whose GEMM tiles win there; a cached prefix gathered),
since those dot products do about as much work per key as SDPA's at 1,024 tokens and fall
behind after (AVX2 EPYC, 2 threads, SmolLM2's heads, one prompt: 256 tokens 1.0 against 1.25
ms, 512 4.9 against 9.2, 1,024 about even, 2,048 94 against 82). With AVX-512 its tiles are
small matrix products that stay ahead at every length (Zen 4, bfloat16, one prompt's whole
forward: 2,048 tokens 2.52-2.56 s against SDPA's 2.73-3.10, 3,072 4.40-4.49 against 5.11-5.29):
no limit there (``kernel_max_seq_len``).

The operators are compiled once per machine with the system's C++ compiler
(``build.py``); where none is found the backend refuses in ``check_available``
and ``attention_backend=auto`` takes ``torch``, which stays the reference the tests
compare against.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Any

import torch

from vframe.backends.torch_attn import (
    PrefillSpan,
    TorchAttentionBackend,
    TorchAttentionImpl,
    attend_prefills,
    kv_cache_views,
    plan_prefill,
    scaled_output,
    write_kv_cache,
)
from vframe.core.interfaces import AttentionImpl, AttentionMetadataBuilder, CommonAttentionMetadata


# Longest context (cached and new tokens) a prefill takes the C++ row kernel for in a layer
# without a sliding window; longer ones take SDPA (module docstring).
KERNEL_MAX_SEQ_LEN = 1024


@functools.cache
def kernel_max_seq_len() -> int:
    """``KERNEL_MAX_SEQ_LEN``, or no limit where the operators take the AVX-512 tiles."""
    return sys.maxsize if torch.ops.vframe_cpu.prefill_tiles() else KERNEL_MAX_SEQ_LEN


@dataclass
class CpuPagedMetadata:
    """The plan of one step, shared by every layer: which requests decode, which prefill."""

    common: CommonAttentionMetadata
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, where each new token's K/V goes
    num_actual_tokens: int
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    decode_req_ids: torch.Tensor  # [n] int64, rows of block_table / seq_lens
    decode_rows: torch.Tensor  # [n] int64, their query rows
    # Requests with more than one query token, their first query rows and their query tokens
    # ([p] int64 each): every one for a layer with a window; for one without, the kernel's
    # (at most kernel_max_seq_len() tokens of context) and SDPA's (longer).
    prefills: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    short_prefills: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    long_prefills: list[PrefillSpan]

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata) -> CpuPagedMetadata:
        qsl, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
        decodes, prefills = [], []
        for b in range(common.num_reqs):
            query_len = qsl[b + 1] - qsl[b]
            if query_len == 1:
                decodes.append(b)
            elif query_len > 1:
                prefills.append(b)
        limit = kernel_max_seq_len()
        short = [b for b in prefills if seq_lens[b] <= limit]
        long_prefills = []
        if len(short) < len(prefills):
            block_table = common.block_table.to(device=common.slot_mapping.device, dtype=torch.long)
            long_prefills = [
                plan_prefill(qsl[b], qsl[b + 1], seq_lens[b], block_table[b], common.block_size, None)
                for b in prefills if seq_lens[b] > limit
            ]
        all_prefills = cls._prefill_vectors(prefills, qsl)
        return cls(
            common=common,
            slot_mapping=common.slot_mapping[: common.num_actual_tokens].long(),
            num_actual_tokens=common.num_actual_tokens,
            block_table=common.block_table.to(torch.int32).contiguous(),
            seq_lens=common.seq_lens.to(torch.int32).contiguous(),
            decode_req_ids=torch.tensor(decodes, dtype=torch.long),
            decode_rows=torch.tensor([qsl[b] for b in decodes], dtype=torch.long),
            prefills=all_prefills,
            short_prefills=all_prefills if not long_prefills else cls._prefill_vectors(short, qsl),
            long_prefills=long_prefills,
        )

    @staticmethod
    def _prefill_vectors(reqs: list[int], qsl: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Requests ``reqs``, their first query rows and their query tokens, as int64 vectors."""
        return (
            torch.tensor(reqs, dtype=torch.long),
            torch.tensor([qsl[b] for b in reqs], dtype=torch.long),
            torch.tensor([qsl[b + 1] - qsl[b] for b in reqs], dtype=torch.long),
        )


class CpuPagedMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> CpuPagedMetadata:
        return CpuPagedMetadata.from_common(common)


class CpuPagedAttentionImpl(TorchAttentionImpl):
    # The cache tensor last seen, its K and V halves and the two operators, looked up
    # once (a decode step of a small model calls forward a few dozen times).
    _kv_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any, Any] | None = None

    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        attn_metadata: Any,  # CpuPagedMetadata (or CommonAttentionMetadata, planned here)
    ) -> torch.Tensor:  # [T, H, D]
        meta = attn_metadata
        if isinstance(meta, CommonAttentionMetadata):
            meta = CpuPagedMetadata.from_common(meta)
        output = torch.empty_like(query)  # every token's row is written below (a decode or a prefill)
        if meta.num_actual_tokens < output.shape[0]:
            output[meta.num_actual_tokens :] = 0  # padding rows past the step's tokens stay zero
        query, key, value, scale, factor = self.kv_cache_domain(query, key, value, kv_cache)
        write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        views = self._kv_views
        if views is None or views[0] is not kv_cache:
            ops = torch.ops.vframe_cpu
            views = self._kv_views = (
                kv_cache, kv_cache[0], kv_cache[1], ops.paged_decode_attention.default, ops.paged_prefill_attention.default,
            )  # fmt: skip
        _, key_cache, value_cache, decode, prefill = views
        window = self.sliding_window or 0
        # A windowed layer keeps every prefill on the kernel (SDPA's causal path has no window).
        prefills = meta.prefills if window else meta.short_prefills
        if prefills[0].numel():
            prefill(
                output, query, key_cache, value_cache, meta.block_table, meta.seq_lens, *prefills, scale, window,
            )  # fmt: skip
        if meta.long_prefills and not window:
            attend_prefills(output, query, key, value, *kv_cache_views(kv_cache), meta.long_prefills, scale)
        if meta.decode_req_ids.numel():
            decode(
                output, query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                meta.decode_req_ids, meta.decode_rows, scale, window,
            )  # fmt: skip
        return scaled_output(output, factor)


class CpuPagedAttentionBackend(TorchAttentionBackend):
    name = "cpu_paged"

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return CpuPagedMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return CpuPagedAttentionImpl

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
        reasons = super().validate_configuration(
            head_size=head_size, dtype=dtype, device=device, block_size=block_size, use_mla=use_mla
        )
        if kv_cache_dtype != "auto" and dtype == torch.float16:
            reasons.append(
                f"the cpu_paged backend reads a float8 KV cache (kv_cache_dtype={kv_cache_dtype!r}) for float32 and "
                "bfloat16 models only, not float16; use dtype='bfloat16', or attention_backend='torch'"
            )
        if device != "cpu":
            reasons.append(f"the cpu_paged backend runs on the CPU only, not on {device}")
        if use_mla:
            reasons.append("the cpu_paged backend has no multi-head latent attention path (the torch backend has)")
        return reasons

    @classmethod
    def check_available(cls) -> list[str]:
        from vframe.backends.cpu_paged.build import BuildError, load_ops

        try:
            load_ops()
        except BuildError as e:
            return [str(e)]
        return []
