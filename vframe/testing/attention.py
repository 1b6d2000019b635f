"""Conformance checks for attention backends: ``check_attention_backend``.

The checks run the backend the way the model runner does (one metadata
builder, one ``AttentionImpl`` per layer, the same metadata for every layer,
step after step over one paged KV cache) and compare every output with a
float32 reference written in plain PyTorch.

What "correct" means
--------------------
* **Agreement within tolerance**, not bit-exactness with the built-in ``torch``
  backend: every output element satisfies
  ``|out - ref| <= atol + rtol * |ref|`` with ``(atol, rtol) =
  ATTENTION_TOLERANCES[dtype]``. The reference is ``softmax(scale * Q K^T) V``
  in float32 over the request's keys and values gathered in position order
  (causal, GQA: query head ``h`` reads KV head ``h // (H // KVH)``), computed
  from the very ``dtype``-rounded inputs the backend gets. Attention has no
  ties to break: the reference is the only answer.
* **No NaN or inf, ever.** Every KV slot is filled with NaN before the first
  step, as memory that is not zeroed (or a block freed by a request that
  overflowed) may hold it. A backend may gather whole blocks, but slots past a
  request's length, block-table padding and unused blocks must not reach the
  output, not even multiplied by a zero probability (``0 * NaN`` is NaN).
* **Writes land at ``slot_mapping`` and nowhere else.** Keys and values written
  in one step are read back through the backend in later steps (every case
  ends with a decode of every request, so every written token is read again),
  compared with the reference over the logical keys and values. When the
  backend uses the standard layout ``(2, num_blocks, block_size, KVH, D)``
  (the one ``AttentionBackend.swap_blocks`` assumes), each step's cache is
  also checked directly: the written slots hold the inputs exactly, every
  other slot is still NaN, except that a backend may set to zero the unwritten
  tail of a request's last block (slots past its length in the block it is
  filling: no other request holds that block, and only this request writes
  them later). The compiled ``flex`` backend does, because its fused kernels
  read whole blocks.

Tolerances (``ATTENTION_TOLERANCES``): float32 backends differ from the
reference only by summation order (errors ~1e-6 at these sizes); float16 keeps
10 mantissa bits and bfloat16 7, so the output's own rounding is up to
``2**-11`` and ``2**-8`` of its magnitude, and a kernel that keeps softmax
probabilities or partial sums in that dtype (flash-attention style) adds
about as much again. Inputs are ``randn``: outputs are O(1).
"""

from __future__ import annotations

import unittest
import zlib
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from vframe.core.interfaces import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vframe.core.kv_cache_spec import is_fp8, kv_cache_dtype_option, kv_cache_torch_dtype

if TYPE_CHECKING:
    from vframe.core.config import EngineConfig

ATTENTION_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (3e-2, 2e-2),
}
"""``dtype -> (atol, rtol)`` for ``check_attention_backend``, against the
float32 reference computed from the same ``dtype``-rounded inputs."""

NUM_LAYERS = 2  # two layers share each step's metadata, as in a model
HEAD_SIZES = (64, 128, 32, 256, 80)
BLOCK_SIZES = (16, 4, 32)
# Tried only when a backend accepts none of BLOCK_SIZES: paged kernels that need
# large pages (flash-attn's: multiples of 256).
LARGE_BLOCK_SIZES = (256,)


@dataclass(frozen=True)
class AttentionCase:
    """A few requests run over several steps.

    ``steps[s][r]`` is how many new tokens request ``r`` runs in step ``s``
    (``0``: not scheduled). A request's earlier steps are its cached context::

        steps = ((5, 0), (3, 4), (1, 1))
        step 0: r0 prefill 0..4
        step 1: r0 chunk 5..7 on 5 cached | r1 prefill 0..3
        step 2: r0 decode 8 | r1 decode 4
    """

    name: str
    steps: tuple[tuple[int, ...], ...]
    num_heads: int
    num_kv_heads: int
    scale: float | None = None  # None: head_size ** -0.5
    sliding_window: int | None = None


