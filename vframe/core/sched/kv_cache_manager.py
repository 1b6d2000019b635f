"""The paged KV cache manager: block tables per request, with prefix caching.

Every full block of a request gets a hash chained from its parent block's hash
and its own token ids, so equal prefixes map to equal hash chains::

    tokens  | t0 .. t15 | t16 .. t31 | t32 .. t40 |
    hashes  | h0        | h1(h0)     | (partial: not cached)

A new request looks its chain up block by block; the hits are shared (ref_cnt
grows) and their tokens are not computed again.

A block becomes a hit only once its KV is written: ``allocate_slots`` hands out
blocks, and ``cache_blocks`` registers them after the step that computed them
has run. A block allocated in a step that then fails, or whose request is
preempted before the step runs, is never registered, so no later request can
find unwritten KV under a valid hash.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from vframe.core.interfaces import KVCacheManager
from vframe.core.request import Request
from vframe.core.sched.block_pool import BlockHash, BlockPool


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: Sequence[int], algo: str = "builtin"
) -> BlockHash:
    if algo == "sha256":
        h = hashlib.sha256()
        h.update(parent_hash or b"")
        h.update(b",".join(str(t).encode() for t in token_ids))
        return h.digest()
    return hash((parent_hash, tuple(token_ids)))


def root_hash(extra_keys: tuple, algo: str = "builtin") -> BlockHash | None:
    """The parent of a request's first block: anything besides token ids that
    changes the KV contents (a cache salt, a LoRA adapter). None when empty."""
    if not extra_keys:
        return None
    if algo == "sha256":
        return hashlib.sha256(repr(extra_keys).encode()).digest()
    return hash(("extra", extra_keys))


class PagedKVCacheManager(KVCacheManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        hash_algo: str = "builtin",
        num_swap_blocks: int = 0,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching, hash_algo, num_swap_blocks)
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.free_swap_blocks: list[int] = list(range(num_swap_blocks - 1, -1, -1))  # pop() -> 0, 1, ...
        self.req_to_swap_blocks: dict[str, list[int]] = {}
        self.req_to_blocks: dict[str, list[int]] = {}
        self.req_to_block_hashes: dict[str, list[BlockHash]] = {}
        # How many of a request's blocks are already registered in the cache.
        self.num_cached_block: dict[str, int] = {}
        # Hashes of full blocks being computed in the current step (not hits yet), per request.
        self.req_to_pending: dict[str, list[BlockHash]] = {}
        self._pending: dict[BlockHash, int] = {}  # hash -> requests computing it
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # ------------------------------------------------------------------ #

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        # prompt_logprobs need the logits of every prompt position: nothing may be skipped.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        hits, _ = self._find_hits(request)
        num_computed_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_computed_tokens
        return hits, num_computed_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[int] = (),
        num_new_computed_tokens: int = 0,
    ) -> list[int] | None:
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        known = None if new_computed_blocks or num_new_computed_tokens else self.req_to_blocks.get(request.request_id)
        if known is not None:
            # A decode, mostly: room left in its last block and no block filled by known
            # tokens, so nothing to allocate and nothing pending (what the rest would find).
            start, bs = request.num_computed_tokens, self.block_size
            end = start + num_new_tokens
            fills_none = not self.enable_caching or start // bs >= min(end, request.num_tokens) // bs
            if end <= len(known) * bs and fills_none:
                return []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = -(-(num_computed + num_new_tokens) // self.block_size)
        num_needed = num_required - len(req_blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue leave it when touched.
        num_evictable_hits = sum(
            1 for b in new_computed_blocks if self.block_pool.blocks[b].ref_cnt == 0
        )
        if num_needed > self.block_pool.num_free_blocks - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
            self.num_cached_block[request.request_id] = len(req_blocks)
        new_blocks = self.block_pool.get_new_blocks(max(num_needed, 0))
        req_blocks.extend(new_blocks)
        if self.enable_caching:
            self._mark_pending(request, num_computed, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        req_id = request.request_id
        if self.req_to_pending:
            self._clear_pending(req_id)
        if self.enable_caching and req_id in self.req_to_blocks:
            self._cache_full_blocks(request, num_computed_tokens)  # returns at once when no block filled

    def is_being_computed(self, request: Request) -> bool:
        """Whether the request's first block that is not a hit is being computed,
        this step, by a request already scheduled: it will be a hit next step."""
        if not self._pending or not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return False
        _, first_miss = self._find_hits(request)
        return first_miss in self._pending

    def _find_hits(self, request: Request) -> tuple[list[int], BlockHash | None]:
        """The cached blocks that start the request's hash chain, and the hash of the
        first block that could have been a hit but is not (None if there is none)."""
        # The last token is always recomputed: its logits pick the next token.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in self._block_hashes(request)[:max_hit_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                return hits, block_hash
            hits.append(block_id)
        return hits, None

    def _mark_pending(self, request: Request, start: int, end: int) -> None:
        """Full blocks in token range ``[start, end)`` whose ids are known are computed now."""
        first, last = start // self.block_size, min(end, request.num_tokens) // self.block_size
        if first >= last:
            return
        hashes = self._block_hashes(request)[first:last]
        self.req_to_pending.setdefault(request.request_id, []).extend(hashes)
        for block_hash in hashes:
            self._pending[block_hash] = self._pending.get(block_hash, 0) + 1

    def _clear_pending(self, request_id: str) -> None:
        for block_hash in self.req_to_pending.pop(request_id, ()):
            if self._pending[block_hash] == 1:
                del self._pending[block_hash]
            else:
                self._pending[block_hash] -= 1

    def free(self, request: Request) -> None:
        self._clear_pending(request.request_id)
        blocks = self.req_to_blocks.pop(request.request_id, [])
        # Tail first, so that a chain's tail is evicted before its head.
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)
        self.req_to_block_hashes.pop(request.request_id, None)
        self.free_swap_blocks.extend(reversed(self.req_to_swap_blocks.pop(request.request_id, [])))

    # ------------------------------------------------------------------ #
    # swap preemption
    # ------------------------------------------------------------------ #

    def swap_out(self, request: Request) -> list[tuple[int, int]] | None:
        blocks = self.req_to_blocks.get(request.request_id, [])
        if len(blocks) > len(self.free_swap_blocks):
            return None
        swap_blocks = [self.free_swap_blocks.pop() for _ in blocks]
        self._clear_pending(request.request_id)
        self.req_to_swap_blocks[request.request_id] = swap_blocks
        del self.req_to_blocks[request.request_id]
        # Shared prefix blocks stay with their other users; only our reference goes.
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)
        return list(zip(blocks, swap_blocks))

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        swap_blocks = self.req_to_swap_blocks[request.request_id]
        num_tokens = request.num_computed_tokens + num_new_tokens
        num_required = -(-num_tokens // self.block_size)
        if num_required > self.block_pool.num_free_blocks:
            return None
        blocks = self.block_pool.get_new_blocks(num_required)
        self.req_to_blocks[request.request_id] = blocks
        del self.req_to_swap_blocks[request.request_id]
        self.free_swap_blocks.extend(reversed(swap_blocks))
        return list(zip(swap_blocks, blocks))

    @property
    def swap_usage(self) -> float:
        if not self.num_swap_blocks:
            return 0.0
        return 1.0 - len(self.free_swap_blocks) / self.num_swap_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.req_to_blocks.get(request_id, [])

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def get_stats(self) -> dict[str, float]:
        return {
            "kv_cache_usage": self.usage,
            "swap_space_usage": self.swap_usage,
            "prefix_cache_queries": self.prefix_cache_queries,
            "prefix_cache_hits": self.prefix_cache_hits,
            "prefix_cache_hit_rate": self.prefix_cache_hits / max(self.prefix_cache_queries, 1),
        }

    # ------------------------------------------------------------------ #

    def _block_hashes(self, request: Request) -> list[BlockHash]:
        """Hashes of the request's full blocks, extended as tokens arrive."""
        hashes = self.req_to_block_hashes.setdefault(request.request_id, [])
        num_full = request.num_tokens // self.block_size
        token_ids = request.all_token_ids
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else root_hash(_extra_keys(request), self.hash_algo)
            chunk = token_ids[i * self.block_size : (i + 1) * self.block_size]
            hashes.append(hash_block_tokens(parent, chunk, self.hash_algo))
        return hashes

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the blocks that are full once ``num_tokens`` are computed.

        Only tokens already known (prompt and sampled) can be hashed, so a block
        is registered once both its KV is computed and its ids are known."""
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        start = self.num_cached_block.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        blocks = self.req_to_blocks[request.request_id]
        for i in range(start, num_full):
            self.block_pool.cache_block(blocks[i], hashes[i])
        self.num_cached_block[request.request_id] = num_full


def _extra_keys(request: Request) -> tuple:
    """What the first block's hash carries besides tokens: the cache salt and
    the LoRA adapter, so that neither tenants nor adapters share KV."""
    keys: tuple = ()
    if request.cache_salt is not None:
        keys += (("cache_salt", request.cache_salt),)
    if request.lora_int_id is not None:
        keys += (("lora", request.lora_int_id),)
    return keys
