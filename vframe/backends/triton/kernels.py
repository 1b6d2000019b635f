"""Triton kernels of the paged attention backend, and the functions that launch them.

Importing this module imports Triton and decorates the kernels. Triton decides
then, from ``TRITON_INTERPRET``, whether they are compiled for the GPU or run
by its interpreter on CPU tensors (tests): ``INTERPRETED`` records which.

KV cache of one layer: ``[2, num_blocks, block_size, KVH, D]``; the token at
position ``p`` of request ``b`` sits in block ``block_table[b, p // block_size]``
at offset ``p % block_size``.

One attention program serves up to ``BLOCK_Q`` consecutive query tokens of one
request and the ``H // KVH`` query heads that read one KV head, as the rows of a
``[BLOCK_M, D]`` tile (row ``m``: token ``m // GROUP_PAD``, head ``m % GROUP_PAD``
of the group)::

    request b:  | cached: context | new: q_len |
    program (b, q_off):   tokens q_off .. q_off + BLOCK_Q - 1 of the new ones
    keys read:  0 .. context + q_off + BLOCK_Q - 1 (causal), TILE_N at a time

With ``NUM_SPLITS > 1`` (flash-decoding) each program reads only its share of
those key tiles and writes an unnormalised partial result with its running max
and sum; ``_combine_splits_kernel`` merges the shares.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

TILE_N = 32  # keys per inner iteration, independent of the cache block size
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows on NVIDIA GPUs


@triton.jit
def online_softmax_step(s, m_i, l_i):
    """One key tile of the online softmax, in base 2: ``s [M, TILE]`` scores
    (``-inf`` where not allowed), ``m_i``/``l_i [M]`` the running max and sum.
    Returns the tile's probabilities ``p`` (relative to the new max), ``alpha``,
    the factor the accumulator is rescaled by, and the new max and sum."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # A row with nothing allowed yet keeps max -inf: shift by 0 so that its
    # probabilities are exp2(-inf) = 0, not exp2(-inf - -inf) = NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(s - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,
    cache_ptr,  # [2, num_blocks, block_size, KVH, D]
    slot_mapping_ptr,  # [T] int64
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_c_kv,
    stride_c_slot,
    stride_c_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    dst = cache_ptr + slot * stride_c_slot + h * stride_c_h + d
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]; or, with NUM_SPLITS > 1, partial_ptr [T, H, NUM_SPLITS, HEAD_PAD] float32
    max_ptr,  # [T, H, NUM_SPLITS] float32, running max per split (NUM_SPLITS > 1 only)
    sum_ptr,  # [T, H, NUM_SPLITS] float32, running sum per split (NUM_SPLITS > 1 only)
    query_ptr,  # [T, H, D]
    cache_ptr,  # [2, num_blocks, block_size, KVH, D]
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    program_req_ptr,  # [P] int32, the request of each program
    program_q_off_ptr,  # [P] int32, its first query token, counted within the request
    scale_log2,  # scale * log2(e): softmax in base 2
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_kv,
    stride_c_block,
    stride_c_off,
    stride_c_h,
    stride_bt,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_M: tl.constexpr,  # rows per program: max(16, BLOCK_Q * GROUP_PAD)
    TILE: tl.constexpr,  # keys per iteration
    SLIDING_WINDOW: tl.constexpr,  # 0: none
    NUM_SPLITS: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter and bfloat16: its tl.dot gets bfloat16 wrong
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = tl.load(program_req_ptr + pid)
    q_off = tl.load(program_q_off_ptr + pid)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    tok = q_off + m // GROUP_PAD  # [BLOCK_M], within the request's new tokens
    g = m % GROUP_PAD
    row_valid = (m // GROUP_PAD < BLOCK_Q) & (tok < q_len) & (g < GROUP)
    head = kv_head * GROUP + g
    q_pos = context_len + tok  # [BLOCK_M], positions in the sequence
    d = tl.arange(0, HEAD_PAD)
    d_valid = d < HEAD_SIZE

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q = tl.load(query_ptr + q_rows[:, None] + d[None, :], mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)

    # Keys this program can see: up to its last query's position, and (window) from
    # its first query's window start on.
    kv_end = tl.minimum(seq_len, context_len + q_off + BLOCK_Q)
    kv_start = 0
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(context_len + q_off - SLIDING_WINDOW + 1, 0)
    tile_lo = kv_start // TILE
    tile_hi = tl.cdiv(kv_end, TILE)
    if NUM_SPLITS > 1:
        per_split = tl.cdiv(tile_hi - tile_lo, NUM_SPLITS)
        tile_lo = tile_lo + split * per_split
        tile_hi = tl.minimum(tile_hi, tile_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    k_base = cache_ptr + kv_head * stride_c_h
    for t in range(tile_lo, tile_hi):
        pos = t * TILE + tl.arange(0, TILE)  # [TILE]
        pos_valid = pos < kv_end
        # Only positions below seq_len are loaded: the slots behind them were
        # written; everything else (padding, stale NaN) is never read.
        block = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=pos_valid, other=0)
        slot_off = block.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_off  # [TILE]
        kv_mask = pos_valid[:, None] & d_valid[None, :]
        k = tl.load(k_base + slot_off[:, None] + d[None, :], mask=kv_mask, other=0.0)  # [TILE, HEAD_PAD]
        v = tl.load(k_base + stride_c_kv + slot_off[:, None] + d[None, :], mask=kv_mask, other=0.0)

        if UPCAST_DOT:  # exact: float32 holds every bfloat16
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, TILE]
        allowed = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(allowed, s, float("-inf"))

        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        if UPCAST_DOT:  # keep the rounding of p to the cache dtype that the GPU path has
            p_v = p.to(cache_ptr.dtype.element_ty).to(tl.float32)
        else:
            p_v = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision="ieee")

    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_mask = row_valid[:, None] & d_valid[None, :]
        tl.store(out_ptr + o_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # partial_ptr rows are [NUM_SPLITS, HEAD_PAD] per (token, head): stride_oh covers them.
        tl.store(
            out_ptr + o_rows[:, None] + split * HEAD_PAD + d[None, :], acc, mask=row_valid[:, None]
        )
        stat_rows = (q_start + tok).to(tl.int64) * (GROUP * tl.num_programs(1) * NUM_SPLITS)
        stat_rows += head * NUM_SPLITS + split
        tl.store(max_ptr + stat_rows, m_i, mask=row_valid)
        tl.store(sum_ptr + stat_rows, l_i, mask=row_valid)


@triton.jit
def _combine_splits_kernel(
    out_ptr,  # [T, H, D]
    partial_ptr,  # [T, H, NUM_SPLITS, HEAD_PAD] float32
    max_ptr,  # [T, H, NUM_SPLITS] float32
    sum_ptr,  # [T, H, NUM_SPLITS] float32
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    HEAD_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, HEAD_PAD)
    row = (t.to(tl.int64) * NUM_HEADS + h) * NUM_SPLITS
    split_max = tl.load(max_ptr + row + s, mask=s < NUM_SPLITS, other=float("-inf"))
    split_sum = tl.load(sum_ptr + row + s, mask=s < NUM_SPLITS, other=0.0)
    total_max = tl.max(split_max, 0)
    # A split that saw no key has max -inf and weight 0.
    weight = tl.where(split_max == float("-inf"), 0.0, tl.math.exp2(split_max - total_max))  # [SPLITS_PAD]
    total = tl.sum(weight * split_sum, 0)
    partial = tl.load(
        partial_ptr + (row + s[:, None]) * HEAD_PAD + d[None, :], mask=s[:, None] < NUM_SPLITS, other=0.0
    )  # [SPLITS_PAD, HEAD_PAD]
    out = tl.sum(weight[:, None] * partial, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_SIZE)


def write_kv(
    key: torch.Tensor,  # [n, KVH, D]
    value: torch.Tensor,  # [n, KVH, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
    slot_mapping: torch.Tensor,  # [n] int64
) -> None:
    """Write token ``t``'s key and value at slot ``slot_mapping[t]``."""
    n, num_kv_heads, head_size = key.shape
    if n == 0:
        return
    _write_kv_kernel[(n,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(2),
        kv_cache.stride(3),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_SIZE=head_size,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_PAD=triton.next_power_of_2(head_size),
    )


def paged_attention(
    out: torch.Tensor,  # [T, H, D], written for the rows of the programs' tokens
    query: torch.Tensor,  # [T, H, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    program_req: torch.Tensor,  # [P] int32
    program_q_off: torch.Tensor,  # [P] int32
    *,
    block_q: int,
    scale: float,
    sliding_window: int | None = None,
    num_splits: int = 1,
) -> None:
    """Causal paged attention of every program's query tokens (see the module docstring).

    ``program_req`` / ``program_q_off`` cover each request's new tokens in
    chunks of ``block_q`` (``plan_programs``). ``num_splits > 1`` splits each
    program's keys into that many shares run in parallel, then merged."""
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = kv_cache.shape[3], kv_cache.shape[2]
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_pad = triton.next_power_of_2(head_size)
    num_programs = program_req.shape[0]
    if num_programs == 0:
        return
    meta = dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_SIZE=head_size,
        HEAD_PAD=head_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        BLOCK_M=max(MIN_DOT_ROWS, block_q * group_pad),
        TILE=TILE_N,
        SLIDING_WINDOW=sliding_window or 0,
        NUM_SPLITS=num_splits,
        UPCAST_DOT=INTERPRETED and query.dtype == torch.bfloat16,
    )
    cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    grid = (num_programs, num_kv_heads, num_splits)
    scale_log2 = scale * 1.4426950408889634
    if num_splits == 1:
        _paged_attention_kernel[grid](
            out, out, out, query, kv_cache, block_table, seq_lens, query_start_loc, program_req, program_q_off,
            scale_log2, query.stride(0), query.stride(1), out.stride(0), out.stride(1), *cache_strides,
            block_table.stride(0), **meta,
        )  # fmt: skip
        return
    partial = torch.empty(num_tokens, num_heads, num_splits, head_pad, dtype=torch.float32, device=query.device)
    split_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    split_sum = torch.empty_like(split_max)
    _paged_attention_kernel[grid](
        partial, split_max, split_sum, query, kv_cache, block_table, seq_lens, query_start_loc, program_req,
        program_q_off, scale_log2, query.stride(0), query.stride(1), partial.stride(0), partial.stride(1),
        *cache_strides, block_table.stride(0), **meta,
    )  # fmt: skip
    # Only the rows the programs covered are combined; every token of the step is covered.
    _combine_splits_kernel[(num_tokens, num_heads)](
        out, partial, split_max, split_sum, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )  # fmt: skip