CASES: tuple[AttentionCase, ...] = (
    AttentionCase("prefill-gqa", ((7, 16, 1, 33), (1, 1, 1, 1)), 8, 2),
    AttentionCase("prefill-mha", ((9, 17), (1, 1)), 4, 4),
    AttentionCase("cached-prefix-gqa", ((5, 16, 9), (6, 20, 3), (1, 1, 1)), 6, 2),
    AttentionCase("decode-gqa", ((12, 3, 17, 1), (1, 1, 1, 1), (1, 1, 1, 1), (1, 1, 1, 1)), 8, 2),
    AttentionCase("decode-mqa", ((20, 2), (1, 1), (1, 1)), 4, 1),
    AttentionCase("mixed-gqa", ((10, 0, 5, 30), (1, 8, 7, 1), (1, 1, 1, 1)), 8, 2),
    AttentionCase("mixed-mha", ((4, 0, 13), (1, 6, 1), (2, 1, 1), (1, 1, 1)), 4, 4),
    AttentionCase("multi-step-decode", ((15, 2),) + ((1, 1),) * 6, 4, 2),
    AttentionCase("custom-scale", ((11, 3), (4, 1), (1, 1)), 4, 2, scale=0.3),
    AttentionCase("sliding-window", ((9, 3), (5, 1), (1, 1), (1, 1)), 4, 2, sliding_window=5),
)
QUICK_CASES = ("prefill-gqa", "cached-prefix-gqa", "mixed-gqa", "decode-mqa")
# per_head_kv_scales: KV head h's calibrated scales are the given ones times factor h
PER_HEAD_FACTORS = (1.0, 0.25, 4.0, 0.5)


