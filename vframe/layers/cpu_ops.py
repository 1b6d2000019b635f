"""Fused C++ RMSNorm, neox rotary embedding, KV-cache write, SwiGLU activation, the
mixture-of-experts sum and the sampler's greedy argmax for CPU tensors (``csrc/cpu_ops.cpp``,
built once per machine like ``cpu_paged``'s operators). A decode step of a small
model is mostly these short elementwise chains between its matmuls: one operator
each instead of eight to fourteen PyTorch calls, at every size: their loops convert
eight (AVX2 + F16C) or sixteen (AVX-512) values at a time, rounding bfloat16 and float16
where PyTorch's separate operators round.

``available()`` is False, and the layers keep their PyTorch expressions, where the
library cannot be built or ``VFRAME_CPU_FUSED_OPS=0`` (for comparisons). The
rotation is bit-exact against the PyTorch expression; RMSNorm's float32 variance
may differ from PyTorch's reduction in the last bit (tests/layers/test_cpu_ops.py); the
SwiGLU activation calls torch's own SLEEF ``expf`` and is bit-exact where torch's CPU
kernels use AVX2 vectors.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from vframe.core.kv_cache_spec import is_fp8
from vframe.utils.native import BuildError, NativeLibrary

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
BF16_TILE = CSRC / "bf16_tile.h"  # bf16_gemm's tile, which the quant kernels' library includes too
LIBRARY = NativeLibrary(
    "cpu_ops", (CSRC / "cpu_ops.cpp",), "vframe_cpu_ops.so",
    "fused RMSNorm, rotary and SwiGLU operators and the decode plan", flags=("-ffp-contract=off",),
    headers=(BF16_TILE,),
)


@cache
def available() -> bool:
    if os.environ.get("VFRAME_CPU_FUSED_OPS", "1") == "0":
        return False
    try:
        LIBRARY.load()
    except (BuildError, OSError, RuntimeError) as e:
        logger.warning("fused CPU operators unavailable, using PyTorch expressions: %s", str(e).splitlines()[0])
        return False
    return True


# The dtypes the operators run. Vectorised, they win at every size (Zen 4, 2 threads,
# bfloat16, SmolLM2's sizes, fused against PyTorch's expression: RMSNorm 6 vs 23 us at 16
# tokens, 41 vs 87 at 256; rotary 11 vs 54 and 101 vs 230 us; SwiGLU 20 vs 25 and 178 vs
# 174 us, 0.66 vs 0.91-3.1 ms at 1,024 in two runs). Before the bfloat16 / float16 loops were vectorised
# (scalar rounding) they lost above 16 tokens, and the layers kept PyTorch's there.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def applies(x: torch.Tensor) -> bool:
    """Whether ``x`` ([T, ...]) takes the fused operators: a float dtype on the CPU, outside
    autograd and tracing, the library built."""
    return (
        x.dtype in DTYPES and x.device.type == "cpu"
        and not torch.is_grad_enabled() and not torch.compiler.is_compiling() and available()
    )


def guard(dtype: torch.dtype) -> Callable[[torch.Tensor], bool] | None:
    """``applies`` for activations of ``dtype`` with what cannot change between calls decided
    once (the dtype, the library built): what a layer bound after loading asks on every
    call (``vframe.layers.binding``). None: never for ``dtype``."""
    if dtype not in DTYPES or not available():
        return None
    is_grad_enabled, is_compiling = torch.is_grad_enabled, torch.compiler.is_compiling

    def fused(x: torch.Tensor) -> bool:
        return x.dtype == dtype and x.is_cpu and not is_grad_enabled() and not is_compiling()

    return fused


def stores_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor) -> bool:
    """Whether ``store_kv`` takes this KV write: CPU tensors of one float dtype, or K / V of
    one float dtype into a float8 cache (rounded on the way as ``to_cache_dtype`` rounds),
    each K / V row contiguous (``[T, KVH, D]`` views of the fused qkv output are), int64
    slots, outside tracing, the library built."""
    return (
        key.device.type == "cpu" and key.dtype == value.dtype and key.dtype in DTYPES
        and (kv_cache.dtype == key.dtype or is_fp8(kv_cache.dtype))
        and slots.dtype == torch.int64 and kv_cache.is_contiguous()
        and key.stride(2) == 1 and key.stride(1) == key.shape[2]
        and value.stride(2) == 1 and value.stride(1) == value.shape[2]
        and not torch.compiler.is_compiling() and available()
    )


def store_kv(
    key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slots: torch.Tensor,
    k_scale: float = 1.0, v_scale: float = 1.0,
) -> None:
    """Slot ``slots[i]`` of ``kv_cache[0]`` / ``kv_cache[1]`` ([2, num_blocks, block_size,
    KVH, D]) takes ``key[i]`` / ``value[i]``, for ``i < len(slots)``; a float8 cache
    ``key[i].float() / k_scale`` and ``value[i].float() / v_scale`` (calibrated scales)."""
    torch.ops.vframe_cpu_ops.store_kv(key, value, kv_cache, slots, k_scale, v_scale)


def operator(name: str) -> torch._ops.OpOverload:
    """The fused operator ``name`` (``rms_norm``, ``rotary_neox_``, ...), for a layer that
    looks it up once (``available()`` must be True)."""
    return getattr(torch.ops.vframe_cpu_ops, name).default


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:  # [T, E] -> [T, E]
    return torch.ops.vframe_cpu_ops.rms_norm(x, weight, eps)


def rotary_neox_(positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Rotate ``query`` [T, H, D] and ``key`` [T, KVH, D] in place."""
    torch.ops.vframe_cpu_ops.rotary_neox_(positions, query, key, cos_sin_cache)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    """SwiGLU's activation, ``F.silu(gate) * up`` for ``gate, up = gate_up.chunk(2, -1)``:
    one fused operator where ``applies`` (one pass over the rows, no chunk views: a decode
    step's MLP spent about 40 us a layer in chunk, silu and mul), else the PyTorch expression.
    AVX2 EPYC, 2 threads, float32, SmolLM2's [T, 2 x 1536]: 1 token 10 -> 4 us, 64 tokens 82 ->
    62 us, 4,096 tokens 6.8 -> 4.6 ms (SLEEF's expf is most of it)."""
    if gate_up.dim() == 2 and gate_up.stride(1) == 1 and applies(gate_up):
        return torch.ops.vframe_cpu_ops.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place: one [T, I] buffer less


