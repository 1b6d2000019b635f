"""The pool of KV cache blocks: free queues, reference counts and the prefix-cache map.

A block is in exactly one of three states::

    in use       ref_cnt > 0                  (in no free queue)
    cached free  ref_cnt == 0, has a hash     (reusable on a hit)
    free         ref_cnt == 0, no hash

A new block comes from the first of three queues that has one:

1. free blocks that have held KV before, the most recently freed first: their memory is
   resident and likeliest still in the CPU's caches;
2. blocks never handed out yet, in id order;
3. cached free blocks, least recently freed first (evicting its prefix-cache entry).

Taking used blocks before untouched ones keeps a CPU engine inside the memory it has
already written: the first write to a page of a fresh ``mmap`` faults, and in a virtual
machine whose host backs guest memory on first touch that cost about 1 ms a MB
(SmolLM2's 23 KB a token: the offline workload's 600 MB of new KV took 0.5-1 s of a
20 s run, every run, while the queue handed out the never-used blocks first). Cached
blocks go last so that a prefix stays reusable as long as there is any other block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

BlockHash = int | bytes


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._reusable: OrderedDict[int, None] = OrderedDict()  # free, used before, no hash: the last freed first
        self._next_untouched = 0  # blocks [_next_untouched, num_blocks) were never handed out
        self._cached_free: OrderedDict[int, None] = OrderedDict()  # free with a hash: LRU order
        self._cached: dict[BlockHash, int] = {}  # block_hash -> block_id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._reusable) + (self.num_blocks - self._next_untouched) + len(self._cached_free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def free_block_ids(self) -> set[int]:
        """Every block with no reference, whichever queue holds it."""
        return {*self._reusable, *range(self._next_untouched, self.num_blocks), *self._cached_free}

    def _take(self) -> int:
        if self._reusable:
            return self._reusable.popitem(last=True)[0]
        if self._next_untouched < self.num_blocks:
            self._next_untouched += 1
            return self._next_untouched - 1
        return self._cached_free.popitem(last=False)[0]

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` free blocks in the queues' order (ref_cnt becomes 1)."""
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id = self._take()
            block = self.blocks[block_id]
            assert block.ref_cnt == 0, block
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            block_ids.append(block_id)
        return block_ids

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take a reference on blocks found in the prefix cache."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self._queue_of(block).pop(block_id)
            block.ref_cnt += 1

    def _queue_of(self, block: KVBlock) -> OrderedDict[int, None]:
        return self._reusable if block.block_hash is None else self._cached_free

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """Drop a reference on each block; blocks reaching zero join their queue's
        tail in the given order (so pass a chain tail-first to evict tails first)."""
        for block_id in ordered_block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._queue_of(block)[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Record a full block's hash. A block with the same contents already
        cached keeps the entry; this one stays an ordinary block."""
        if not self.enable_caching or block_hash in self._cached:
            return
        block = self.blocks[block_id]
        if block.ref_cnt == 0 and block.block_hash is None:  # a free block moves to the cached queue
            del self._reusable[block_id]
            self._cached_free[block_id] = None
        block.block_hash = block_hash
        self._cached[block_hash] = block_id

    def _evict(self, block: KVBlock) -> None:
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._reusable.update(self._cached_free)  # used before: taken before the untouched ones
        self._cached_free.clear()
        return True

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)
