"""llama.cpp's GGUF block formats, dequantized in torch.

A GGUF matrix of ``out`` rows and ``in`` inputs stores each row as
``in / block_size`` blocks of ``type_size`` bytes: ``uint8 [out, in / block_size * type_size]``.
Each dequantizer maps ``n`` blocks ``uint8 [n, type_size]`` to ``float32 [n, block_size]``
with the same float32 operations, in the same order, as ``gguf.quants`` (numpy),
so both give identical bits. Layouts (``d``, ``m``, ``dmin``: float16; ``q``: the
integers, lowest bits first)::

    Q4_0  d | 16 bytes: q[j] low nibble, q[j + 16] high          w = d * (q - 8)
    Q4_1  d | m | 16 bytes as Q4_0                                w = d * q + m
    Q5_0  d | 4 bytes: bit j is q[j]'s fifth | 16 bytes as Q4_0   w = d * (q - 16)
    Q5_1  d | m | 4 bytes as Q5_0 | 16 bytes                      w = d * q + m
    Q8_0  d | 32 int8                                             w = d * q
    Q2_K  256 per block: 16 x (4-bit scale | 4-bit min) | 64 bytes of 2-bit q | d | dmin
    Q3_K  256: 32 bytes high bits | 64 bytes 2-bit q | 12 bytes of 6-bit scales | d
    Q4_K  256: d | dmin | 12 bytes of 6-bit scales and mins (8 sub-blocks of 32) | 128 bytes 4-bit q
    Q5_K  256: as Q4_K plus 32 bytes of fifth bits
    Q6_K  256: 128 bytes low 4 bits | 64 bytes high 2 bits | 16 int8 scales | d
    IQ4_NL  d | 16 bytes as Q4_0                                  w = d * IQ4_VALUES[q]
    IQ4_XS  256: d | 2 bytes high 2 bits of 8 sub-block scales | 4 bytes low 4 bits of them |
            128 bytes, per sub-block of 32 16 bytes as Q4_0       w = d * (ls - 32) * IQ4_VALUES[q]
"""

from __future__ import annotations

from collections.abc import Callable

import torch

QK_K = 256  # values per K-quant super-block


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:  # [n, 1] float32
    return blocks[:, start : start + 2].contiguous().view(torch.float16).float()


def _shifts(*values: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.uint8).reshape(shape)


def _bit_shifts(device: torch.device) -> torch.Tensor:  # [1, 1, 8, 1]: 0 .. 7
    return torch.arange(8, dtype=torch.uint8, device=device).reshape(1, 1, 8, 1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:  # [n, 16] -> [n, 32] uint8: the low nibbles, then the high
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _bits(qh: torch.Tensor) -> torch.Tensor:  # [n, 4] -> [n, 32] uint8: bit j of the little-endian uint32
    n = qh.shape[0]
    return ((qh.reshape(n, 4, 1) >> torch.arange(8, dtype=torch.uint8, device=qh.device)) & 1).reshape(n, 32)


def q4_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = _nibbles(blocks[:, 2:]).to(torch.int8) - 8
    return q.float().mul_(d)


def q4_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _nibbles(blocks[:, 4:]).float().mul_(d).add_(m)


def q5_0(blocks: torch.Tensor) -> torch.Tensor:
    d = _f16(blocks, 0)
    q = (_nibbles(blocks[:, 6:]) | (_bits(blocks[:, 2:6]) << 4)).to(torch.int8) - 16
    return q.float().mul_(d)


def q5_1(blocks: torch.Tensor) -> torch.Tensor:
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    q = _nibbles(blocks[:, 8:]) | (_bits(blocks[:, 4:8]) << 4)
    return q.float().mul_(d).add_(m)


def q8_0(blocks: torch.Tensor) -> torch.Tensor:
    return blocks[:, 2:].contiguous().view(torch.int8).float().mul_(_f16(blocks, 0))


def q2_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    scales, qs = blocks[:, :16], blocks[:, 16:80]
    d, dmin = _f16(blocks, 80), _f16(blocks, 82)
    dl = (d * (scales & 0x0F).float()).reshape(n, 16, 1)
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)
    q = (qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1)).to(blocks.device)) & 3
    return (dl * q.reshape(n, 16, 16).float() - ml).reshape(n, QK_K)


