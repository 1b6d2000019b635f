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

A float8 cache (``kv_cache_dtype="fp8"``, e4m3 or e5m2) is handed to the kernels
as bytes (``uint8``). The write kernel divides by the layer's ``k_scale`` /
``v_scale`` in float32 and rounds to nearest even in integer arithmetic
(``float8_bits``), saturating at the format's largest finite value: the bits
torch's ``clamp(...).to(float8)`` gives, on every GPU and under the interpreter
(whose own float8 conversion does not carry a rounding into the exponent). The
attention kernels widen the bytes exactly (``float8_value``) to the query's
dtype, ``k_scale`` folded into the softmax scale and ``v_scale`` into the output.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

TILE_N = 32  # keys per inner iteration, independent of the cache block size
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows on NVIDIA GPUs

# A float8 cache's format for the kernels: mantissa bits, exponent bias, largest finite value.
FLOAT8_FORMATS: dict[torch.dtype, tuple[int, int, float]] = {
    torch.float8_e4m3fn: (3, 7, 448.0),
    torch.float8_e5m2: (2, 15, 57344.0),
}


def cache_operand(kv_cache: torch.Tensor) -> tuple[torch.Tensor, int, int, float]:
    """``kv_cache`` as the kernels take it and its float8 format: a float8 cache as its
    bytes with ``(mantissa bits, bias, max)``, any other as it is with ``(0, 0, 0.0)``."""
    if kv_cache.dtype in FLOAT8_FORMATS:
        return (kv_cache.view(torch.uint8), *FLOAT8_FORMATS[kv_cache.dtype])
    return kv_cache, 0, 0, 0.0


