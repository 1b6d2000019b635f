"""The torch attention backend: the conformance kit's checks, its plan, padding rows."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from vframe.backends.torch_attn import (
    TorchAttentionBackend,
    TorchAttentionImpl,
    TorchAttentionMetadata,
    _plan_decodes,
)
from vframe.core.interfaces import CommonAttentionMetadata
from vframe.testing.attention import check_attention_backend, reference_attention

NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE = 6, 2, 16
NUM_BLOCKS = 64

# (context_len, query_len): prefills without and with cached context, decodes.
MIXED = [(0, 7), (5, 6), (13, 1), (0, 1), (30, 1), (17, 9), (2, 1), (0, 3)]


@dataclass
class Batch:
    query: torch.Tensor  # [T, H, D]
    key: torch.Tensor  # [T, KVH, D]
    value: torch.Tensor  # [T, KVH, D]
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, KVH, D]
    expected_cache: torch.Tensor  # the cache after this step's keys/values are written
    common: CommonAttentionMetadata
    full_keys: list[torch.Tensor]  # per request [seq_len, KVH, D]: cached + new
    full_values: list[torch.Tensor]


def make_batch(
    reqs: list[tuple[int, int]], block_size: int, dtype: torch.dtype, num_pad_tokens: int = 0
) -> Batch:
    gen = torch.Generator().manual_seed(block_size * 1000 + len(reqs))
    free_blocks = torch.randperm(NUM_BLOCKS, generator=gen).tolist()  # non-contiguous block ids
    cache_shape = TorchAttentionBackend.get_kv_cache_shape(NUM_BLOCKS, block_size, NUM_KV_HEADS, HEAD_SIZE)
    kv_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    expected_cache = kv_cache.clone()

    block_tables, slot_mapping, full_keys, full_values = [], [], [], []
    queries, keys, values = [], [], []
    for context_len, query_len in reqs:
        seq_len = context_len + query_len
        blocks = [free_blocks.pop() for _ in range(-(-seq_len // block_size))]
        slots = [blocks[p // block_size] * block_size + p % block_size for p in range(seq_len)]
        k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
        for which, full in ((0, k), (1, v)):
            expected = expected_cache[which].view(-1, NUM_KV_HEADS, HEAD_SIZE)
            expected[slots] = full
            cached = kv_cache[which].view(-1, NUM_KV_HEADS, HEAD_SIZE)
            cached[slots[:context_len]] = full[:context_len]
        queries.append(torch.randn(query_len, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype))
        keys.append(k[context_len:])
        values.append(v[context_len:])
        slot_mapping += slots[context_len:]
        block_tables.append(blocks)
        full_keys.append(k)
        full_values.append(v)

    queries.append(torch.zeros(num_pad_tokens, NUM_HEADS, HEAD_SIZE, dtype=dtype))
    keys.append(torch.zeros(num_pad_tokens, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype))
    values.append(torch.zeros(num_pad_tokens, NUM_KV_HEADS, HEAD_SIZE, dtype=dtype))

    max_blocks = max(len(b) for b in block_tables)
    block_table = torch.zeros(len(reqs), max_blocks, dtype=torch.int32)
    for i, blocks in enumerate(block_tables):
        block_table[i, : len(blocks)] = torch.tensor(blocks)
    query_lens = [q for _, q in reqs]
    seq_lens = [c + q for c, q in reqs]
    query_start_loc = [0]
    for q in query_lens:
        query_start_loc.append(query_start_loc[-1] + q)
    common = CommonAttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor([c for c, _ in reqs], dtype=torch.int32),
        block_table=block_table,
        slot_mapping=torch.tensor(slot_mapping + [0] * num_pad_tokens, dtype=torch.int64),
        num_reqs=len(reqs),
        num_actual_tokens=sum(query_lens),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )
    return Batch(
        torch.cat(queries), torch.cat(keys), torch.cat(values),
        kv_cache, expected_cache, common, full_keys, full_values,
    )


def reference(batch: Batch, scale: float) -> torch.Tensor:  # [T, H, D] float32
    qsl = batch.common.query_start_loc_cpu
    return torch.cat([
        reference_attention(batch.query[qsl[b] : qsl[b + 1]], batch.full_keys[b], batch.full_values[b], scale)
        for b in range(batch.common.num_reqs)
    ])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passes_the_conformance_kit(dtype: torch.dtype) -> None:
    # prefills, cached prefixes, decodes, mixed steps, GQA/MQA/MHA, sliding window,
    # five head sizes and three block sizes, over a NaN-filled cache
    check_attention_backend("torch", dtype=dtype)


def test_plan_separates_prefills_from_decodes() -> None:
    meta = TorchAttentionMetadata.from_common(make_batch(MIXED, 4, torch.float32).common)

    assert [(p.query_start, p.query_end, p.context_len) for p in meta.prefills] == [
        (0, 7, 0), (7, 13, 5), (16, 25, 17), (26, 29, 0)
    ]
    assert meta.prefills[0].slots is None  # no cached context: no gather
    # Decodes sorted by length, one per group here; each gathers whole blocks
    # of 4 tokens up to its own length.
    groups = meta.decode_groups
    assert [g.token_idx.tolist() for g in groups] == [[14], [25], [13], [15]]
    assert [g.mask[:, 0, 0, :].sum(-1).tolist() for g in groups] == [[1], [3], [14], [31]]
    assert [g.block_ids.numel() for g in groups] == [1, 1, 4, 8]
    # gathered slots past each length (the last block's tail) are zeroed
    assert [g.unwritten_rows.tolist() for g in groups] == [[1, 2, 3], [3], [14, 15], [31]]


def test_decode_table_padding_reads_the_requests_own_first_block() -> None:
    # 2 and 9 tokens in blocks of 4, one group: the short request's padding
    # re-reads its only block, and all of its slots from offset 2 on are zeroed.
    block_table = torch.tensor([[5, 0, 0], [7, 3, 8]])

    group = _plan_decodes([0, 1], [0, 1, 2], [2, 9], block_table, 4, None)

    assert group.block_ids.tolist() == [5, 5, 5, 7, 3, 8]
    assert group.unwritten_rows.tolist() == [2, 3, 6, 7, 10, 11, 21, 22, 23]


def test_padding_tokens_are_not_written_and_output_zero() -> None:
    batch = make_batch(MIXED, 16, torch.float32, num_pad_tokens=3)
    impl = TorchAttentionImpl(NUM_HEADS, HEAD_SIZE, 0.25, NUM_KV_HEADS)

    out = impl.forward(batch.query, batch.key, batch.value, batch.kv_cache, batch.common)

    n = batch.common.num_actual_tokens
    torch.testing.assert_close(batch.kv_cache, batch.expected_cache, rtol=0, atol=0)
    assert out[n:].abs().sum() == 0
    torch.testing.assert_close(out[:n], reference(batch, 0.25)[:n], rtol=0, atol=1e-5)


def test_backend_static_answers() -> None:
    assert TorchAttentionBackend.name == "torch"
    assert TorchAttentionBackend.get_kv_cache_shape(10, 16, 2, 64) == (2, 10, 16, 2, 64)
    assert TorchAttentionBackend.check_available() == []
    assert TorchAttentionBackend.validate_configuration(
        head_size=64, dtype=torch.bfloat16, device="cpu", block_size=16
    ) == []
    # MLA (plugin API 1.3): served by torch_mla.py, head_size being the latent's R + P
    assert TorchAttentionBackend.validate_configuration(
        head_size=576, dtype=torch.float32, device="cpu", block_size=16, use_mla=True
    ) == []