def check_attention_backend(
    backend: str | type[AttentionBackend],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quick: bool = False,
    kv_cache_dtype: str = "auto",
    kv_cache_scales: tuple[float, float] | None = None,
    per_head_kv_scales: bool = False,
) -> None:
    """Run the attention conformance cases on ``backend`` (a registry name or
    the class); raise ``AssertionError`` naming the case, the dtype and the
    error against the tolerance at the first output that is wrong.

    ``kv_cache_dtype`` (``"fp8"``, ``"fp8_e4m3"``, ``"fp8_e5m2"``): the cache
    holds float8 and the reference attends the keys and values rounded to it
    (saturated, scale 1.0), with ``dtype``'s tolerance. ``kv_cache_scales``
    (``(k_scale, v_scale)``, plugin API 1.19, with a float8 cache): every
    layer's impl gets them as a checkpoint's calibrated scales, the cache must
    hold ``fp8(key / k_scale)`` and ``fp8(value / v_scale)`` and the reference
    attends those times the scales; a backend whose impl does not declare
    ``supports_kv_cache_scales`` fails. ``per_head_kv_scales`` (plugin API
    1.22, with ``kv_cache_scales``): the impls get ``k_head_scales`` /
    ``v_head_scales`` instead, KV head ``h``'s the given scales times
    ``PER_HEAD_FACTORS[h]``, and the cache must hold each head over its own;
    a backend whose impl does not declare ``supports_per_head_kv_scales`` fails.

    Every head size in ``HEAD_SIZES`` and block size in ``BLOCK_SIZES`` (or,
    when it accepts none of those, ``LARGE_BLOCK_SIZES``) that
    ``validate_configuration`` accepts for ``dtype`` on ``device`` is run, all
    ``CASES`` each (a few seconds on CPU); ``quick``: the first accepted
    ``(head_size, block_size)`` and the four ``QUICK_CASES`` (well under a
    second). Refusing every configuration is a failure. A backend whose
    ``check_available()`` gives reasons is skipped (``unittest.SkipTest``,
    which pytest reports as a skip). A backend without sliding windows raises
    ``NotImplementedError`` from its ``AttentionImpl`` constructor when given
    one; those cases are then skipped.

    On CPU the check runs torch with one intra-op thread (restored after):
    the tensors are tiny, and on a busy machine thread hand-offs made the
    same check a hundred times slower.
    """
    if dtype not in ATTENTION_TOLERANCES:
        raise ValueError(
            f"dtype={dtype}: no stated tolerance; ATTENTION_TOLERANCES has "
            + ", ".join(str(d) for d in ATTENTION_TOLERANCES)
        )
    if per_head_kv_scales and kv_cache_scales is None:
        raise ValueError("per_head_kv_scales spreads kv_cache_scales over the heads: pass kv_cache_scales too")
    cls = _load_for_check(backend, kv_cache_dtype, "kv_cache_scales" if kv_cache_scales is not None else None,
                          lambda c: c.get_impl_cls(), "impl")
    if per_head_kv_scales and not cls.get_impl_cls().supports_per_head_kv_scales:
        raise AssertionError(
            f"attention backend {cls.name!r}: its impl {cls.get_impl_cls().__qualname__} does not declare "
            "supports_per_head_kv_scales, so an engine refuses calibrated FP8 KV-cache scales per KV head on it"
        )
    device = torch.device(device)
    configs, refusals = accepted_configurations(cls, dtype, device, quick, kv_cache_dtype)
    if not configs:
        raise AssertionError(
            f"attention backend {cls.name!r} refuses every configuration tried for {dtype} "
            + ("" if kv_cache_dtype == "auto" else f"(kv_cache_dtype={kv_cache_dtype!r}) ")
            + "on "
            f"{device.type}: " + "; ".join(refusals)
        )
    cases = [c for c in CASES if c.name in QUICK_CASES] if quick else list(CASES)
    with _intra_op_threads(1 if device.type == "cpu" else None):
        for head_size, block_size in configs:
            builder = cls.get_metadata_builder_cls()(_engine_config(cls, dtype, device, block_size), device)
            for case in cases:
                _run_case(cls, builder, case, head_size, block_size, dtype, device, kv_cache_dtype, kv_cache_scales,
                          per_head_kv_scales)


def accepted_configurations(
    cls: type[AttentionBackend],
    dtype: torch.dtype,
    device: torch.device,
    quick: bool = False,
    kv_cache_dtype: str = "auto",
) -> tuple[list[tuple[int, int]], list[str]]:
    """``(head_size, block_size)`` pairs the backend accepts (``quick``: at
    most one), and the reasons it gave for the others."""
    accepted: list[tuple[int, int]] = []
    refusals: list[str] = []
    options = kv_cache_dtype_option(kv_cache_dtype)  # as the runner asks
    for block_sizes in (BLOCK_SIZES, LARGE_BLOCK_SIZES):
        if accepted:
            break
        for head_size in HEAD_SIZES:
            for block_size in block_sizes:
                reasons = cls.validate_configuration(
                    head_size=head_size, dtype=dtype, device=device.type, block_size=block_size, **options
                )
                if reasons:
                    refusals.append(f"head_size={head_size}, block_size={block_size}: {'; '.join(reasons)}")
                elif not quick or not accepted:
                    accepted.append((head_size, block_size))
    if accepted and not quick:
        # Every accepted head size with the first accepted block size, and vice versa.
        first_head, first_block = accepted[0]
        accepted = [(h, b) for h, b in accepted if h == first_head or b == first_block]
    return accepted, refusals


