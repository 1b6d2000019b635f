"""Integers packed several to an int32, as GPTQ and AWQ checkpoints store them.

A 32-bit word holds ``32 // bits`` values, the first in the lowest bits::

    word = v0 | v1 << bits | v2 << 2 * bits | ...        (4 bits: 8 values a word)

GPTQ packs along the input features of ``qweight`` and the output features of
``qzeros``; AWQ packs along the output features of both, with its values
interleaved inside each word (``awq.py``).
"""

from __future__ import annotations

import torch

from vframe.errors import ConfigError


def pack_factor(bits: int) -> int:
    """Values per int32 word."""
    return 32 // bits


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
