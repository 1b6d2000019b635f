"""Triton kernel of multi-head latent attention over the paged latent cache.

The absorbed form (``MLAAttentionImpl``): every head attends over one shared
vector of ``R + P`` per token, ``R = kv_lora_rank`` latent then ``P =
qk_rope_head_dim`` rotated key, and the first ``R`` elements are the value::

    score = scale * (q[:R] . c[:R] + q[R:] . c[R:])      acc += p * c[:R]

One program serves ``BLOCK_Q`` query tokens of one request times ``BLOCK_H``
heads, as the rows of a ``[BLOCK_M, R]`` tile (row ``m``: token ``m //
BLOCK_H``, head ``m % BLOCK_H`` of the program's head block). Decodes take
``BLOCK_Q = 1`` and 16 heads a program (the latent is read once for 16
heads); prefill chunks 16 tokens of one head. The latent and the rotated part
are loaded as two tiles, each padded to a power of two, so that DeepSeek's
512 + 64 pads nothing. A float8 cache is read as bytes and widened exactly
(``kernels.float8_value``), its ``k_scale`` folded into the softmax scale and the
output.

Imported by the backend when the first MLA layer is built (see ``kernels.py``
for how ``TRITON_INTERPRET`` is read).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vframe.backends.triton.kernels import (
    INTERPRETED,
    MIN_DOT_ROWS,
    TILE_N,
    cache_operand,
    online_softmax_step,
    widen_kv,
)

DECODE_BLOCK_H = 16  # heads per program when each request has one query token


@triton.jit
def _mla_attention_kernel(
    out_ptr,  # [T, H, R]
    query_ptr,  # [T, H, R + P]
    cache_ptr,  # [num_blocks, block_size, R + P]; a float8 cache as uint8
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    program_req_ptr,  # [P] int32
    program_q_off_ptr,  # [P] int32
    scale_log2,  # scale * k_scale * log2(e)
    out_scale,  # a float8 cache's k_scale (the latent is the value), else 1.0
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_c_block,
    stride_c_off,
    stride_bt,
    NUM_HEADS: tl.constexpr,
    RANK: tl.constexpr,
    RANK_PAD: tl.constexpr,
    ROPE: tl.constexpr,
    ROPE_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_M: tl.constexpr,  # max(16, BLOCK_Q * BLOCK_H)
    TILE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    FP8_MANT: tl.constexpr,  # 0: the cache holds the query's dtype; else kernels.float8_value's format
):
    pid = tl.program_id(0)
    head_block = tl.program_id(1)
    req = tl.load(program_req_ptr + pid)
    q_off = tl.load(program_q_off_ptr + pid)
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len

    m = tl.arange(0, BLOCK_M)
    tok = q_off + m // BLOCK_H
    head = head_block * BLOCK_H + m % BLOCK_H
    row_valid = (m // BLOCK_H < BLOCK_Q) & (tok < q_len) & (head < NUM_HEADS)
    q_pos = context_len + tok
    r = tl.arange(0, RANK_PAD)
    p_dim = tl.arange(0, ROPE_PAD)
    r_valid = r < RANK
    p_valid = p_dim < ROPE

    q_rows = (q_start + tok).to(tl.int64) * stride_qt + head * stride_qh
    q_lat = tl.load(query_ptr + q_rows[:, None] + r[None, :], mask=row_valid[:, None] & r_valid[None, :], other=0.0)
    q_pe = tl.load(
        query_ptr + q_rows[:, None] + RANK + p_dim[None, :], mask=row_valid[:, None] & p_valid[None, :], other=0.0
    )
    if UPCAST_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)

    kv_end = tl.minimum(seq_len, context_len + q_off + BLOCK_Q)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, RANK_PAD], dtype=tl.float32)
    for t in range(0, tl.cdiv(kv_end, TILE)):
        pos = t * TILE + tl.arange(0, TILE)
        pos_valid = pos < kv_end
        # Only written positions are loaded: stale slots (NaN) are never read.
        block = tl.load(block_table_ptr + req * stride_bt + pos // BLOCK_SIZE, mask=pos_valid, other=0)
        slot_off = block.to(tl.int64) * stride_c_block + (pos % BLOCK_SIZE) * stride_c_off  # [TILE]
        c = tl.load(cache_ptr + slot_off[:, None] + r[None, :], mask=pos_valid[:, None] & r_valid[None, :], other=0)
        k_pe = tl.load(
            cache_ptr + slot_off[:, None] + RANK + p_dim[None, :], mask=pos_valid[:, None] & p_valid[None, :], other=0
        )
        c, k_pe = widen_kv(c, k_pe, query_ptr.dtype.element_ty, UPCAST_DOT, FP8_MANT)
        s = tl.dot(q_lat, tl.trans(c), input_precision="ieee")
        s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        s = s * scale_log2  # [BLOCK_M, TILE]
        allowed = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))

        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        if UPCAST_DOT:
            p_v = p.to(query_ptr.dtype.element_ty).to(tl.float32)
        else:
            p_v = p.to(c.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_v, c, input_precision="ieee")

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if FP8_MANT > 0:
        out = out * out_scale
    o_rows = (q_start + tok).to(tl.int64) * stride_ot + head * stride_oh
    o_mask = row_valid[:, None] & r_valid[None, :]
    tl.store(out_ptr + o_rows[:, None] + r[None, :], out.to(out_ptr.dtype.element_ty), mask=o_mask)


def mla_attention(
    out: torch.Tensor,  # [T, H, R]
    query: torch.Tensor,  # [T, H, R + P]
    kv_cache: torch.Tensor,  # [num_blocks, block_size, R + P]
    block_table: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32
    query_start_loc: torch.Tensor,  # [B + 1] int32
    program_req: torch.Tensor,  # [P] int32
    program_q_off: torch.Tensor,  # [P] int32
    *,
    block_q: int,
    kv_lora_rank: int,
    scale: float,
    k_scale: float = 1.0,
) -> None:
    """Causal MLA of every program's query tokens (see the module docstring); a float8
    cache holds the latent over ``k_scale`` (a cache of the query's dtype: ``k_scale`` unused)."""
    num_heads = query.shape[1]
    rope = query.shape[2] - kv_lora_rank
    num_programs = program_req.shape[0]
    if num_programs == 0:
        return
    block_h = min(DECODE_BLOCK_H, triton.next_power_of_2(num_heads)) if block_q == 1 else 1
    grid = (num_programs, triton.cdiv(num_heads, block_h))
    cache, fp8_mant, _, _ = cache_operand(kv_cache)
    if not fp8_mant:
        k_scale = 1.0
    _mla_attention_kernel[grid](
        out, query, cache, block_table, seq_lens, query_start_loc, program_req, program_q_off,
        scale * k_scale * 1.4426950408889634, k_scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), block_table.stride(0),
        NUM_HEADS=num_heads,
        RANK=kv_lora_rank,
        RANK_PAD=max(16, triton.next_power_of_2(kv_lora_rank)),
        ROPE=rope,
        ROPE_PAD=max(16, triton.next_power_of_2(rope)),
        BLOCK_SIZE=kv_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_M=max(MIN_DOT_ROWS, block_q * block_h),
        TILE=TILE_N,
        UPCAST_DOT=INTERPRETED and query.dtype == torch.bfloat16,
        FP8_MANT=fp8_mant,
    )  # fmt: skip
