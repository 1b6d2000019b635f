"""The pool of KV cache blocks: free queue, reference counts and the prefix-cache map.

A block is in exactly one of three states::

    in use       ref_cnt > 0                  (not in the free queue)
    cached free  ref_cnt == 0, has a hash     (in the free queue, reusable on a hit)
    free         ref_cnt == 0, no hash        (in the free queue)

The free queue is ordered for eviction: the least recently freed block is
handed out (and, if cached, evicted) first.
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
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}  # block_hash -> block_id
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` from the head of the free queue (ref_cnt becomes 1)."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        block_ids = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
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
                del self._free[block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered_block_ids: Iterable[int]) -> None:
        """Drop a reference on each block; blocks reaching zero join the queue's
        tail in the given order (so pass a chain tail-first to evict tails first)."""
        for block_id in ordered_block_ids:
            block = self.blocks[block_id]
            assert block.ref_cnt > 0, block
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block_id] = None

    def cache_block(self, block_id: int, block_hash: BlockHash) -> None:
        """Record a full block's hash. A block with the same contents already
        cached keeps the entry; this one stays an ordinary block."""
        if not self.enable_caching or block_hash in self._cached:
            return
        block = self.blocks[block_id]
        block.block_hash = block_hash
        self._cached[block_hash] = block_id

    def _evict(self, block: KVBlock) -> None:
        if self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
        block.block_hash = None
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        if len(self._free) != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        return True

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)
