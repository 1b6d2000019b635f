"""Paged attention on the CPU without gathers.

A step's decodes (one query token each) go to ``torch.ops.vframe_cpu.paged_decode_attention``,
which reads each request's keys and values where they lie in the cache, through
its block table: no copy of whole blocks into padded tensors, no mask over the
padding, and one pass over each K/V row for all the query heads that share it.
Requests with more query tokens (prefills and chunks of them) are attended as the
``torch`` backend does it, with ``scaled_dot_product_attention``.

The operator is compiled once per machine with the system's C++ compiler
(``build.py``); where none is found the backend refuses in ``check_available``
and ``attention_backend=auto`` takes ``torch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vframe.backends.torch_attn import (
    TorchAttentionBackend,
    TorchAttentionImpl,
    TorchAttentionMetadata,
    attend_prefills,
    kv_cache_views,
    write_kv_cache,
)
from vframe.core.interfaces import (
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)


@dataclass
class CpuPagedMetadata:
    """The plan of one step: the torch plan of its prefills, and its decodes."""

    prefill_plan: TorchAttentionMetadata  # decode_groups empty
    block_table: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] int32
    decode_req_ids: torch.Tensor  # [n] int64, rows of block_table / seq_lens
    decode_rows: torch.Tensor  # [n] int64, their query rows

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata, sliding_window: int | None = None) -> CpuPagedMetadata:
        qsl = common.query_start_loc_cpu
        decodes = [b for b in range(common.num_reqs) if qsl[b + 1] - qsl[b] == 1]
        return cls(
            prefill_plan=TorchAttentionMetadata.from_common(common, sliding_window, plan_decodes=False),
            block_table=common.block_table.to(torch.int32).contiguous(),
            seq_lens=common.seq_lens.to(torch.int32).contiguous(),
            decode_req_ids=torch.tensor(decodes, dtype=torch.long),
            decode_rows=torch.tensor([qsl[b] for b in decodes], dtype=torch.long),
        )


class CpuPagedMetadataBuilder(AttentionMetadataBuilder):
    def build(self, common: CommonAttentionMetadata) -> CpuPagedMetadata:
        return CpuPagedMetadata.from_common(common)


class CpuPagedAttentionImpl(TorchAttentionImpl):
    # The cache tensor last seen, its K and V halves and the decode operator, looked up
    # once (a decode step of a small model calls forward a few dozen times).
    _kv_views: tuple[torch.Tensor, torch.Tensor, torch.Tensor, Any] | None = None

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
            meta = CpuPagedMetadata.from_common(meta, self.sliding_window)
        prefill_plan = meta.prefill_plan
        if self.sliding_window is not None and prefill_plan.prefills:
            # The shared plan has no window; a windowed layer plans its own prefill masks.
            prefill_plan = TorchAttentionMetadata.from_common(prefill_plan.common, self.sliding_window, False)

        output = torch.empty_like(query)  # every token's row is written below (a decode or a prefill)
        if prefill_plan.num_actual_tokens < output.shape[0]:
            output[prefill_plan.num_actual_tokens :] = 0  # padding rows past the step's tokens stay zero
        write_kv_cache(key, value, kv_cache, prefill_plan.slot_mapping)
        if prefill_plan.prefills:
            attend_prefills(output, query, key, value, *kv_cache_views(kv_cache), prefill_plan.prefills, self.scale)
        if meta.decode_req_ids.numel():
            views = self._kv_views
            if views is None or views[0] is not kv_cache:
                decode = torch.ops.vframe_cpu.paged_decode_attention.default
                views = self._kv_views = (kv_cache, kv_cache[0], kv_cache[1], decode)
            _, key_cache, value_cache, decode = views
            decode(
                output, query, key_cache, value_cache, meta.block_table, meta.seq_lens,
                meta.decode_req_ids, meta.decode_rows, self.scale, self.sliding_window or 0,
            )  # fmt: skip
        return output


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
