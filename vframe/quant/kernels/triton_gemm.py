"""The Triton kernel of the ``triton`` quant kernel (``vframe/quant/kernels/gpu.py``): a
weight-only GEMM that reads the packed weight in place and dequantizes each tile as it
multiplies, for the integer, FP8 and FP4 forms of ``vframe.quant.kernels``.

Importing this module imports Triton and decorates the kernel; Triton decides then, from
``TRITON_INTERPRET``, whether it is compiled for the GPU or interpreted on CPU tensors
(tests): ``INTERPRETED`` records which.

One program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``out = x @ W.T``, ``BLOCK_K`` inputs
at a time::

    x tile [BLOCK_M, BLOCK_K] (the activations' dtype)
    codes [BLOCK_K, BLOCK_N] -> W tile = decode(codes) * scale (+ offset), float32,
                                rounded to the activations' dtype as the reference rounds W
    acc [BLOCK_M, BLOCK_N] float32 += dot(x tile, W tile)

The weight is stored ``[out, in]`` as the checkpoint has it: one byte an input (8-bit
integers, e4m3), or two (4-bit integers, FP4 codes: input ``2j`` in the low nibble of byte
``j``). An input's group is ``k // group_size``, or ``groups[k]`` (act order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

INTERPRETED: bool = bool(triton.knobs.runtime.interpret)

FORMAT_INT = 0  # scale * (q - 2**(bits - 1)) (+ offset); scales float32
FORMAT_FP8 = 1  # e4m3(q) * scale; scales float32
FORMAT_NVFP4 = 2  # e2m1(q) * (e4m3(scale byte) / global scale)
FORMAT_MXFP4 = 3  # e2m1(q) * 2 ** (scale byte - 127)


@triton.jit
def _e4m3(code):
    """float32 values of e4m3fn bytes (int32): sign, 4 exponent bits (bias 7), 3 mantissa
    bits; exponent 0 is subnormal (mantissa * 2**-9), 0x7F / 0xFF are NaN."""
    exponent = (code >> 3) & 0xF
    mantissa = (code & 7).to(tl.float32)
    # 2 ** (exponent - 7) built from its bits (exact), then 1 + mantissa / 8 times it
    power = ((exponent + 120) << 23).to(tl.float32, bitcast=True)
    magnitude = tl.where(exponent == 0, mantissa * 0.001953125, (1.0 + mantissa * 0.125) * power)
    magnitude = tl.where((code & 0x7F) == 0x7F, float("nan"), magnitude)
    return tl.where((code & 0x80) != 0, -magnitude, magnitude)


@triton.jit
def _e2m1(code):
    """float32 values of FP4 e2m1 codes (int32 in [0, 16)): bit 3 the sign, bits 1-2 the
    exponent (bias 1), bit 0 the mantissa: 0, 0.5, 1, 1.5, 2, 3, 4, 6."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    power = ((exponent + 126) << 23).to(tl.float32, bitcast=True)  # 2 ** (exponent - 1)
    magnitude = tl.where(exponent == 0, mantissa * 0.5, (1.0 + mantissa * 0.5) * power)
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _dequantized_gemm_kernel(
    x_ptr,  # [M, K], the activations' dtype
    q_ptr,  # [N, K] or [N, ceil(K / 2)] uint8
    scales_ptr,  # [N, G] float32 (FP4: uint8, the scale bytes)
    offsets_ptr,  # [N, G] float32 (HAS_OFFSETS); NVFP4: [N] float32, the global scales
    groups_ptr,  # [K] or [N, K] int32 (ACT_ORDER): each input's group
    bias_ptr,  # [N] (HAS_BIAS)
    out_ptr,  # [M, N], the activations' dtype
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_qn,
    stride_sn,
    stride_gn,  # 0 where every output row has the same groups
    stride_om,
    FORMAT: tl.constexpr,
    BITS: tl.constexpr,  # 4: two inputs a byte; 8: one
    HAS_OFFSETS: tl.constexpr,
    ACT_ORDER: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST_DOT: tl.constexpr,  # interpreter and bfloat16: its tl.dot gets bfloat16 wrong
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_valid = rows < M
    col_valid = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    q_cols = q_ptr + cols.to(tl.int64)[None, :] * stride_qn
    s_cols = cols.to(tl.int64)[None, :] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        k_valid = k < K
        x = tl.load(x_rows + k[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & col_valid[None, :]
        if BITS == 4:
            byte = tl.load(q_cols + (k // 2)[:, None], mask=w_mask, other=0).to(tl.int32)
            code = (byte >> ((k % 2) * 4)[:, None]) & 0xF  # [BLOCK_K, BLOCK_N]
        else:
            code = tl.load(q_cols + k[:, None], mask=w_mask, other=0).to(tl.int32)
        if ACT_ORDER:  # [BLOCK_K, BLOCK_N]
            group = tl.load(groups_ptr + cols.to(tl.int64)[None, :] * stride_gn + k[:, None], mask=w_mask, other=0)
            s_offs = s_cols + group.to(tl.int64)
        else:
            s_offs = s_cols + (k // group_size).to(tl.int64)[:, None]
        if FORMAT == 0:
            w = tl.load(scales_ptr + s_offs, mask=w_mask, other=0.0) * (code.to(tl.float32) - (1 << (BITS - 1)))
            if HAS_OFFSETS:
                w = w + tl.load(offsets_ptr + s_offs, mask=w_mask, other=0.0)
        elif FORMAT == 1:
            w = _e4m3(code) * tl.load(scales_ptr + s_offs, mask=w_mask, other=0.0)
        else:
            scale_byte = tl.load(scales_ptr + s_offs, mask=w_mask, other=0).to(tl.int32)
            if FORMAT == 2:
                global_scale = tl.load(offsets_ptr + cols, mask=col_valid, other=1.0)
                scale = tl.math.div_rn(_e4m3(scale_byte), global_scale[None, :])
            else:  # the byte is the float's exponent; 0 is 2 ** -127, a subnormal
                scale = tl.where(scale_byte == 0, 0x00400000, scale_byte << 23).to(tl.float32, bitcast=True)
            w = _e2m1(code) * scale
        w = tl.where(w_mask, w, 0.0).to(x_ptr.dtype.element_ty)  # the reference's W, rounded to x's dtype
        if UPCAST_DOT:  # exact: float32 holds every bfloat16
            acc += tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(x, w, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & col_valid[None, :])


def block_m(tokens: int) -> int:
    """Rows of a program: tl.dot needs 16 or more on NVIDIA GPUs; decodes take 16."""
    return 16 if tokens <= 16 else 32 if tokens <= 32 else 64


def dequantized_gemm(
    x: torch.Tensor,  # [M, K]
    q: torch.Tensor,  # [N, K] or [N, ceil(K / 2)] uint8
    scales: torch.Tensor,  # [N, G] float32, or FP4's uint8 scale bytes
    offsets: torch.Tensor | None,  # [N, G] float32; NVFP4: [N] float32, the global scales
    groups: torch.Tensor | None,  # [K] or [N, K] int32: each input's group (act order); None: k // group_size
    bias: torch.Tensor | None,  # [N]
    *,
    fmt: int,
    bits: int,
    group_size: int,
) -> torch.Tensor:  # [M, N] in x's dtype
    tokens, inputs = x.shape
    outputs = q.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    out = torch.empty(tokens, outputs, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    bm = block_m(tokens)
    bn = 64 if tokens <= 16 else 128
    grid = (triton.cdiv(tokens, bm), triton.cdiv(outputs, bn))
    _dequantized_gemm_kernel[grid](
        x, q, scales, offsets if offsets is not None else scales, groups if groups is not None else q,
        bias if bias is not None else scales, out,
        tokens, outputs, inputs, group_size, x.stride(0), q.stride(0), scales.stride(0),
        groups.stride(0) if groups is not None and groups.dim() == 2 else 0, out.stride(0),
        FORMAT=fmt, BITS=bits, HAS_OFFSETS=offsets is not None and fmt == FORMAT_INT, ACT_ORDER=groups is not None,
        HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64,
        UPCAST_DOT=INTERPRETED and x.dtype == torch.bfloat16,
    )  # fmt: skip
    return out