@triton.jit
def float8_bits(x, MANT: tl.constexpr, BIAS: tl.constexpr, FP8_MAX: tl.constexpr):
    """``x`` (float32) as float8 bits (uint8) of the format with ``MANT`` mantissa bits
    and exponent bias ``BIAS``: rounded to nearest even, saturated at ``FP8_MAX``, NaN
    kept (code 0x7F with the sign, as torch writes it)."""
    sign = (x.to(tl.uint32, bitcast=True) >> 24) & 0x80
    mag = tl.minimum(tl.abs(x), FP8_MAX).to(tl.uint32, bitcast=True)
    exp = (mag >> 23).to(tl.int32)  # float32's biased exponent
    SHIFT: tl.constexpr = 23 - MANT  # mantissa bits dropped by a normal value
    # Normal in float8 (exponent >= 1 - BIAS): round at SHIFT, the carry running into
    # the exponent, then rebias from 127 to BIAS.
    normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - ((127 - BIAS) << MANT)
    # Subnormal (or zero): the significand with its leading one, shifted further by how far
    # the exponent lies below float8's smallest normal one (a carry makes that normal one).
    sig = (mag & 0x7FFFFF) | 0x800000
    shift = tl.minimum(SHIFT + (128 - BIAS) - exp, 31).to(tl.uint32)
    quot = sig >> shift
    rem = sig & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = quot + ((rem > half) | ((rem == half) & ((quot & 1) == 1))).to(tl.uint32)
    code = tl.where(exp >= 128 - BIAS, normal, sub)
    code = tl.where(x != x, 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def float8_value(b, MANT: tl.constexpr):
    """Float8 bytes ``b`` (uint8; ``MANT`` 3: e4m3fn, 2: e5m2) as float32, exactly. e5m2 is
    the top byte of a float16; e4m3's sign, exponent and mantissa sit one bit lower
    than float16's and its bias is 8 less: shifted into float16 and times 2^8."""
    h = b.to(tl.uint16)
    if MANT == 2:
        return (h << 8).to(tl.float16, bitcast=True).to(tl.float32)
    x = (((h & 0x80) << 8) | ((h & 0x7F) << 7)).to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where((h & 0x7F) == 0x7F, float("nan"), x)


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
def widen_kv(k, v, dtype: tl.constexpr, UPCAST_DOT: tl.constexpr, FP8_MANT: tl.constexpr):
    """Loaded key and value tiles in the dtype the dots take: float32 under
    ``UPCAST_DOT`` (exact: float32 holds every bfloat16 and float8), else the query's
    ``dtype``; float8 bytes (``FP8_MANT`` > 0) widened first."""
    if FP8_MANT > 0:
        k = float8_value(k, FP8_MANT)
        v = float8_value(v, FP8_MANT)
        if not UPCAST_DOT:  # exact: every float8 value is a bfloat16 and a float16
            k = k.to(dtype)
            v = v.to(dtype)
    elif UPCAST_DOT:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, KVH, D]
    value_ptr,
    cache_ptr,  # [2, num_blocks, block_size, KVH, D]; a float8 cache as uint8
    slot_mapping_ptr,  # [T] int64
    k_scale,  # float8 cache: stored key = key / k_scale, value / v_scale
    v_scale,
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
    FP8_MANT: tl.constexpr,  # 0: the cache holds the model's dtype; else float8_bits' format
    FP8_BIAS: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, HEAD_PAD)[None, :]
    mask = (h < NUM_KV_HEADS) & (d < HEAD_SIZE)
    k = tl.load(key_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    if FP8_MANT > 0:
        k = float8_bits(k.to(tl.float32) / k_scale, FP8_MANT, FP8_BIAS, FP8_MAX)
        v = float8_bits(v.to(tl.float32) / v_scale, FP8_MANT, FP8_BIAS, FP8_MAX)
    dst = cache_ptr + slot * stride_c_slot + h * stride_c_h + d
    tl.store(dst, k, mask=mask)
    tl.store(dst + stride_c_kv, v, mask=mask)


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [T, H, D]; or, with NUM_SPLITS > 1, partial_ptr [T, H, NUM_SPLITS, HEAD_PAD] float32
    max_ptr,  # [T, H, NUM_SPLITS] float32, running max per split (NUM_SPLITS > 1 only)
    sum_ptr,  # [T, H, NUM_SPLITS] float32, running sum per split (NUM_SPLITS > 1 only)
    query_ptr,  # [T, H, D]
    cache_ptr,  # [2, num_blocks, block_size, KVH, D]; a float8 cache as uint8
    block_table_ptr,  # [B, max_blocks] int32
    seq_lens_ptr,  # [B] int32
    query_start_loc_ptr,  # [B + 1] int32
    program_req_ptr,  # [P] int32, the request of each program
    program_q_off_ptr,  # [P] int32, its first query token, counted within the request
    scale_log2,  # scale * k_scale * log2(e): softmax in base 2
    v_scale,  # the output's factor (a float8 cache's calibrated v_scale, else 1.0)
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
    FP8_MANT: tl.constexpr,  # 0: the cache holds the query's dtype; else float8_value's format
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
        k = tl.load(k_base + slot_off[:, None] + d[None, :], mask=kv_mask, other=0)  # [TILE, HEAD_PAD]
        v = tl.load(k_base + stride_c_kv + slot_off[:, None] + d[None, :], mask=kv_mask, other=0)
        k, v = widen_kv(k, v, query_ptr.dtype.element_ty, UPCAST_DOT, FP8_MANT)
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2  # [BLOCK_M, TILE]
        allowed = pos_valid[None, :] & (pos[None, :] <= q_pos[:, None])
        if SLIDING_WINDOW > 0:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - SLIDING_WINDOW)
        s = tl.where(allowed, s, float("-inf"))

        p, alpha, m_i, l_i = online_softmax_step(s, m_i, l_i)
        if UPCAST_DOT:  # keep the rounding of p to the query's dtype that the GPU path has
            p_v = p.to(query_ptr.dtype.element_ty).to(tl.float32)
        else:
            p_v = p.to(v.dtype)
        acc = acc * alpha[:, None] + tl.dot(p_v, v, input_precision="ieee")

    if FP8_MANT > 0:
        acc = acc * v_scale
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token ``t``'s key and value at slot ``slot_mapping[t]``; into a float8
    cache ``key / k_scale`` and ``value / v_scale``, rounded (``float8_bits``)."""
    n, num_kv_heads, head_size = key.shape
    if n == 0:
        return
    cache, fp8_mant, fp8_bias, fp8_max = cache_operand(kv_cache)
    _write_kv_kernel[(n,)](
        key,
        value,
        cache,
        slot_mapping,
        k_scale,
        v_scale,
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
        FP8_MANT=fp8_mant,
        FP8_BIAS=fp8_bias,
        FP8_MAX=fp8_max,
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
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Causal paged attention of every program's query tokens (see the module docstring).

    ``program_req`` / ``program_q_off`` cover each request's new tokens in
    chunks of ``block_q`` (``plan_programs``). ``num_splits > 1`` splits each
    program's keys into that many shares run in parallel, then merged. A float8
    cache holds keys over ``k_scale`` and values over ``v_scale``; a cache of the
    query's dtype holds them as they are, and the scales go unused (as ``write_kv``)."""
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
    kv_cache, meta["FP8_MANT"], _, _ = cache_operand(kv_cache)
    if not meta["FP8_MANT"]:
        k_scale = v_scale = 1.0
    cache_strides = (kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
    grid = (num_programs, num_kv_heads, num_splits)
    scale_log2 = scale * k_scale * 1.4426950408889634
    if num_splits == 1:
        _paged_attention_kernel[grid](
            out, out, out, query, kv_cache, block_table, seq_lens, query_start_loc, program_req, program_q_off,
            scale_log2, v_scale, query.stride(0), query.stride(1), out.stride(0), out.stride(1), *cache_strides,
            block_table.stride(0), **meta,
        )  # fmt: skip
        return
    partial = torch.empty(num_tokens, num_heads, num_splits, head_pad, dtype=torch.float32, device=query.device)
    split_max = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=query.device)
    split_sum = torch.empty_like(split_max)
    _paged_attention_kernel[grid](
        partial, split_max, split_sum, query, kv_cache, block_table, seq_lens, query_start_loc, program_req,
        program_q_off, scale_log2, v_scale, query.stride(0), query.stride(1), partial.stride(0), partial.stride(1),
        *cache_strides, block_table.stride(0), **meta,
    )  # fmt: skip
    # Only the rows the programs covered are combined; every token of the step is covered.
    _combine_splits_kernel[(num_tokens, num_heads)](
        out, partial, split_max, split_sum, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, HEAD_SIZE=head_size, HEAD_PAD=head_pad, NUM_SPLITS=num_splits,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )  # fmt: skip