def _q3_k_parts(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q3_K blocks -> the scale ``d * sc`` of each 16 values (float32 [n, 16, 1]) and the
    values in [-4, 4) (int8 [n, 16, 16])."""
    n, device = blocks.shape[0], blocks.device
    hmask, qs, packed_scales = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108]
    d = _f16(blocks, 108)
    # 16 six-bit scales: low 4 bits from bytes 0-7 (low nibbles, then high), top 2 bits from bytes 8-11
    low = (packed_scales[:, :8].reshape(n, 1, 8) >> _shifts(0, 4, shape=(1, 2, 1)).to(device)).reshape(n, 16)
    high = (packed_scales[:, 8:].reshape(n, 1, 4) >> _shifts(0, 2, 4, 6, shape=(1, 4, 1)).to(device)).reshape(n, 16)
    scales = ((low & 0x0F) | ((high & 0x03) << 4)).to(torch.int8) - 32
    dl = (d * scales.float()).reshape(n, 16, 1)
    ql = (qs.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1)).to(device)).reshape(n, 16, 16) & 3
    qh = hmask.reshape(n, 1, 1, 32) >> _bit_shifts(device)
    qh = (qh.reshape(n, 16, 16) & 1) ^ 1  # a clear high bit subtracts 4
    return dl, ql.to(torch.int8) - (qh << 2).to(torch.int8)


def q3_k(blocks: torch.Tensor) -> torch.Tensor:
    dl, q = _q3_k_parts(blocks)
    return (dl * q.float()).reshape(blocks.shape[0], QK_K)


def _k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # [n, 12] -> 2 x [n, 8] uint8
    """Q4_K / Q5_K: eight 6-bit scales and mins in 12 bytes (ggml's ``get_scale_min_k4``)."""
    n = packed.shape[0]
    d, m, m_d = packed.reshape(n, 3, 4).unbind(1)
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def q4_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d = (d * scales.float()).reshape(n, 8, 1)
    dm = (dmin * mins.float()).reshape(n, 8, 1)
    q = _k_nibbles(blocks[:, 16:144]).float()
    return (d * q - dm).reshape(n, QK_K)


def q5_k(blocks: torch.Tensor) -> torch.Tensor:
    n = blocks.shape[0]
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    scales, mins = _k_scales_mins(blocks[:, 4:16])
    d = (d * scales.float()).reshape(n, 8, 1)
    dm = (dmin * mins.float()).reshape(n, 8, 1)
    qh = blocks[:, 16:48].reshape(n, 1, 1, 32) >> _bit_shifts(blocks.device)
    q = _k_nibbles(blocks[:, 48:176]) | ((qh.reshape(n, 8, 32) & 1) << 4)
    return (d * q.float() - dm).reshape(n, QK_K)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:  # [n, 128] -> [n, 8, 32] uint8: per 32 bytes, low then high
    n = qs.shape[0]
    q = qs.reshape(n, 4, 1, 32) >> _shifts(0, 4, shape=(1, 1, 2, 1)).to(qs.device)
    return (q & 0x0F).reshape(n, 8, 32)


def q6_k(blocks: torch.Tensor) -> torch.Tensor:
    n, device = blocks.shape[0], blocks.device
    ql, qh = blocks[:, :128], blocks[:, 128:192]
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(blocks, 208) * scales).reshape(n, 16, 1)
    low = (ql.reshape(n, 2, 1, 64) >> _shifts(0, 4, shape=(1, 1, 2, 1)).to(device)) & 0x0F
    high = (qh.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1)).to(device)) & 0x03
    q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, QK_K)


# llama.cpp's non-linear 4-bit values (``kvalues_iq4nl``): IQ4_NL's and IQ4_XS's codes index them
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)


def _iq4_codes(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """IQ4_NL / IQ4_XS blocks -> each 32 values' float32 scale [n, groups] and 4-bit codes
    [n, groups, 32] (groups: 1, or IQ4_XS's 8 sub-blocks, each ``d * (ls - 32)`` with its
    6-bit ``ls``: 4 low bits from ``scales_l``, 2 high from the 16-bit ``scales_h``)."""
    n = blocks.shape[0]
    if blocks.shape[1] == 18:  # IQ4_NL
        return _f16(blocks, 0), _nibbles(blocks[:, 2:]).reshape(n, 1, 32)
    low = (blocks[:, 4:8].reshape(n, 4, 1) >> _shifts(0, 4, shape=(1, 1, 2)).to(blocks.device)) & 0x0F
    high = blocks[:, 2:4].contiguous().view(torch.int16).int() >> torch.arange(0, 16, 2, device=blocks.device)
    ls = low.reshape(n, 8).int() | ((high & 3) << 4)  # [n, 8] in [0, 64)
    return _f16(blocks, 0) * (ls - 32).float(), _nibbles(blocks[:, 8:].reshape(n * 8, 16)).reshape(n, 8, 32)


def iq4(blocks: torch.Tensor) -> torch.Tensor:  # IQ4_NL and IQ4_XS
    scales, q = _iq4_codes(blocks)
    values = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=blocks.device)[q.long()]
    return (scales[..., None] * values).reshape(blocks.shape[0], -1)


