import pytest

from vframe.core.sched.block_pool import BlockPool


def test_used_blocks_are_handed_out_before_untouched_ones():
    pool = BlockPool(num_blocks=5, enable_caching=False)
    assert pool.get_new_blocks(2) == [0, 1]
    assert pool.get_new_blocks(1) == [2]
    assert pool.num_free_blocks == 2
    pool.free_blocks([1, 0])
    # 0 and 1 have held KV (their pages are written): they go before the untouched 3 and 4,
    # the last freed first
    assert pool.get_new_blocks(3) == [0, 1, 3]
    assert pool.num_free_blocks == 1 and pool.free_block_ids() == {4}
    pool.free_blocks([2])
    assert pool.get_new_blocks(2) == [2, 4]
    assert pool.usage == 1.0


def test_cached_blocks_are_evicted_only_when_no_other_block_is_free():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    [a, b, c] = pool.get_new_blocks(3)
    pool.cache_block(a, 1)
    pool.cache_block(b, 2)
    pool.free_blocks([b, a, c])  # c has no hash: a free block like the untouched 3
    assert pool.get_new_blocks(2) == [c, 3]
    assert pool.get_new_blocks(1) == [b]  # then the least recently freed cached block
    assert pool.get_cached_block(2) is None and pool.get_cached_block(1) == a
    assert pool.num_evictions == 1


def test_reset_prefix_cache_makes_cached_blocks_plain_used_blocks():
    pool = BlockPool(num_blocks=4, enable_caching=True)
    [a, b] = pool.get_new_blocks(2)
    pool.cache_block(a, 1)
    pool.free_blocks([b, a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(1) is None and pool.free_block_ids() == {0, 1, 2, 3}
    assert pool.get_new_blocks(3) == [a, b, 2]  # the used ones before the untouched 2
    assert pool.num_evictions == 0


def test_asking_for_more_blocks_than_free_raises():
    pool = BlockPool(num_blocks=2, enable_caching=False)
    with pytest.raises(ValueError, match="asked for 3 blocks, 2 free"):
        pool.get_new_blocks(3)


def test_cached_block_survives_free_and_is_evicted_when_reused():
    pool = BlockPool(num_blocks=2, enable_caching=True)
    [a, b] = pool.get_new_blocks(2)
    pool.cache_block(a, 111)
    pool.free_blocks([a])
    assert pool.get_cached_block(111) == a
    assert pool.blocks[a].ref_cnt == 0
    pool.touch([a])  # a prefix-cache hit takes it back out of the free queue
    assert pool.blocks[a].ref_cnt == 1 and pool.num_free_blocks == 0
    pool.free_blocks([a, b])
    assert pool.get_new_blocks(1) == [b]  # a free block without a hash goes before any cached one
    assert pool.get_cached_block(111) == a and pool.num_evictions == 0
    assert pool.get_new_blocks(1) == [a]  # then a is evicted
    assert pool.get_cached_block(111) is None
    assert pool.num_evictions == 1


def test_shared_block_ref_counts():
    pool = BlockPool(num_blocks=3, enable_caching=True)
    [a] = pool.get_new_blocks(1)
    pool.cache_block(a, 7)
    pool.touch([a])
    pool.touch([a])
    assert pool.blocks[a].ref_cnt == 3
    pool.free_blocks([a])
    pool.free_blocks([a])
    assert pool.num_free_blocks == 2
    pool.free_blocks([a])
    assert pool.num_free_blocks == 3 and pool.blocks[a].ref_cnt == 0


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(num_blocks=2, enable_caching=True)
    [a] = pool.get_new_blocks(1)
    pool.cache_block(a, 5)
    assert pool.reset_prefix_cache() is False
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(5) is None
