"""What one attention layer keeps in the KV cache per token: the per-layer cache spec.

A model declares one spec per layer (``get_kv_cache_specs``); the model runner
sizes the cache from the specs' real bytes per token, asks the attention backend
for each layer's tensor shape (``AttentionBackend.get_kv_cache_shape_for_spec``)
and allocates it. Three kinds exist:

- ``FullAttentionSpec``: a key and a value of ``head_size`` per kv-head.
- ``SlidingWindowSpec``: the same, attended over the last ``sliding_window`` tokens.
- ``MLAAttentionSpec``: multi-head latent attention (DeepSeek-V2/V3): one shared
  vector of ``kv_lora_rank + qk_rope_head_dim`` per token, no per-head K or V.

A spec's ``dtype`` is what the cache holds: the model's dtype with
``kv_cache_dtype="auto"``, a float8 type with ``"fp8"``/``"fp8_e4m3"``/``"fp8_e5m2"``
(half a bf16 cache's bytes, so twice the blocks in one budget). The backend
stores rows rounded to it and reads them back in the model's dtype.

Every layer is paged with the same block size and the same block table: layers
with equal specs form one group (``group_layers``), and a block id addresses a
block in every layer's cache. A model may mix kinds (MLA and full layers,
windowed and full layers); the memory of a block is the sum over its layers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


# vLLM's names: "fp8" is e4m3 (the "fn" variant: finite, max 448), as on
# NVIDIA and Intel hardware. Scales are 1.0 (see is_fp8).
_FP8_KV_CACHE_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type the cache holds for the config's ``kv_cache_dtype``
    (validated by ``CacheSection``): ``"auto"`` is the model's dtype."""
    return model_dtype if kv_cache_dtype == "auto" else _FP8_KV_CACHE_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` stores float8 rows: written saturated to the
    format's finite range, divided by the layer's per-tensor ``k_scale`` / ``v_scale``
    (a checkpoint's calibrated scales, else 1.0, as vLLM), read back by upcasting."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def kv_cache_dtype_option(kv_cache_dtype: str) -> dict[str, str]:
    """What ``validate_configuration`` is passed for ``kv_cache_dtype``: nothing for ``"auto"``
    (so a backend written before the keyword existed is still asked), else the keyword."""
    return {} if kv_cache_dtype == "auto" else {"kv_cache_dtype": kv_cache_dtype}


def refuse_fp8_kv_cache(backend: str, kv_cache_dtype: str) -> list[str]:
    """``validate_configuration``'s reason for a backend that stores no float8 cache."""
    if kv_cache_dtype == "auto":
        return []
    return [
        f"the {backend} backend has no FP8 KV cache (kv_cache_dtype={kv_cache_dtype!r}); "
        "use kv_cache_dtype='auto', or attention_backend='triton' (NVIDIA GPUs) or 'torch', which serve it"
    ]


@dataclass(frozen=True)
class KVCacheSpec:
    """The cache of one layer. ``dtype``: the element type the cache holds."""

    block_size: int
    dtype: torch.dtype

    @property
    def elements_per_token(self) -> int:
        raise NotImplementedError

    @property
    def bytes_per_token(self) -> int:
        return self.elements_per_token * _element_size(self.dtype)

    @property
    def page_size_bytes(self) -> int:
        """Bytes of one block of this layer."""
        return self.block_size * self.bytes_per_token


@dataclass(frozen=True)
class FullAttentionSpec(KVCacheSpec):
    """A key and a value of ``head_size`` for each of ``num_kv_heads`` heads, per token.

    Attributes:
        block_size: ``int``, tokens per block (the engine's ``block_size``).
        dtype: ``torch.dtype`` the cache holds (the model's dtype, or float8).
        num_kv_heads: ``int``, key/value heads of this layer on this rank.
        head_size: ``int``, elements of one head's key (and value).
    """

    num_kv_heads: int
    head_size: int

    @property
    def elements_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_size


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Full-attention K/V, attended only over the last ``sliding_window`` tokens.

    vframe keeps the whole history of such a layer (its blocks are shared with
    the other layers' block table); the window is a mask, not a saving.

    Attributes:
        block_size: ``int``, tokens per block.
        dtype: ``torch.dtype`` the cache holds.
        num_kv_heads: ``int``, key/value heads of this layer on this rank.
        head_size: ``int``, elements of one head's key (and value).
        sliding_window: ``int``, how many of the latest tokens a query attends.
    """

    sliding_window: int


@dataclass(frozen=True)
class MLAAttentionSpec(KVCacheSpec):
    """Multi-head latent attention: per token one vector of ``kv_lora_rank``
    (the normalized latent ``c_kv``) followed by ``qk_rope_head_dim`` (the
    rotated key part shared by every head), ``latent_size`` elements in all.

    Attributes:
        block_size: ``int``, tokens per block.
        dtype: ``torch.dtype`` the cache holds.
        kv_lora_rank: ``int``, ``R``, elements of the latent ``c_kv``.
        qk_rope_head_dim: ``int``, ``P``, elements of the rotated shared key.
    """

    kv_lora_rank: int
    qk_rope_head_dim: int

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def elements_per_token(self) -> int:
        return self.latent_size


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers (indices into the model's layer list) with one and the same spec."""

    spec: KVCacheSpec
    layer_indices: tuple[int, ...]


def group_layers(specs: list[KVCacheSpec]) -> list[KVCacheGroup]:
    """Layers with equal specs, grouped in order of first appearance."""
    groups: dict[KVCacheSpec, list[int]] = {}
    for index, spec in enumerate(specs):
        groups.setdefault(spec, []).append(index)
    return [KVCacheGroup(spec, tuple(indices)) for spec, indices in groups.items()]


def bytes_per_block(specs: list[KVCacheSpec]) -> int:
    """Bytes one block id costs across every layer."""
    return sum(spec.page_size_bytes for spec in specs)


def full_attention_specs(
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    sliding_window: int | None = None,
) -> list[KVCacheSpec]:
    """``num_layers`` identical full-attention specs (windowed if ``sliding_window``):
    what a decoder of standard attention layers caches."""
    spec: KVCacheSpec
    if sliding_window is None:
        spec = FullAttentionSpec(block_size, dtype, num_kv_heads, head_size)
    else:
        spec = SlidingWindowSpec(block_size, dtype, num_kv_heads, head_size, sliding_window)
    return [spec] * num_layers


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