def f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


def f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


def bf16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.bfloat16).float()


# ggml type name -> (values per block, bytes per block, dequantizer)
FORMATS: dict[str, tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]] = {
    "F32": (1, 4, f32),
    "F16": (1, 2, f16),
    "BF16": (1, 2, bf16),
    "Q4_0": (32, 18, q4_0),
    "Q4_1": (32, 20, q4_1),
    "Q5_0": (32, 22, q5_0),
    "Q5_1": (32, 24, q5_1),
    "Q8_0": (32, 34, q8_0),
    "Q2_K": (QK_K, 84, q2_k),
    "Q3_K": (QK_K, 110, q3_k),
    "Q4_K": (QK_K, 144, q4_k),
    "Q5_K": (QK_K, 176, q5_k),
    "Q6_K": (QK_K, 210, q6_k),
    "IQ4_NL": (32, 18, iq4),
    "IQ4_XS": (QK_K, 136, iq4),
}


# Formats whose values fit 4 bits, with one scale and offset per group of inputs
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K")


def int4_groups(
    rows: torch.Tensor, ggml_type: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """A 4-bit-or-fewer format's rows (``INT4_TYPES``) as ``w = scale * (q - 8) + zero``
    per group of inputs: ``q`` uint8 [out, in] in [0, 16), ``scale`` and ``zero`` float32
    [out, in / group] (``zero`` None where the format has none), and the group size.
    Per 32 inputs: Q4_0 ``d (q - 8)``, scale d; Q4_1 ``d q + m``: zero ``m + 8 d``; Q4_K
    ``(d sc) q - dmin m`` per sub-block: scale ``d sc``, zero ``8 d sc - dmin m``. Per 16:
    Q2_K ``(d sc) q - dmin m`` with q in [0, 4): q + 8 stored, scale ``d sc``, zero
    ``-(dmin m)``; Q3_K ``(d sc) q`` with q in [-4, 4): q + 8 stored. For Q2_K and Q3_K the
    products are the dequantizers' own, so ``scale * (q - 8) + zero`` gives their bits."""
    out, type_size = rows.shape[0], FORMATS[ggml_type][1]
    blocks = rows.reshape(-1, type_size)
    n = blocks.shape[0]
    if ggml_type == "Q2_K":
        sub = blocks[:, :16]
        scale = _f16(blocks, 80) * (sub & 0x0F).float()  # [blocks, 16]
        zero = -(_f16(blocks, 82) * (sub >> 4).float())
        q = (blocks[:, 16:80].reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1)).to(blocks.device)) & 3
        return q.reshape(out, -1) + 8, scale.reshape(out, -1), zero.reshape(out, -1), 16
    if ggml_type == "Q3_K":
        scale, q = _q3_k_parts(blocks)
        return (q + 8).to(torch.uint8).reshape(out, -1), scale.reshape(out, -1), None, 16
    if ggml_type == "Q4_K":
        sub_scales, sub_mins = _k_scales_mins(blocks[:, 4:16])
        scale = _f16(blocks, 0) * sub_scales.float()  # [blocks, 8]
        zero = 8 * scale - _f16(blocks, 2) * sub_mins.float()
        q = _k_nibbles(blocks[:, 16:])  # [blocks, 8, 32]
    else:
        scale = _f16(blocks, 0)  # [blocks, 1]
        zero = _f16(blocks, 2) + 8 * scale if ggml_type == "Q4_1" else None
        q = _nibbles(blocks[:, type_size - 16 :])  # [blocks, 32]
    return q.reshape(out, -1), scale.reshape(out, -1), None if zero is None else zero.reshape(out, -1), 32


# ggml's type numbers (``gguf.GGMLQuantizationType``) of the formats above
GGML_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 20: "IQ4_NL", 23: "IQ4_XS", 30: "BF16",
}


# Formats whose 4-bit codes index a table of 16 values, with one scale per 32 inputs
LUT4_TYPES = ("IQ4_NL", "IQ4_XS")