@contextmanager
def _intra_op_threads(num_threads: int | None) -> Iterator[None]:
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def _load_for_check(
    backend: str | type[AttentionBackend],
    kv_cache_dtype: str,
    scales_option: str | None,
    impl_of: Callable[[type[AttentionBackend]], type],
    what: str,
) -> type[AttentionBackend]:
    """The backend class a kit checks: refused calibrated scales (``scales_option``, the kit's
    argument that passed them, or None) without a float8 cache or on an impl (``impl_of``) that
    does not declare it applies them; skipped where it is not available."""
    if scales_option is not None and kv_cache_dtype == "auto":
        raise ValueError(f"{scales_option} is for a float8 cache: pass kv_cache_dtype='fp8' (or 'fp8_e5m2')")
    cls = _load(backend)
    if scales_option is not None and not impl_of(cls).supports_kv_cache_scales:
        raise AssertionError(
            f"attention backend {cls.name!r}: its {what} {impl_of(cls).__qualname__} does not declare "
            "supports_kv_cache_scales, so an engine refuses calibrated FP8 KV-cache scales on it"
        )
    if reasons := cls.check_available():
        raise unittest.SkipTest(f"attention backend {cls.name!r} is not available here: {'; '.join(reasons)}")
    return cls


def _load(backend: str | type[AttentionBackend]) -> type[AttentionBackend]:
    if isinstance(backend, str):
        from vframe.plugins import get_registry

        return get_registry("attention_backend").load(backend)
    return backend


def _engine_config(
    cls: type[AttentionBackend], dtype: torch.dtype, device: torch.device, block_size: int
) -> EngineConfig:
    from vframe.core.config import EngineConfig

    names = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
    return EngineConfig.from_sources(
        env={},
        block_size=block_size,
        dtype=names.get(dtype, "auto"),
        device="cuda" if device.type == "cuda" else "cpu",
        attention_backend=getattr(cls, "name", None),
    )


# --------------------------------------------------------------------------- #
# One case
# --------------------------------------------------------------------------- #


@dataclass
class _Layer:
    impl: AttentionImpl
    kv_cache: torch.Tensor  # the backend's get_kv_cache_shape(...)
    query: list[torch.Tensor]  # per request [L, H, D], every position it will ever run
    key: list[torch.Tensor]  # per request [L, KVH, D]
    value: list[torch.Tensor]
    cached_key: list[torch.Tensor]  # key as the cache holds it: rounded to its dtype (float8: key / k_scale)
    cached_value: list[torch.Tensor]
    k_scale: float | torch.Tensor = 1.0  # calibrated FP8 KV-cache scales the impl was given ([KVH]: per head)
    v_scale: float | torch.Tensor = 1.0


