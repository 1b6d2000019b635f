"""Conformance checks for a backend's multi-head latent attention: ``check_mla_backend``.

The same cases, steps, NaN-filled cache and tolerances as
``check_attention_backend`` (see ``vframe.testing.attention``), except in
float32: ``MLA_TOLERANCES`` allows 1e-4 where attention allows 1e-5. Every
score sums ``R + P`` = 576 products of size ~1 and reaches ~24, where a
float32 ulp is 2e-6: its 576 roundings, in the order each program chooses,
leave two exact float32 programs ~1e-5 apart on a score and on the output
(a compiled Triton kernel on an H100 was 1.16e-5 off the reference). A wrong
mask or a leaked slot is off by 1e-1 or NaN. Run through
``get_mla_impl_cls()`` over the cache ``get_kv_cache_shape_for_spec`` shapes for
an ``MLAAttentionSpec``. The reference is the absorbed form written out in
float32: one shared key of ``R + P`` per token whose first ``R`` elements are
the value (``MLAAttentionImpl``'s docstring)::

    out[t, h] = softmax_s(scale * query[t, h] . latent[s]) . latent[s, :R]
"""

from __future__ import annotations

import zlib

import torch

from vframe.core.interfaces import AttentionBackend, AttentionMetadataBuilder
from vframe.core.kv_cache_spec import MLAAttentionSpec, kv_cache_dtype_option, kv_cache_torch_dtype
from vframe.testing.attention import (
    ATTENTION_TOLERANCES,
    BLOCK_SIZES,
    CASES,
    QUICK_CASES,
    AttentionCase,
    _assert_close,
    _common_metadata,
    _engine_config,
    _intra_op_threads,
    _kv_label,
    _load_for_check,
    _rounded,
    reference_attention,
)

# (kv_lora_rank, qk_rope_head_dim): a tiny one, and DeepSeek-V2/V3's own.
LATENT_SIZES = ((32, 8), (512, 64))
MLA_TOLERANCES: dict[torch.dtype, tuple[float, float]] = ATTENTION_TOLERANCES | {torch.float32: (1e-4, 1e-4)}
"""``dtype -> (atol, rtol)`` for ``check_mla_backend`` (see the module docstring)."""


def check_mla_backend(
    backend: str | type[AttentionBackend],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quick: bool = False,
    kv_cache_dtype: str = "auto",
    kv_cache_scale: float | None = None,
) -> None:
    """Run the MLA conformance cases on ``backend``; raise ``AssertionError``
    naming the case and the error at the first wrong output. A backend that
    refuses ``use_mla=True`` in ``validate_configuration`` for every block size
    fails; ``quick``: the tiny latent, the first accepted block size and the
    quick cases only. ``kv_cache_dtype``: as for ``check_attention_backend``,
    the reference attends the latent rounded to the float8 cache.
    ``kv_cache_scale`` (plugin API 1.19, with a float8 cache): the impl's
    ``k_scale``, a checkpoint's calibrated scale of the latent; the reference
    attends ``fp8(latent / k_scale) * k_scale``."""
    cls = _load_for_check(backend, kv_cache_dtype, "kv_cache_scale" if kv_cache_scale is not None else None,
                          lambda c: c.get_mla_impl_cls(), "MLA impl")
    device = torch.device(device)
    block_sizes = []
    refusals = []
    options = kv_cache_dtype_option(kv_cache_dtype)  # as the runner asks
    for rank, rope in LATENT_SIZES[:1] if quick else LATENT_SIZES:
        for block_size in BLOCK_SIZES:
            reasons = cls.validate_configuration(
                head_size=rank + rope, dtype=dtype, device=device.type, block_size=block_size, use_mla=True,
                **options,
            )
            if reasons:
                refusals.append(f"block_size={block_size}: {'; '.join(reasons)}")
            else:
                block_sizes.append((rank, rope, block_size))
    if not block_sizes:
        raise AssertionError(f"attention backend {cls.name!r} refuses MLA for {dtype}: " + "; ".join(refusals))
    if quick:
        block_sizes = block_sizes[:1]
    cases = [c for c in CASES if c.sliding_window is None and (not quick or c.name in QUICK_CASES)]
    with _intra_op_threads(1 if device.type == "cpu" else None):
        for rank, rope, block_size in block_sizes:
            builder = cls.get_metadata_builder_cls()(_engine_config(cls, dtype, device, block_size), device)
            for case in cases:
                _run_mla_case(cls, builder, case, rank, rope, block_size, dtype, device, kv_cache_dtype,
                              kv_cache_scale or 1.0)


