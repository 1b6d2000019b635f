"""The five interfaces of vframe's core.

Every concrete scheduler, KV cache manager, model runner, sampler and attention
backend implements one of these and is found by name in a plugin registry
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
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    import torch

    from vframe.core.config import EngineConfig
    from vframe.core.outputs import (
        EngineCoreOutput,
        ModelRunnerOutput,
        RequestError,
        SamplerOutput,
        SchedulerOutput,
    )
    from vframe.core.request import Request, RequestStatus
    from vframe.core.sample.metadata import SamplingMetadata


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
    """One attention layer's computation over the paged KV cache."""

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
        then attend each query causally over its request's cached and new tokens."""


class AttentionMetadataBuilder(ABC):
    """Turns the common per-step metadata into what one backend's kernels need."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        self.config = config
        self.device = device

    @abstractmethod
    def build(self, common: CommonAttentionMetadata) -> Any: ...


class AttentionBackend(ABC):
    """A class of static answers about one attention implementation."""

    name: ClassVar[str]

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

    @staticmethod
    def swap_blocks(src: torch.Tensor, dst: torch.Tensor, src_to_dst: torch.Tensor) -> None:
        """Copy blocks ``src_to_dst[:, 0]`` of one layer's cache ``src`` into blocks
        ``src_to_dst[:, 1]`` of ``dst`` (device <-> swap space). The default assumes
        the block dimension is dim 1 of ``get_kv_cache_shape``, as in ``(2, num_blocks, ...)``."""
        src_ids = src_to_dst[:, 0].to(src.device)
        dst_ids = src_to_dst[:, 1].to(dst.device)
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
    ) -> list[str]:
        """Every reason this backend cannot serve the configuration; empty if it can."""
        return []

    @classmethod
    def check_available(cls) -> list[str]:
        """Reasons this backend cannot run on this machine at all (missing packages, no GPU)."""
        return []


# --------------------------------------------------------------------------- #
# KV cache manager
# --------------------------------------------------------------------------- #


class KVCacheManager(ABC):
    """Owns the KV cache blocks. The scheduler never sees free lists, hashes or
    reference counts: it asks for slots and gets block ids back, or ``None``."""

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
    """Decides, each step, how many tokens each request runs under one token budget."""

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


# --------------------------------------------------------------------------- #
# Model runner
# --------------------------------------------------------------------------- #


class ModelRunner(ABC):
    """Turns a scheduler decision into tensors, runs the model and samples."""

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

    def determine_num_swap_blocks(self) -> int:
        """How many KV blocks the swap space (``swap_space`` GiB) holds."""
        raise NotImplementedError(f"{type(self).__name__} does not support swap preemption")

    def initialize_swap_space(self, num_blocks: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support swap preemption")

    def profile(self, is_start: bool) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support profiling")


# --------------------------------------------------------------------------- #
# Sampler
# --------------------------------------------------------------------------- #


class Sampler(ABC):
    """Picks the next token of every request in the batch, each with its own parameters."""

    @abstractmethod
    def __call__(
        self,
        logits: torch.Tensor,  # [B, V] float32
        sampling_metadata: SamplingMetadata,
    ) -> SamplerOutput: ...


class LogitsProcessor(ABC):
    """Rewrites logits of the requests that ask for it; registered as a plugin."""

    @abstractmethod
    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        """``token_ids``: the request's generated tokens so far; ``logits``: [V]."""


class ModelArchitecture(ABC):
    """What the model registry hands out: an ``nn.Module`` with these methods.

    Kept as documentation of the contract; models subclass ``torch.nn.Module``
    and implement the same names (see ``vframe/models/llama.py``)."""

    @abstractmethod
    def forward(self, input_ids, positions, kv_caches, attn_metadata): ...  # -> [T, E]

    @abstractmethod
    def compute_logits(self, hidden_states): ...  # [N, E] -> [N, V]

    @abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]: ...