def lut4_groups(rows: torch.Tensor, ggml_type: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """A table format's rows (``LUT4_TYPES``) as ``w = table[q] * scale`` per group of 32 inputs: ``q``
    uint8 [out, in] in [0, 16), ``scale`` float32 [out, in / 32] (IQ4_NL's ``d``, IQ4_XS's ``d * (ls -
    32)``), the table (``IQ4_VALUES``, float32) and 32; the products are the dequantizer's own."""
    if ggml_type not in LUT4_TYPES:
        raise ValueError(f"{ggml_type} is not one of {LUT4_TYPES}")
    out = rows.shape[0]
    scales, q = _iq4_codes(rows.reshape(-1, FORMATS[ggml_type][1]))
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=rows.device)
    return q.reshape(out, -1), scales.reshape(out, -1), table, 32


def row_bytes(ggml_type: str, in_features: int) -> int:
    """Bytes of one row of ``in_features`` values; ``in_features`` must be whole blocks."""
    block_size, type_size, _ = FORMATS[ggml_type]
    return in_features // block_size * type_size


def dequantize(rows: torch.Tensor, ggml_type: str) -> torch.Tensor:
    """``uint8 [out, row bytes]`` GGUF rows of ``ggml_type`` -> ``float32 [out, in]``."""
    block_size, type_size, dequantize_blocks = FORMATS[ggml_type]
    out = rows.shape[0]
    return dequantize_blocks(rows.reshape(-1, type_size)).reshape(out, -1)


INT8_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0")  # integers that fit a byte, kept as IntWeights of 8 bit


def int8_groups(
    rows: torch.Tensor, ggml_type: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, int]:
    """A 5, 6 or 8-bit format's rows (``INT8_TYPES``) as ``w = scale * (q - 128) + offset``
    per group of inputs: ``q`` uint8 [out, in] (the format's integer plus 128), ``scale``
    and ``offset`` float32 [out, in / group] (``offset`` None where the format has none),
    and the group size: Q5_0 ``d (q - 16)``, Q5_1 ``d q + m``, Q8_0 ``d q`` (groups of
    32); Q5_K ``(d sc) q - dmin m`` per sub-block of 32; Q6_K ``(d sc) q`` per 16. The
    products are the dequantizers' own, so ``scale * (q - 128) + offset`` gives their bits."""
    out, type_size = rows.shape[0], FORMATS[ggml_type][1]
    blocks = rows.reshape(-1, type_size)
    n = blocks.shape[0]
    offset = None
    if ggml_type == "Q8_0":
        q, scale, group = blocks[:, 2:].contiguous().view(torch.int8).short(), _f16(blocks, 0), 32
    elif ggml_type in ("Q5_0", "Q5_1"):
        start = 2 if ggml_type == "Q5_0" else 4
        q = (_nibbles(blocks[:, start + 4 :]) | (_bits(blocks[:, start : start + 4]) << 4)).short()
        scale, group = _f16(blocks, 0), 32
        if ggml_type == "Q5_0":
            q = q - 16
        else:
            offset = _f16(blocks, 2)
    elif ggml_type == "Q5_K":
        d, dmin = _f16(blocks, 0), _f16(blocks, 2)
        scales, mins = _k_scales_mins(blocks[:, 4:16])
        scale, offset, group = d * scales.float(), -(dmin * mins.float()), 32  # [n, 8]
        qh = blocks[:, 16:48].reshape(n, 1, 1, 32) >> _bit_shifts(blocks.device)
        q = (_k_nibbles(blocks[:, 48:176]) | ((qh.reshape(n, 8, 32) & 1) << 4)).short()
    elif ggml_type == "Q6_K":
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        scale, group = _f16(blocks, 208) * blocks[:, 192:208].contiguous().view(torch.int8).float(), 16  # [n, 16]
        low = (ql.reshape(n, 2, 1, 64) >> _shifts(0, 4, shape=(1, 1, 2, 1)).to(blocks.device)) & 0x0F
        high = (qh.reshape(n, 2, 1, 32) >> _shifts(0, 2, 4, 6, shape=(1, 1, 4, 1)).to(blocks.device)) & 0x03
        q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).short() - 32
    else:
        raise ValueError(f"{ggml_type} is not one of {INT8_TYPES}")
    q = (q.reshape(out, -1) + 128).to(torch.uint8)
    return q, scale.reshape(out, -1), None if offset is None else offset.reshape(out, -1), group