def _run_mla_case(
    cls: type[AttentionBackend],
    builder: AttentionMetadataBuilder,
    case: AttentionCase,
    rank: int,
    rope: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    k_scale: float = 1.0,
) -> None:
    label = (
        f"attention backend {cls.name!r}, MLA case {case.name!r} ({dtype}, {_kv_label(kv_cache_dtype)}"
        + (f"k_scale={k_scale:g}, " if k_scale != 1.0 else "") +
        f"kv_lora_rank={rank}, "
        f"qk_rope_head_dim={rope}, block_size={block_size}, H={case.num_heads})"
    )
    gen = torch.Generator().manual_seed(zlib.crc32(f"mla/{case.name}/{rank}/{block_size}".encode()))
    lengths = [sum(step[r] for step in case.steps) for r in range(len(case.steps[0]))]
    num_blocks = sum(-(-n // block_size) for n in lengths) + 3
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    pad_block = free_blocks.pop()
    latent_size = rank + rope
    scale = case.scale if case.scale is not None else (latent_size // 3) ** -0.5
    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    spec = MLAAttentionSpec(block_size, cache_dtype, rank, rope)
    kv_cache = torch.full(
        cls.get_kv_cache_shape_for_spec(spec, num_blocks), float("nan"), dtype=cache_dtype, device=device
    )
    impl = cls.get_mla_impl_cls()(case.num_heads, rank, rope, scale)
    impl.k_scale = k_scale
    query = [torch.randn(n, case.num_heads, latent_size, generator=gen).to(dtype).to(device) for n in lengths]
    latent = [torch.randn(n, latent_size, generator=gen).to(dtype).to(device) for n in lengths]
    cached = [_rounded(c, cache_dtype, k_scale) for c in latent]  # as the cache holds it
    if k_scale != 1.0:
        cached = [c.float() * k_scale for c in cached]  # what the reference attends

    block_ids: list[list[int]] = [[] for _ in lengths]
    num_computed = [0] * len(lengths)
    for step_idx, step in enumerate(case.steps):
        order = [r for r in torch.randperm(len(step), generator=gen).tolist() if step[r] > 0]
        for r in order:
            while len(block_ids[r]) * block_size < num_computed[r] + step[r]:
                block_ids[r].append(free_blocks.pop())
        common = _common_metadata(order, step, num_computed, block_ids, block_size, pad_block, device)
        spans = [(r, num_computed[r], num_computed[r] + step[r]) for r in order]
        q = torch.cat([query[r][a:b] for r, a, b in spans])  # [T, H, R + P]
        c = torch.cat([latent[r][a:b] for r, a, b in spans])  # [T, R + P]
        out = impl.forward(q, c, kv_cache, builder.build(common))
        expected = torch.cat(
            [
                reference_attention(query[r][a:b], cached[r][:b, None], cached[r][:b, None, :rank], scale)
                for r, a, b in spans
            ]
        )  # [T, H, R]
        _assert_close(out, expected, torch.Size((q.shape[0], case.num_heads, rank)), dtype, device,
                      f"{label}, step {step_idx}", common, MLA_TOLERANCES)
        for r in order:
            num_computed[r] += step[r]


__all__ = ["ATTENTION_TOLERANCES", "LATENT_SIZES", "MLA_TOLERANCES", "check_mla_backend"]
