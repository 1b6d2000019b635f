"""Integers packed several to an int32, as GPTQ and AWQ checkpoints store them.

A 32-bit word holds ``32 // bits`` values, the first in the lowest bits::

    word = v0 | v1 << bits | v2 << 2 * bits | ...        (4 bits: 8 values a word)

GPTQ packs along the input features of ``qweight`` and the output features of
``qzeros``; AWQ packs along the output features of both, with its values
interleaved inside each word (``awq.py``). GPTQ's 3-bit values, which no word holds
a whole number of, run on across words: every 3 consecutive words hold 32 values as
one 96-bit little-endian stream (value 10 is bits 30-31 of the first word and bit 0
of the second, value 21 bit 31 of the second and bits 0-1 of the third)::

    words 3k, 3k + 1, 3k + 2 = v0 | v1 << 3 | ... | v31 << 93        (as one 96-bit integer)
"""

from __future__ import annotations

import math

import torch

from vframe.errors import ConfigError


def pack_factor(bits: int) -> int:
    """Values per int32 word."""
    return 32 // bits


def pack_unit(bits: int) -> tuple[int, int]:
    """The fewest values that fill whole words, and those words: (8, 1) at 4 bits, (32, 3) at 3."""
    values = 32 // math.gcd(32, bits)
    return values, values * bits // 32


def unpack_bits(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """``unpack_int32`` for any of 2, 3, 4 and 8 bits: at 3 bits every 3 words along ``dim``
    are one 96-bit stream of 32 values (see the module). int32 values in ``[0, 2**bits)``."""
    if 32 % bits == 0:
        return unpack_int32(packed, bits, dim)
    if bits != 3:
        raise ValueError(f"unpack_bits: {bits} bits")
    dim = dim % packed.dim()
    words = packed.movedim(dim, -1).long() & 0xFFFFFFFF  # [..., 3n] unsigned
    words = words.view(*words.shape[:-1], -1, 3)  # [..., n, 3]
    low = words[..., 0] | (words[..., 1] << 32)  # bits 0-63 of the stream (int64: the top bit as the sign)
    high = words[..., 1] | (words[..., 2] << 32)  # bits 32-95
    shifts = torch.arange(32, device=packed.device) * 3  # value i at bit 3 i of the stream
    # values 0-20 (bits 0-62) from the low 64 bits, 21-31 (bits 63-95) from the high: a shift of at
    # most 61 and a mask of 3 bits never see the sign's extension
    values = torch.where(shifts < 63, low[..., None] >> shifts.clamp(max=60),
                         high[..., None] >> (shifts - 32).clamp(min=0))
    return (values & 7).flatten(-2).to(torch.int32).movedim(-1, dim)


def unpack_int32(packed: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """Unpack the words of ``packed`` along ``dim``: ``[..., n, ...]`` ->
    ``[..., n * 32 // bits, ...]`` int32 values in ``[0, 2**bits)``, word by word,
    lowest bits first."""
    dim = dim % packed.dim()
    shape = [1] * (packed.dim() + 1)
    shape[dim + 1] = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=packed.dtype, device=packed.device).view(shape)
    words = packed.unsqueeze(dim + 1)  # [..., n, 1, ...]
    # An arithmetic shift drags the sign bit in from the left; the mask drops it.
    values = (words >> shifts) & ((1 << bits) - 1)  # [..., n, pack, ...]
    return values.flatten(dim, dim + 1).to(torch.int32)


def check_divisible(size: int, divisor: int, what: str, why: str) -> None:
    """Refuse a layer size that a packed or grouped parameter cannot hold evenly."""
    if size % divisor:
        raise ConfigError(f"{what} is {size}, not a multiple of {divisor}: {why}")