def _run_case(
    cls: type[AttentionBackend],
    builder: AttentionMetadataBuilder,
    case: AttentionCase,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
    kv_cache_scales: tuple[float, float] | None = None,
    per_head_kv_scales: bool = False,
) -> None:
    k_scale, v_scale = kv_cache_scales or (1.0, 1.0)
    label = (
        f"attention backend {cls.name!r}, case {case.name!r} ({dtype}, {_kv_label(kv_cache_dtype)}"
        + (f"k_scale={k_scale:g}, v_scale={v_scale:g}{' per head' if per_head_kv_scales else ''}, "
           if kv_cache_scales else "")
        +
        f"head_size={head_size}, "
        f"block_size={block_size}, H={case.num_heads}, KVH={case.num_kv_heads})"
    )
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{head_size}/{block_size}".encode()))
    lengths = [sum(step[r] for step in case.steps) for r in range(len(case.steps[0]))]
    need = [-(-n // block_size) for n in lengths]
    num_blocks = sum(need) + 3  # spare blocks stay NaN; one of them pads block tables
    free_blocks = torch.randperm(num_blocks, generator=gen).tolist()
    pad_block = free_blocks.pop()
    scale = case.scale if case.scale is not None else head_size**-0.5

    cache_shape = cls.get_kv_cache_shape(num_blocks, block_size, case.num_kv_heads, head_size)
    standard = tuple(cache_shape) == (2, num_blocks, block_size, case.num_kv_heads, head_size)
    try:
        impls = [
            cls.get_impl_cls()(case.num_heads, head_size, scale, case.num_kv_heads, sliding_window=case.sliding_window)
            for _ in range(NUM_LAYERS)
        ]
    except NotImplementedError:
        if case.sliding_window is None:
            raise
        return  # the backend says it has no sliding windows: nothing to check here
    if per_head_kv_scales:  # KV head h: the scales times PER_HEAD_FACTORS[h]
        factors = torch.tensor(PER_HEAD_FACTORS[: case.num_kv_heads])
        k_scale, v_scale = k_scale * factors, v_scale * factors.flip(0)
    for impl in impls:
        if per_head_kv_scales:
            impl.k_head_scales, impl.v_head_scales = k_scale.clone(), v_scale.clone()
        else:
            impl.k_scale, impl.v_scale = k_scale, v_scale

    def rand(n: int, heads: int) -> torch.Tensor:  # [n, heads, D] in dtype, on device
        return torch.randn(n, heads, head_size, generator=gen).to(dtype).to(device)

    cache_dtype = kv_cache_torch_dtype(kv_cache_dtype, dtype)
    layers = []
    for impl in impls:
        query = [rand(n, case.num_heads) for n in lengths]
        key = [rand(n, case.num_kv_heads) for n in lengths]
        value = [rand(n, case.num_kv_heads) for n in lengths]
        layers.append(
            _Layer(
                impl=impl,
                kv_cache=torch.full(cache_shape, float("nan"), dtype=cache_dtype, device=device),
                query=query,
                key=key,
                value=value,
                cached_key=[_rounded(k, cache_dtype, k_scale) for k in key],
                cached_value=[_rounded(v, cache_dtype, v_scale) for v in value],
                k_scale=k_scale,
                v_scale=v_scale,
            )
        )

    block_ids: list[list[int]] = [[] for _ in lengths]
    num_computed = [0] * len(lengths)
    written = torch.zeros(num_blocks * block_size, dtype=torch.bool, device=device)  # [num_slots]
    tails = torch.zeros_like(written)  # slots that were ever past a request's length in its last block
    for step_idx, step in enumerate(case.steps):
        order = [r for r in torch.randperm(len(step), generator=gen).tolist() if step[r] > 0]
        for r in order:
            while len(block_ids[r]) * block_size < num_computed[r] + step[r]:
                block_ids[r].append(free_blocks.pop())
        common = _common_metadata(order, step, num_computed, block_ids, block_size, pad_block, device)
        attn_metadata = builder.build(common)
        written[common.slot_mapping] = True
        for r in order:
            length = num_computed[r] + step[r]
            if length % block_size:
                first = block_ids[r][length // block_size] * block_size
                tails[first + length % block_size : first + block_size] = True
        where = f"{label}, step {step_idx}"
        for i, layer in enumerate(layers):
            spans = [(num_computed[r], num_computed[r] + step[r]) for r in order]
            q = torch.cat([layer.query[r][a:b] for r, (a, b) in zip(order, spans)])  # [T, H, D]
            k = torch.cat([layer.key[r][a:b] for r, (a, b) in zip(order, spans)])  # [T, KVH, D]
            v = torch.cat([layer.value[r][a:b] for r, (a, b) in zip(order, spans)])
            out = layer.impl.forward(q, k, v, layer.kv_cache, attn_metadata)
            expected = torch.cat(
                [_reference(layer, r, a, b, scale, case.sliding_window) for r, (a, b) in zip(order, spans)]
            )
            if standard:  # a wrong write explains wrong outputs: say so first
                cached_k = torch.cat([layer.cached_key[r][a:b] for r, (a, b) in zip(order, spans)])
                cached_v = torch.cat([layer.cached_value[r][a:b] for r, (a, b) in zip(order, spans)])
                _assert_cache_written(
                    layer.kv_cache, cached_k, cached_v, common.slot_mapping, written, tails, f"{where}, layer {i}"
                )
            _assert_close(out, expected, q.shape, dtype, device, f"{where}, layer {i}", common)
        for r in order:
            num_computed[r] += step[r]


def _common_metadata(
    order: list[int],
    step: Sequence[int],
    num_computed: list[int],
    block_ids: list[list[int]],
    block_size: int,
    pad_block: int,
    device: torch.device,
) -> CommonAttentionMetadata:
    query_start_loc, seq_lens, slots = [0], [], []
    for r in order:
        start, end = num_computed[r], num_computed[r] + step[r]
        slots += [block_ids[r][p // block_size] * block_size + p % block_size for p in range(start, end)]
        query_start_loc.append(query_start_loc[-1] + step[r])
        seq_lens.append(end)
    max_blocks = max(len(block_ids[r]) for r in order)
    # Padding points at a block no request owns: it holds NaN, as stale memory may.
    table = [block_ids[r] + [pad_block] * (max_blocks - len(block_ids[r])) for r in order]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        context_lens=torch.tensor([num_computed[r] for r in order], dtype=torch.int32, device=device),
        block_table=torch.tensor(table, dtype=torch.int32, device=device),  # [B, max_blocks]
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),  # [T]
        num_reqs=len(order),
        num_actual_tokens=query_start_loc[-1],
        max_query_len=max(step[r] for r in order),
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens,
    )


def _reference(
    layer: _Layer, r: int, start: int, end: int, scale: float, sliding_window: int | None
) -> torch.Tensor:  # [end - start, H, D] float32, on the CPU
    """Positions ``start .. end-1`` of request ``r`` over its keys ``0 .. end-1``."""
    key, value = layer.cached_key[r][:end], layer.cached_value[r][:end]
    if _scaled(layer.k_scale) or _scaled(layer.v_scale):  # the stored float8 values times the calibrated scales
        key, value = key.float() * _per_row(layer.k_scale), value.float() * _per_row(layer.v_scale)
    return reference_attention(layer.query[r][start:end], key, value, scale, sliding_window)


def _kv_label(kv_cache_dtype: str) -> str:
    """A case label's cache part: empty for ``"auto"``, so labels read as before."""
    return "" if kv_cache_dtype == "auto" else f"kv_cache_dtype={kv_cache_dtype!r}, "


def _scaled(scale: float | torch.Tensor) -> bool:
    return isinstance(scale, torch.Tensor) or scale != 1.0


def _per_row(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A scale as it multiplies ``[S, KVH, D]`` rows: per head ``[KVH, 1]``."""
    return scale[:, None] if isinstance(scale, torch.Tensor) else scale


def _rounded(x: torch.Tensor, cache_dtype: torch.dtype, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``x`` as a cache of ``cache_dtype`` holds it, in ``cache_dtype``: float8
    ``x / scale`` (in float32; per KV head where ``scale`` is ``[KVH]``) saturated at its
    largest finite value (vLLM's cache write)."""
    if not is_fp8(cache_dtype):
        return x.to(cache_dtype)
    limit = torch.finfo(cache_dtype).max
    return (x.float() / _per_row(scale)).clamp(-limit, limit).to(cache_dtype)


def reference_attention(
    query: torch.Tensor,  # [Q, H, D]: the request's last Q positions
    key: torch.Tensor,  # [S, KVH, D]: every position of the request, cached and new
    value: torch.Tensor,  # [S, KVH, D]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [Q, H, D] float32, on the CPU
    """Causal attention of one request in float32, the definition backends are held to.

    Query ``i`` sits at position ``S - Q + i`` and attends keys ``0 ..`` that
    position (the last ``sliding_window`` of them, if set); query head ``h``
    reads KV head ``h // (H // KVH)``."""
    q = query.float().cpu()
    group = q.shape[1] // key.shape[1]
    k = key.float().cpu().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D]
    v = value.float().cpu().repeat_interleave(group, dim=1).transpose(0, 1)
    seq_len, query_len = k.shape[1], q.shape[0]
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    allowed = key_pos <= query_pos  # [Q, S]
    if sliding_window is not None:
        allowed &= key_pos > query_pos - sliding_window
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, Q, S]
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return (probs @ v).transpose(0, 1)  # [Q, H, D]


def _assert_close(
    out: object,
    expected: torch.Tensor,  # [T, H, D] float32
    shape: torch.Size,
    dtype: torch.dtype,
    device: torch.device,
    where: str,
    common: CommonAttentionMetadata,
    tolerances: dict[torch.dtype, tuple[float, float]] = ATTENTION_TOLERANCES,
) -> None:
    if not isinstance(out, torch.Tensor):
        raise AssertionError(f"{where}: forward returned {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(shape) or out.dtype != dtype or out.device.type != device.type:
        raise AssertionError(
            f"{where}: forward returned {tuple(out.shape)} {out.dtype} on {out.device}, "
            f"expected {tuple(shape)} {dtype} on {device}"
        )
    got = out.float().cpu()
    request_of = torch.bucketize(torch.arange(got.shape[0]), torch.tensor(common.query_start_loc_cpu[1:]), right=True)
    bad = ~got.isfinite()
    if bad.any():
        t = int(bad.nonzero()[0, 0])
        raise AssertionError(
            f"{where}: output has {int(bad.sum())} NaN/inf values, first at token {t} (request "
            f"{int(request_of[t])} of the step): unused or padding KV slots leaked into the result"
        )
    atol, rtol = tolerances[dtype]
    err = (got - expected).abs()
    excess = err - (atol + rtol * expected.abs())
    if excess.max() > 0:
        flat = int(excess.argmax())
        t, h = flat // (shape[1] * shape[2]), flat // shape[2] % shape[1]
        raise AssertionError(
            f"{where}: output differs from the float32 reference: max |out - ref| = "
            f"{err.max().item():.3g}; at token {t} (request {int(request_of[t])} of the step), head {h}: "
            f"|out - ref| = {err.flatten()[flat].item():.3g} > atol + rtol * |ref| = "
            f"{atol:g} + {rtol:g} * {expected.abs().flatten()[flat].item():.3g} (tolerances for {dtype})"
        )


def _assert_cache_written(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    written: torch.Tensor,  # [num_slots] bool: in some step's slot_mapping so far
    tails: torch.Tensor,  # [num_slots] bool: past a request's length in its last block, in some step
    where: str,
) -> None:
    """Standard layout only: this step's keys and values sit at their slots,
    exactly, and every slot no ``slot_mapping`` named is still NaN (or, in a
    request's unwritten tail, zero)."""
    num_kv_heads, head_size = kv_cache.shape[-2:]
    for which, name, new in ((0, "key", key), (1, "value", value)):
        cache = kv_cache[which].reshape(-1, num_kv_heads, head_size)  # [num_slots, KVH, D]
        stored = cache.index_select(0, slot_mapping)
        same = (stored.float() == new.float()).flatten(1).all(-1)  # [T]; float8 has no CPU ==
        if not same.all():
            t = int((~same).nonzero()[0, 0])
            raise AssertionError(
                f"{where}: the {name} of token {t} is not at its slot {int(slot_mapping[t])} "
                "(slot_mapping), or not stored exactly"
            )
        cleared = tails & (cache.float() == 0).flatten(1).all(-1)
        stray = ~written & ~cleared & ~cache.float().isnan().flatten(1).all(-1)
        if stray.any():
            raise AssertionError(
                f"{where}: {name}s were written to slots that no slot_mapping named, "
                f"e.g. slot {int(stray.nonzero()[0, 0])}"
            )


__all__ = [
    "ATTENTION_TOLERANCES",
    "CASES",
    "AttentionCase",
    "accepted_configurations",
    "check_attention_backend",
    "reference_attention",
]
