"""The interfaces of vframe's core.

Every concrete scheduler, scheduling policy, KV cache manager, model runner,
executor, sampler, logits processor and attention backend implements one of these and is found by name in a plugin registry
(``vframe.plugins.registry``). The engine only ever talks to these types.

Shapes use ``T`` for the number of tokens scheduled in one step (all requests
flattened, no padding), ``B`` for the number of requests in the step, ``H`` for
query heads, ``KVH`` for key/value heads, ``D`` for the head size, ``V`` for the
vocabulary size.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:
    import torch

    from vframe.core.config import EngineConfig
    from vframe.core.kv_cache_spec import KVCacheSpec
    from vframe.core.outputs import (
        EngineCoreOutput,
        ModelRunnerOutput,
        RequestError,
        SamplerOutput,
        SchedulerOutput,
    )
    from vframe.core.plugin_context import PluginContext
    from vframe.core.request import Request, RequestStatus
    from vframe.core.sample.metadata import SamplingMetadata
    from vframe.core.sampling_params import SamplingParams
    from vframe.lora.request import LoRARequest


# --------------------------------------------------------------------------- #
# Attention
# --------------------------------------------------------------------------- #


@dataclass
class CommonAttentionMetadata:
    """Per-step description of the flattened batch, shared by every backend.

    For a step with two requests, one prefill chunk of 3 tokens on top of 4
    cached ones and one decode of 1 token on top of 6::

        tokens        | r0 r0 r0 | r1 |
        query_start_loc = [0, 3, 4]
        seq_lens        = [7, 7]          (cached + new, per request)
        context_lens    = [4, 6]          (cached before this step)

    ``slot_mapping[t] = block_id * block_size + offset`` is where token ``t``'s
    key and value are written; ``block_table[b]`` lists request ``b``'s blocks.

    Built by the model runner once per step and handed to the backend's
    ``AttentionMetadataBuilder.build``. Row ``b`` is the ``b``-th request of the
    step (the order of ``SchedulerOutput.num_scheduled_tokens``); tokens are
    flattened request after request with no padding. Tensors are on the
    model's device; the ``*_cpu`` fields are plain Python lists (not tensors:
    index them, don't call ``.tolist()``).

    Attributes:
        query_start_loc: ``[B + 1]`` int32; request ``b``'s tokens are rows
            ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` of the step's
            ``[T, ...]`` tensors. ``query_start_loc[0] == 0``,
            ``query_start_loc[B] == T``.
        seq_lens: ``[B]`` int32, tokens of request ``b`` whose KV exists once
            this step has written its keys and values (cached plus new).
        context_lens: ``[B]`` int32, tokens of request ``b`` already in the KV
            cache before this step; its new tokens sit at positions
            ``context_lens[b] .. seq_lens[b] - 1``.
        block_table: ``[B, max_blocks_per_req]`` int32; row ``b`` lists request
            ``b``'s KV block ids in position order (token at position ``p`` is in
            block ``block_table[b, p // block_size]``). ``max_blocks_per_req`` is
            the most blocks any request of this step holds, so the width changes
            from step to step. Unused entries are 0, which is also a real block
            id: never read past ``ceil(seq_lens[b] / block_size)``.
        slot_mapping: ``[T]`` int64, the KV cache slot of each new token,
            ``block_id * block_size + position % block_size``, in the flattened
            ``[num_blocks * block_size, ...]`` view of one layer's cache.
        num_reqs: ``B``, requests in the step.
        num_actual_tokens: ``T``, tokens in the step (``query_start_loc[B]``).
        max_query_len: the most new tokens of one request in this step
            (1 when every request decodes).
        max_seq_len: ``max(seq_lens)``.
        block_size: tokens per KV block (the ``block_size`` setting).
        query_start_loc_cpu: ``B + 1`` ints, the values of ``query_start_loc``
            on the host, so that a backend can plan without a device sync.
        seq_lens_cpu: ``B`` ints, the values of ``seq_lens`` on the host.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32
    context_lens: torch.Tensor  # [B] int32
    block_table: torch.Tensor  # [B, max_blocks_per_req] int32
    slot_mapping: torch.Tensor  # [T] int64
    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    # Host copies, so that backends can plan without a device sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]


class AttentionImpl(ABC):
    """One attention layer's computation over the paged KV cache.

    The model builds one per attention layer, when it is constructed, as
    ``Impl(num_heads, head_size, scale, num_kv_heads, sliding_window=...)``
    (the built-in Llama passes ``scale = head_size ** -0.5`` and the checkpoint
    config's ``sliding_window``). That happens on the CPU, before the model is
    moved to its device, and an ``AttentionImpl`` is no ``nn.Module``: a tensor
    made in ``__init__`` stays on the CPU, so allocate device buffers on first
    use in ``forward``.

    Calibrated FP8 KV-cache scales (plugin API 1.19): a checkpoint may carry a
    per-layer ``k_scale`` and ``v_scale`` (llm-compressor's ``kv_cache_scheme``,
    ModelOpt's, vLLM's FP8 checkpoints); the loader sets them on the layer's
    impl as the floats ``k_scale`` / ``v_scale`` (1.0 where it carries none)
    before the first ``forward``. With a float8 cache a key is stored as
    ``fp8(key / k_scale)`` (the division in float32, saturating at the format's
    largest finite value) and read as ``fp8 * k_scale``, values likewise; with
    a cache in the model's dtype they mean nothing. A backend that applies them
    says so with ``supports_kv_cache_scales = True``; an engine with
    ``kv_cache_dtype="fp8..."`` refuses a checkpoint whose scales are not all 1.0
    on any other (with ``kv_cache_dtype="auto"`` they go unused).

    Per KV head (plugin API 1.22: llm-compressor's ``kv_cache_scheme`` with
    ``strategy: attn_head``): the loader sets ``k_head_scales`` / ``v_head_scales``
    instead, float32 ``[num_kv_heads]`` tensors on the CPU (this rank's heads;
    ``k_scale`` / ``v_scale`` stay 1.0), and a float8 cache stores head ``h``'s
    keys as ``fp8(key[:, h] / k_head_scales[h])``, values likewise. A backend
    that applies them says so with ``supports_per_head_kv_scales = True``; an
    engine refuses them with a float8 cache on any other. ``kv_head_scales``
    gives either kind per KV head, for a backend that handles both one way.
    """

    supports_kv_cache_scales: ClassVar[bool] = False
    supports_per_head_kv_scales: ClassVar[bool] = False
    k_scale: float = 1.0
    v_scale: float = 1.0
    k_head_scales: torch.Tensor | None = None
    v_head_scales: torch.Tensor | None = None

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        sliding_window: int | None = None,
    ) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window

    @property
    def has_kv_head_scales(self) -> bool:
        """Whether the checkpoint gave this layer calibrated scales per KV head (keys or values)."""
        return self.k_head_scales is not None or self.v_head_scales is not None

    @property
    def has_kv_cache_scales(self) -> bool:
        """Whether the checkpoint gave this layer calibrated scales (per tensor or per head)."""
        return self.has_kv_head_scales or (self.k_scale, self.v_scale) != (1.0, 1.0)

    def kv_head_scales(self, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """The calibrated scales per KV head, float32 ``[num_kv_heads]`` each on ``device``:
        ``k_head_scales`` / ``v_head_scales`` where the checkpoint gave them per head, else
        ``k_scale`` / ``v_scale`` repeated (plugin API 1.22). Kept per device once made."""
        return self._head_scales(device)[:2]

    def _head_scales(self, device: torch.device | str) -> tuple[torch.Tensor, ...]:
        """``kv_head_scales`` and the same repeated over each KV head's query heads, ``[H]``
        each (what ``fold_kv_head_scales`` multiplies by), made once per device."""
        import torch

        device = torch.device(device)
        kept = vars(self).get("_kv_head_scales")
        if kept is None or kept[0].device != device:
            k = self.k_head_scales if self.k_head_scales is not None else torch.full((self.num_kv_heads,), self.k_scale)
            v = self.v_head_scales if self.v_head_scales is not None else torch.full((self.num_kv_heads,), self.v_scale)
            k, v = k.float().to(device), v.float().to(device)
            group = self.num_heads // self.num_kv_heads
            kept = self._kv_head_scales = (k, v, k.repeat_interleave(group), v.repeat_interleave(group))
        return kept

    def fold_kv_head_scales(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-KV-head scales applied around kernels that take one scale a layer (plugin API
        1.22), for a float8 cache: ``key[:, h] / k[h]`` and ``value[:, h] / v[h]`` in float32
        (what the cache stores, rounded once into float8), the query heads of KV head ``h``
        times ``k[h]`` (in float32, then the query's dtype), and the factor ``[H, 1]``
        (float32: ``v`` per query head) that multiplies the attention output, with ``k``, ``v``
        this layer's ``kv_head_scales``. The kernels then attend at scale 1.0 (and the
        layer's own softmax scale): ``softmax(scale * q k[h] . key / k[h]) value / v[h] * v[h]``."""
        k_scales, v_scales, k_query, v_query = self._head_scales(query.device)  # [KVH], [KVH], [H], [H]
        query = (query.float() * k_query[:, None]).to(query.dtype)
        factor = v_query[:, None]  # [H, 1]: the output rounded once
        return query, key.float() / k_scales[:, None], value.float() / v_scales[:, None], factor

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # backend's get_kv_cache_shape(...)
        attn_metadata: Any,  # what the backend's metadata builder built
    ) -> torch.Tensor:  # [T, H, D]
        """Write this step's key/value into ``kv_cache`` at ``slot_mapping``,
        then attend each query causally over its request's cached and new tokens.

        ``query`` ``[T, H, D]``, ``key`` and ``value`` ``[T, KVH, D]``, in the
        model's dtype, rows ordered as ``CommonAttentionMetadata.query_start_loc``
        says. ``kv_cache``: this layer's cache, shaped by the backend's
        ``get_kv_cache_shape(num_blocks, block_size, KVH, D)``, in the model's
        dtype, zero-filled at start-up. ``attn_metadata``: what this backend's
        ``AttentionMetadataBuilder.build`` returned for the step, the same
        object for every layer. Returns ``[T, H, D]``.

        Nothing else in the cache is written, except that (plugin API 1.16) a
        backend may set to zero the unwritten tail of a request's last block:
        the slots past ``seq_lens[b]`` in the block holding its last token,
        which no other request holds and only its later tokens fill."""


class MLAAttentionImpl(ABC):
    """One multi-head latent attention layer (DeepSeek-V2/V3) over the paged
    latent cache, in the absorbed form (plugin API 1.3).

    The model absorbs the key up-projection into the query and the value
    up-projection into the output, so what is left is multi-query attention
    with one shared "head" of ``kv_lora_rank + qk_rope_head_dim`` elements per
    token, the cache entry itself. Its first ``kv_lora_rank`` elements are also
    the value::

        score(h, t, s) = scale * q[t, h] . cache[s]             # both [R + P]
        out[t, h]      = sum_s softmax_s(score) * cache[s, :R]  # [R]

    The model builds one per MLA layer as
    ``Impl(num_heads, kv_lora_rank, qk_rope_head_dim, scale)``; like
    ``AttentionImpl`` it is built on the CPU and is no ``nn.Module``, and it has
    the same ``k_scale`` / ``v_scale`` / ``supports_kv_cache_scales`` (plugin API
    1.19): the latent is one cache, so ``k_scale`` scales all of it (as in vLLM),
    and a ``v_scale`` other than 1.0 or ``k_scale`` is refused at load.
    """

    supports_kv_cache_scales: ClassVar[bool] = False
    k_scale: float = 1.0
    v_scale: float = 1.0

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float) -> None:
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.scale = scale

    @property
    def latent_size(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, H, R + P]
        latent: torch.Tensor,  # [T, R + P]
        kv_cache: torch.Tensor,  # backend's get_kv_cache_shape_for_spec(MLAAttentionSpec, ...)
        attn_metadata: Any,  # what the backend's metadata builder built
    ) -> torch.Tensor:  # [T, H, R]
        """Write this step's ``latent`` rows into ``kv_cache`` at ``slot_mapping``,
        then attend each query causally over its request's cached and new
        latents, as the class docstring writes it.

        ``query``: ``[T, H, R + P]``, the absorbed no-position part then the
        rotated part. ``latent``: ``[T, R + P]``, the normalized ``c_kv`` then
        the rotated shared key. Both in the model's dtype, rows ordered as
        ``CommonAttentionMetadata.query_start_loc`` says. Returns ``[T, H, R]``
        (the model applies the value up-projection)."""


class AttentionMetadataBuilder(ABC):
    """Turns the common per-step metadata into what one backend's kernels need.

    One builder per model runner: constructed once, after the model is loaded,
    as ``Builder(config: EngineConfig, device: torch.device)`` (the model's
    device). ``build`` is then called every step, before the forward pass; a
    builder may keep buffers across steps, while each step's
    ``CommonAttentionMetadata`` is new and describes that step only.
    """

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any:
        """This step's attention metadata, passed unchanged to every layer's
        ``AttentionImpl.forward`` as ``attn_metadata``."""


class AttentionBackend(ABC):
    """A class of static answers about one attention implementation."""

    name: ClassVar[str]
    supports_cuda_graphs: ClassVar[bool] = False
    """Whether the model runner may capture this backend's decode steps in CUDA graphs
    (plugin API 1.15; ``vframe/core/worker/cuda_graphs.py``). A backend that sets it
    promises, for a step in which every request decodes one token:

    - ``build(common)`` returns metadata that reads ``common``'s tensors in place (views,
      no copies: the runner rewrites them before every replay); whatever else it holds
      depends only on ``num_reqs`` (a decode step's ``query_start_loc`` is ``0..B``);
    - ``forward`` only enqueues device work: no host synchronisation, no copy from host
      memory, no size read from a tensor's values;
    - what ``forward`` decides from ``max_seq_len`` (a split count) is right for every
      step whose sequences are at most that long: the runner builds the metadata once
      per graph with ``max_seq_len = max_model_len``;
    - rows past the step's requests are ordinary one-token decodes (in a scratch block
      the scheduler never hands out), so padding needs nothing of the backend.

    The model class must declare ``supports_cuda_graphs`` too (its forward captures
    as a whole)."""

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]: ...

    @staticmethod
    @abstractmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @classmethod
    def get_mla_impl_cls(cls) -> type[MLAAttentionImpl]:
        """The implementation MLA layers build (plugin API 1.3). A backend that
        serves MLA overrides this (and ``get_kv_cache_shape_for_spec`` if its
        latent cache is not laid out as the default's), and accepts
        ``use_mla=True`` in ``validate_configuration``."""
        raise NotImplementedError(f"attention backend {cls.name!r} does not implement MLA")

    @classmethod
    def get_kv_cache_shape_for_spec(cls, spec: KVCacheSpec, num_blocks: int) -> tuple[int, ...]:
        """The shape of one layer's cache of ``num_blocks`` blocks for its spec
        (plugin API 1.3). The default serves full-attention and sliding-window
        specs through ``get_kv_cache_shape``, and gives an ``MLAAttentionSpec``
        the standard latent layout ``(num_blocks, block_size, latent_size)``
        (the torch and Triton backends'; what ``swap_blocks`` assumes)."""
        from vframe.core.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec

        if isinstance(spec, FullAttentionSpec):
            return cls.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
        if isinstance(spec, MLAAttentionSpec):
            return (num_blocks, spec.block_size, spec.latent_size)
        raise NotImplementedError(f"attention backend {cls.name!r} has no cache layout for {type(spec).__name__}")

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
        """Copy blocks ``src_to_dst[:, 0]`` of one layer's cache ``src`` into blocks
        ``src_to_dst[:, 1]`` of ``dst`` (device <-> swap space). The default assumes
        the block dimension is dim 1 of ``get_kv_cache_shape``, as in ``(2, num_blocks, ...)``,
        or dim 0 of a cache with one dimension less (an MLA latent cache of
        ``(num_blocks, block_size, latent_size)``): ``src.dim()`` tells which."""
        src_ids = src_to_dst[:, 0].to(src.device)
        dst_ids = src_to_dst[:, 1].to(dst.device)
        if src.dim() == 3:
            dst[dst_ids] = src[src_ids].to(dst.device)
        else:
            dst[:, dst_ids] = src[:, src_ids].to(dst.device)

    @classmethod
    def validate_configuration(
        cls,
        *,
        head_size: int,
        dtype: torch.dtype,
        device: str,
        block_size: int,
        use_mla: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> list[str]:
        """Every reason this backend cannot serve the configuration; empty if it can.

        Called once, when the model runner selects the backend (after the
        checkpoint config is read, before the model is built), with keyword
        arguments only:

        - ``head_size``: ``int``, ``D``, the model's attention head size.
        - ``dtype``: ``torch.dtype`` the model computes and caches KV in
          (``torch.float32``, ``torch.bfloat16`` or ``torch.float16``).
        - ``device``: ``str``, the device type, ``"cpu"`` or ``"cuda"``.
        - ``block_size``: ``int``, tokens per KV block.
        - ``use_mla``: ``bool``, the model caches a multi-head latent
          (DeepSeek-V2/V3 MLA): its config has a ``kv_lora_rank``.
        - ``kv_cache_dtype``: ``str``, vLLM's name of what the cache holds:
          ``"auto"`` (``dtype``) or ``"fp8"``/``"fp8_e4m3"``/``"fp8_e5m2"``
          (float8 K/V, scale 1.0 or the checkpoint's calibrated ``k_scale`` /
          ``v_scale``; the spec's ``dtype`` is then a float8 type).
          Passed only when not ``"auto"``: a backend whose method does not take
          it is refused an fp8 cache. This default refuses every fp8 cache.

        Return one sentence per problem, naming the value and what would work
        (``"head_size 80 is not supported; use 64, 128 or 256"``); the runner
        raises ``ConfigError`` with all of them."""
        from vframe.core.kv_cache_spec import refuse_fp8_kv_cache

        return refuse_fp8_kv_cache(cls.name, kv_cache_dtype)

    @classmethod
    def check_available(cls) -> list[str]:
        """Reasons this backend cannot run on this machine at all (missing packages, no GPU)."""
        return []


# --------------------------------------------------------------------------- #
# KV cache manager
# --------------------------------------------------------------------------- #


class KVCacheManager(ABC):
    """Owns the KV cache blocks. The scheduler never sees free lists, hashes or
    reference counts: it asks for slots and gets block ids back, or ``None``.

    One per engine, constructed after the model runner has allocated the cache
    as ``Manager(num_blocks, block_size, enable_caching, hash_algo=...,
    num_swap_blocks=...)``: ``num_blocks`` from
    ``ModelRunner.determine_num_kv_blocks``, ``block_size`` and
    ``enable_caching`` from the ``block_size`` and ``enable_prefix_caching``
    settings, ``hash_algo`` ``"builtin"`` or ``"sha256"``
    (``prefix_caching_hash_algo``), ``num_swap_blocks`` 0 unless
    ``preemption_mode="swap"``. Block ids are ``0 .. num_blocks - 1``, indices
    into the runner's per-layer caches. The scheduler calls it; the engine
    too, for ``can_ever_fit``, ``reset_prefix_cache`` and ``get_stats``. Every
    call comes from the engine's one thread."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        hash_algo: str = "builtin",
        num_swap_blocks: int = 0,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.num_swap_blocks = num_swap_blocks

    @abstractmethod
    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Blocks of the request's prompt already in the prefix cache, and how
        many tokens they cover. ``([], 0)`` when caching is off or nothing hits."""

    @abstractmethod
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens of ``request``.

        Returns the block ids newly appended to the request's block table, or
        ``None`` when there are not enough free blocks (someone must be preempted).
        On ``None`` nothing has changed. New blocks are not prefix-cache hits for
        anyone until ``cache_blocks`` says their KV is written."""

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """The step that computed the request's tokens up to ``num_computed_tokens``
        has run: its full blocks may now be found by ``get_computed_blocks``.
        Called by the scheduler after every successful step, for every request
        that ran in it and still holds its blocks. A manager without a prefix
        cache need not override it."""

    def is_being_computed(self, request: Request) -> bool:
        """Whether the block after the request's prefix-cache hits is being computed
        in this step by another request: the scheduler then admits it next step,
        when that block is a hit, instead of computing the same prefix twice."""
        return False

    @abstractmethod
    def free(self, request: Request) -> None:
        """Return the request's blocks (cached ones stay reusable until evicted)."""

    @abstractmethod
    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table."""

    @property
    @abstractmethod
    def usage(self) -> float:
        """Fraction of blocks in use, 0.0 to 1.0."""

    @property
    @abstractmethod
    def num_free_blocks(self) -> int: ...

    @abstractmethod
    def reset_prefix_cache(self) -> bool:
        """Forget every cached block hash. False if blocks are still in use."""

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        """Move the request's blocks to the swap space and free them.

        Returns the (device block, swap block) copies to make before the next
        forward pass, or ``None`` (nothing changed) when the swap space is full."""
        raise NotImplementedError(f"{type(self).__name__} does not support swap preemption")

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Give a swapped-out request device blocks for its computed tokens plus
        ``num_new_tokens``; returns the (swap block, device block) copies, or
        ``None`` (nothing changed) when free blocks do not suffice."""
        raise NotImplementedError(f"{type(self).__name__} does not support swap preemption")

    def get_stats(self) -> dict[str, float]:
        return {"kv_cache_usage": self.usage}

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens fits in the whole cache."""
        return -(-num_tokens // self.block_size) <= self.num_blocks


# --------------------------------------------------------------------------- #
# Scheduler
# --------------------------------------------------------------------------- #


class Scheduler(ABC):
    """Decides, each step, how many tokens each request runs under one token budget.

    One per engine, constructed as ``Scheduler(config: EngineConfig,
    kv_cache_manager: KVCacheManager)`` once the KV cache exists; the budget is
    ``config.scheduler.max_num_batched_tokens``, already resolved by the engine.
    Each engine step calls ``schedule()``, hands its ``SchedulerOutput`` to
    ``ModelRunner.execute_model``, then passes both outputs to
    ``update_from_output``; requests arrive through ``add_request`` between
    steps. Every call comes from the engine's one thread. The scheduler asks
    the KV cache manager for room and never touches blocks itself."""

    def __init__(self, config: EngineConfig, kv_cache_manager: KVCacheManager) -> None:
        self.config = config
        self.kv_cache_manager = kv_cache_manager

    @abstractmethod
    def add_request(self, request: Request) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: Iterable[str]) -> list[Request]:
        """Finish these requests as aborted and free their blocks. Unknown ids are ignored."""

    @abstractmethod
    def schedule(self) -> SchedulerOutput: ...

    @abstractmethod
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, free finished requests.

        Registers the step's computed blocks with ``KVCacheManager.cache_blocks``
        and finishes ``runner_output.failed`` requests with ``finish_reason="error"``
        and ``runner_output.stopped`` ones as stopped."""

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """Finish requests for a reason found outside the core (a stop string) and
        free their blocks. Unknown ids are ignored. (Plugin API 1.1: declared here;
        the engine has always called it.)"""
        raise NotImplementedError(f"{type(self).__name__} must implement Scheduler.finish_requests")

    def fail_requests(self, errors: dict[str, RequestError]) -> list[EngineCoreOutput]:
        """Finish requests (``req_id -> why``) with ``finish_reason="error"``: used
        when a step raised, for the requests that ran in it, and for the runner's
        ``ModelRunnerOutput.failed``. Nothing of a failed step may become a
        prefix-cache hit. Returns one finished output per request. (Plugin API 1.1.)"""
        from vframe.core.outputs import EngineCoreOutput, FinishReason
        from vframe.core.request import RequestStatus

        self.finish_requests(list(errors), RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(r, [], finish_reason=FinishReason.ERROR, error=e) for r, e in errors.items()]

    @abstractmethod
    def has_unfinished_requests(self) -> bool: ...

    @abstractmethod
    def get_num_unfinished_requests(self) -> int: ...

    def get_stats(self) -> dict[str, float]:
        return {}


class RequestView(Protocol):
    """The fields of a request that a scheduling policy may read (plugin API 1.2).

    The engine passes its ``Request`` objects; read these, change nothing.

    Attributes:
        request_id: the id the request was added with.
        priority: the request's priority as given by the user (``0`` unless set;
            lower runs first under the built-in ``priority`` policy).
        arrival_time: ``time.monotonic()`` when the request entered the engine.
        num_prompt_tokens: tokens in its prompt.
        max_tokens: most tokens it may generate, already capped by ``max_model_len``.
        num_computed_tokens: tokens whose KV is in the cache: ``0`` while waiting
            for the first time and after a preemption that recomputes; a request
            swapped out keeps the count it reached.
        num_output_tokens: tokens generated so far.
        num_preemptions: how often it was preempted.
        sampling_params: its ``SamplingParams``.
    """

    @property
    def request_id(self) -> str: ...
    @property
    def priority(self) -> int: ...
    @property
    def arrival_time(self) -> float: ...
    @property
    def num_prompt_tokens(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def num_output_tokens(self) -> int: ...
    @property
    def num_preemptions(self) -> int: ...
    @property
    def sampling_params(self) -> SamplingParams: ...


class SchedulingPolicy(ABC):
    """Which waiting request the scheduler admits next, and which running request
    it preempts first when KV blocks run out (plugin API 1.2).

    Selected by the ``scheduling_policy`` setting; the built-in scheduler asks
    the policy, a replacement scheduler may too. Constructed once per engine as
    ``Policy(config: EngineConfig)``.
    """

    uses_priority: ClassVar[bool] = False
    """Whether the policy reads ``request.priority``. When ``False`` the engine
    refuses requests with a ``priority`` other than 0 instead of ignoring it."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def sort_key(self, request: RequestView) -> tuple[Any, ...]:
        """The request's place in the waiting queue: smallest first, ties in order
        of arrival. Computed when the request enters the queue (on arrival, and
        again when it is preempted), so it must depend only on the request.
        Running requests are preempted largest key first (latest arrival among
        equal keys), so a policy orders both decisions at once."""


# --------------------------------------------------------------------------- #
# Model runner
# --------------------------------------------------------------------------- #


class ModelRunner(ABC):
    """Turns a scheduler decision into tensors, runs the model and samples.

    One per engine, constructed as ``Runner(config: EngineConfig)``. The engine
    then calls ``load_model()``, ``determine_num_kv_blocks()``,
    ``initialize_kv_cache(num_blocks)`` (and, with ``preemption_mode="swap"``,
    ``determine_num_swap_blocks()`` and ``initialize_swap_space(num_blocks)``)
    once, and ``execute_model(scheduler_output)`` every step.

    ``load_model()`` must set the attributes below: the engine reads them
    (plugin API 1.2; before, they were an undocumented part of the built-in runner).

    Attributes:
        resolved: the model files (``vframe.models.loader.ResolvedModel``: the
            directory, or the GGUF file and its converted directory) that the
            tokenizer is loaded from.
        hf_config: the model's Hugging Face configuration (``PretrainedConfig``).
        vocab_size: columns of the logits the model produces.
        max_position_embeddings: the longest sequence the model's positions cover;
            the default for ``max_model_len``.
        device: the ``torch.device`` the model runs on.
        dtype: the model's compute ``torch.dtype``.
    """

    resolved: Any
    hf_config: Any
    vocab_size: int
    max_position_embeddings: int
    device: torch.device
    dtype: torch.dtype

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def load_model(self) -> None: ...

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """How many KV blocks fit the configured memory budget."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def set_plugin_context(self, context: PluginContext) -> None:
        """Receive the engine's ``PluginContext`` (plugin API 1.2): called once, after
        ``load_model`` and the tokenizer, before ``determine_num_kv_blocks`` and the
        first step. A runner builds its sampler here, as ``Sampler(context=context)``
        when the sampler's ``__init__`` declares ``context``. The default ignores it."""

    def determine_num_swap_blocks(self) -> int:
        """How many KV blocks the swap space (``swap_space`` GiB) holds."""
        raise NotImplementedError(f"{type(self).__name__} does not support swap preemption")

    def initialize_swap_space(self, num_blocks: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support swap preemption")

    def profile(self, is_start: bool) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support profiling")

    # LoRA adapters (plugin API 1.3). With ``enable_lora`` the engine calls
    # ``add_lora`` when a request names an adapter (before the request is
    # queued: a failure is that request's error), and every step's
    # ``NewRequestData.lora_request`` says which adapter each request runs with.

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load the adapter into host memory, or mark it recently used. Raise
        ``vframe.errors.LoRAAdapterError`` for an adapter that cannot serve the model."""
        from vframe.errors import ConfigError

        raise ConfigError(f"model runner {type(self).__name__} does not serve LoRA adapters")

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter (no request in flight uses it); whether it was known."""
        return False

    def list_loras(self) -> list[LoRARequest]:
        """The adapters added and not removed."""
        return []


# --------------------------------------------------------------------------- #
# Executor
# --------------------------------------------------------------------------- #


@dataclass(frozen=True)
class RunnerInfo:
    """What the engine reads of a loaded model runner (its ``ModelRunner``
    attributes, plus whether the model caches keys and values): from the runner
    itself in-process, or from rank 0 when the ranks run elsewhere."""

    resolved: Any
    hf_config: Any
    vocab_size: int
    max_position_embeddings: int
    device: torch.device
    dtype: torch.dtype
    uses_kv_cache: bool
    # The GPU's name and memory in bytes (plugin API 1.15; "" and 0 off CUDA): what the
    # engine's default batch limits on a GPU depend on (vframe.core.config.gpu_batch_defaults).
    device_name: str = ""
    device_memory: int = 0

    @classmethod
    def of(cls, runner: ModelRunner) -> RunnerInfo:
        name, memory = "", 0
        if runner.device.type == "cuda":
            import torch  # interfaces imports torch for annotations only

            props = torch.cuda.get_device_properties(runner.device)
            name, memory = props.name, props.total_memory
        return cls(
            runner.resolved, runner.hf_config, runner.vocab_size, runner.max_position_embeddings,
            runner.device, runner.dtype, getattr(getattr(runner, "model", None), "uses_kv_cache", True),
            name, memory,
        )


class Executor(ABC):
    """How the engine reaches its model (DESIGN.md §11; plugin API 1.7): one
    ``ModelRunner`` per tensor-parallel rank, in this process or in workers.

    Selected by ``distributed_executor_backend`` and built as
    ``Executor(config: EngineConfig)``; the constructor starts the ranks (nothing
    for ``uni``, processes for ``mp``, actors for ``ray``), and each rank builds
    the configured model runner. The engine, which keeps the scheduler and the
    KV cache manager, then calls::

        load_model()                    -> RunnerInfo (rank 0's)
        set_plugin_context(context)     every rank's runner gets the engine's context
        determine_num_kv_blocks()       -> the fewest any rank can hold
        initialize_kv_cache(num_blocks) every rank, same count
        execute_model(scheduler_output) -> ModelRunnerOutput, every step (rank 0's)
        collective_rpc(method, args)    any other ``ModelRunner`` method on every rank
        shutdown()                      once; stops every rank, leaves no process behind

    A rank that dies, or that fails while the others succeed (their states no
    longer agree), makes the call raise ``vframe.errors.ExecutorDeadError``, and
    every later call too; the executor stops the other ranks. An exception
    every rank raises alike (a bad adapter, a failing step) is re-raised as is,
    and the engine goes on.

    Attributes:
        driver_runner: the rank-0 runner when it lives in this process (``uni``),
            for callers that need the model object itself (pooling, profiling's
            trace, benchmarks); ``None`` when the ranks run elsewhere.
    """

    driver_runner: ModelRunner | None = None

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call ``ModelRunner.<method>(*args)`` on every rank; the results in rank order."""

    def load_model(self) -> RunnerInfo:
        return self.collective_rpc("load_model_info")[0]

    def set_plugin_context(self, context: PluginContext) -> None:
        self.collective_rpc("set_plugin_context", (context,))

    def determine_num_kv_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_kv_blocks"))

    def determine_num_swap_blocks(self) -> int:
        return min(self.collective_rpc("determine_num_swap_blocks"))

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.collective_rpc("execute_model", (scheduler_output,))[0]

    def check_request(self, params: SamplingParams) -> None:
        """Raise ``InvalidRequestError`` for a request the ranks could not receive
        (say, a logits processor that does not pickle for a worker process);
        called before the request is queued. The default accepts everything."""

    def shutdown(self) -> None:
        """Stop every rank. Idempotent."""


# --------------------------------------------------------------------------- #
# Sampler
# --------------------------------------------------------------------------- #


class Sampler(ABC):
    """Picks the next token of every request in the batch, each with its own parameters.

    Selected by the ``sampler`` setting and built once per engine: as
    ``Sampler(context=<PluginContext>)`` when ``__init__`` declares a parameter
    named ``context`` (plugin API 1.2: the tokenizer, ``vocab_size``, device of
    its engine), else as ``Sampler()``.
    """

    @abstractmethod
    def __call__(
        self,
        logits: torch.Tensor,  # [B, V] float32
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput: ...


class LogitsProcessor(ABC):
    """Rewrites the logits of the requests that ask for it by name
    (``SamplingParams(logits_processors=["name"])`` or ``[("name", kwargs)]``).

    Construction: one instance per completion (a request with ``n=2`` gets two),
    built as ``cls(**kwargs)`` with the request's kwargs; when ``__init__``
    declares a parameter named ``context`` (plugin API 1.2) also with
    ``context=<PluginContext>`` of the engine serving the request: its tokenizer,
    ``vocab_size``, ``eos_token_ids``, device. ``context`` is therefore reserved:
    a request passing a kwarg of that name is refused. A completion that is
    preempted and resumed gets a new instance, whose first call sees every token
    generated so far, so state derived from ``token_ids`` survives.

    Call: ``processor(token_ids, logits) -> logits`` once per generated token,
    before the engine's own rewrites (``logit_bias``, bans, penalties, ...).
    """

    @abstractmethod
    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``token_ids``: the completion's generated tokens so far (not the prompt);
        ``logits``: ``[V]`` float32 on the model's device, ``V = context.vocab_size``.
        Return a ``[V]`` tensor; changing ``logits`` in place and returning it is
        fine. An exception fails this request only, with ``finish_reason="error"``."""


class ModelArchitecture(ABC):
    """What the model registry hands out: an ``nn.Module`` with these methods.

    Kept as documentation of the contract; models subclass ``torch.nn.Module``
    and implement the same names (see ``vframe/models/llama.py``).

    The loader constructs the class as ``Model(hf_config, attn_backend, dtype)``
    (the checkpoint's ``transformers.PretrainedConfig``, the selected
    ``type[AttentionBackend]`` whose ``get_impl_cls()`` each attention layer
    instantiates, the ``torch.dtype`` to compute in), plus ``quant_config=``
    when a quantization method is configured (a class without that parameter
    cannot run quantized). It does so under ``torch.device("cpu")``, calls
    ``load_weights``, then the runner moves the model to its device and calls
    it in ``torch.inference_mode()``.

    A class attribute ``supports_packed_weights = True`` (plugin API 1.6;
    default ``False``) lets vframe replace the ``weight`` of the model's
    unquantized bfloat16 linear layers on the CPU, and since 1.9 its float32
    ones on x86-64 CPUs, by oneDNN's packed form (an
    opaque ``torch._mkldnn`` tensor) once loaded: each layer's ``forward`` is
    unchanged, but ``layer.weight`` is no longer an ordinary tensor. Read a
    weight with ``layer.quant_method.dequantize_weight(layer)``, or set
    ``layer.needs_plain_weight = True`` on a layer whose weight the model uses
    directly."""

    @abstractmethod
    def forward(self, input_ids, positions, kv_caches, attn_metadata):  # -> [T, E]
        """One step over every scheduled token: ``input_ids`` ``[T]`` int64,
        ``positions`` ``[T]`` int64 (each token's position in its request),
        ``kv_caches`` one tensor per layer, shaped by the backend's
        ``get_kv_cache_shape_for_spec`` for that layer's spec, ``attn_metadata`` what the backend's builder
        built for the step (pass it to every ``AttentionImpl.forward``).
        Returns the hidden states ``[T, E]``."""

    @abstractmethod
    def compute_logits(self, hidden_states):  # [N, E] -> [N, V]
        """The output head on some rows of ``forward``'s result: ``[N, E]`` ->
        ``[N, V]`` float32 logits."""

    def get_kv_cache_specs(self, block_size: int, dtype: torch.dtype) -> list[KVCacheSpec]:
        """What each layer caches per token, one ``vframe.core.kv_cache_spec``
        spec per entry of ``kv_caches``, in order (plugin API 1.3; optional),
        each holding ``dtype``: what the cache stores, the model's dtype or with
        ``kv_cache_dtype="fp8..."`` a float8 type. The runner sizes the cache
        from these bytes and shapes each layer's tensor with the backend's
        ``get_kv_cache_shape_for_spec``. Without it every
        layer gets a ``FullAttentionSpec`` of the config's kv-heads and head size.
        A multi-head latent attention layer (DeepSeek) returns an
        ``MLAAttentionSpec`` and builds the backend's ``get_mla_impl_cls()``."""
        raise NotImplementedError

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy the checkpoint's ``(Hugging Face name, tensor)`` pairs into the
        parameters; returns the names of the parameters now fully loaded. The
        loader fails if any parameter is not among them."""