def moe_combine(rows: torch.Tensor, token_ids: torch.Tensor, weights: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """A mixture-of-experts layer's output before its cast: ``acc [num_tokens, H]`` float32 with
    ``acc.index_add_(0, token_ids, rows.float() * weights[:, None])`` (rows [S, H], the (token,
    expert) pairs' expert outputs; token_ids [S] int64; weights [S] float32): one operator where
    ``applies`` instead of five (the same sums, pair by pair in order), else that expression.
    Zen 4, 2 threads, bfloat16 rows of 512: 128 pairs onto 64 tokens 43 -> 19 us, 8,192 pairs
    onto 4,096 tokens (a prefill step's layer) 12.9 -> 0.56 ms (``index_add_`` adds row by row
    on one thread)."""
    if rows.dim() == 2 and rows.stride(1) == 1 and token_ids.dtype == torch.int64 and applies(rows):
        return torch.ops.vframe_cpu_ops.moe_combine(rows, token_ids.contiguous(), weights.float().contiguous(), num_tokens)
    acc = torch.zeros(num_tokens, rows.shape[1], dtype=torch.float32, device=rows.device)
    return acc.index_add_(0, token_ids, rows.float() * weights.float()[:, None])


@cache
def bf16_gemm_available() -> bool:
    """Whether ``bf16_gemm`` runs here: the library built for a CPU with AVX512-BF16, and not
    turned off (``VFRAME_BF16_GEMM=0``, for comparisons)."""
    if os.environ.get("VFRAME_BF16_GEMM", "1") == "0" or not available():
        return False
    return bool(torch.ops.vframe_cpu_ops.bf16_gemm_available())


def bf16_pairs(weight: torch.Tensor) -> torch.Tensor:  # [N, K] -> [N / 16, K / 2, 16, 2]
    """A bfloat16 ``[out, in]`` weight as ``bf16_gemm`` reads it: each block of 16 outputs,
    its inputs in pairs (the operand layout of AVX512-BF16's ``vdpbf16ps``). N a multiple of
    16, K even."""
    out_features, in_features = weight.shape
    return weight.reshape(out_features // 16, 16, in_features // 2, 2).permute(0, 2, 1, 3).contiguous()


def bf16_unpairs(pairs: torch.Tensor) -> torch.Tensor:  # [N / 16, K / 2, 16, 2] -> [N, K]
    """``bf16_pairs``' inverse: the plain weight, exactly."""
    blocks, half, _, _ = pairs.shape
    return pairs.permute(0, 2, 1, 3).reshape(blocks * 16, half * 2)


def bf16_pairable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out, in]) can be held as ``bf16_pairs`` and multiplied by ``bf16_gemm`` here."""
    return (
        weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and weight.dim() == 2
        and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0 and bf16_gemm_available()
    )


def bf16_gemm(x: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:  # [M, K] x pairs of [N, K] -> [M, N]
    """``x @ W.T`` for bfloat16 ``x`` and ``pairs = bf16_pairs(W)``: float32 sums over the
    inputs in order, rounded to bfloat16 once (``csrc/cpu_ops.cpp``)."""
    return torch.ops.vframe_cpu_ops.bf16_gemm(x, pairs)


def bf16_gemm_takes(rows: torch.Tensor) -> bool:
    """Whether ``bf16_gemm`` takes these ``[M, K]`` rows: bfloat16 on this CPU, each row
    contiguous, the row stride even."""
    return rows.dtype == torch.bfloat16 and rows.stride(-1) == 1 and rows.stride(0) % 2 == 0 and applies(rows)


def bf16_gemm_silu(x: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:  # [M, K] x pairs of [2 I, K] -> [M, I]
    """``silu_and_mul(bf16_gemm(x, pairs))`` for the pairs of a ``[gate; up]`` weight (``I`` a
    multiple of 16), bit for bit, in one pass: the ``[M, 2 I]`` product is never written."""
    return torch.ops.vframe_cpu_ops.bf16_gemm_silu(x, pairs)


def argmax(logits: torch.Tensor) -> torch.Tensor:  # [B, V] -> [B] int64
    """``logits.argmax(-1)`` (the first index of a row's maximum; NaN counts as the
    maximum): the C++ operator for float32 rows on the CPU, else torch's. torch's CPU
    argmax does not vectorise its index-tracking reduction: AVX2 EPYC, 2 threads, [64,
    49152] 3.9 -> 0.5 ms, [1, 49152] 58-135 -> 13 us."""
    if logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1 and logits.shape[1] and applies(logits):
        return torch.ops.vframe_cpu_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


if __name__ == "__main__":  # make install builds the operators once
    logging.basicConfig(level=logging.INFO)
    print(LIBRARY.build())
