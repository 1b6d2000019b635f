from vframe.core.request import Request
from vframe.core.sampling_params import SamplingParams
from vframe.core.sched.kv_cache_manager import PagedKVCacheManager


def make_request(req_id: str, num_tokens: int, offset: int = 0) -> Request:
    return Request(req_id, list(range(offset, offset + num_tokens)), SamplingParams(max_tokens=8))


def test_allocate_exact_block_ids_and_free_everything():
    kv = PagedKVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    r0, r1 = make_request("r0", 10), make_request("r1", 3)
    assert kv.allocate_slots(r0, 10) == [0, 1, 2]
    assert kv.allocate_slots(r1, 3) == [3]
    r0.num_computed_tokens = 10
    r0.append_output_token_ids([99, 98])
    # tokens 10 and 11 still fit in block 2
    assert kv.allocate_slots(r0, 2) == []
    r0.num_computed_tokens = 12
    r0.append_output_token_ids([97])
    assert kv.allocate_slots(r0, 1) == [4]
    assert kv.get_block_ids("r0") == [0, 1, 2, 4]
    assert kv.num_free_blocks == 3
    kv.free(r0)
    kv.free(r1)
    assert kv.num_free_blocks == 8 and kv.usage == 0.0
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_allocation_failure_changes_nothing():
    kv = PagedKVCacheManager(num_blocks=2, block_size=4, enable_caching=False)
    r0 = make_request("r0", 12)
    assert kv.allocate_slots(r0, 12) is None
    assert kv.num_free_blocks == 2
    assert kv.get_block_ids("r0") == []


def test_prefix_hit_shares_full_blocks_and_leaves_last_token_to_compute():
    kv = PagedKVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    r0 = make_request("r0", 13)
    assert kv.get_computed_blocks(r0) == ([], 0)
    assert kv.allocate_slots(r0, 13) == [0, 1, 2, 3]
    r1 = make_request("r1", 14)  # same first 13 tokens, one more
    # Allocated is not computed: nothing hits until the step that writes the KV ran.
    assert kv.get_computed_blocks(r1) == ([], 0)
    r0.num_computed_tokens = 13
    kv.cache_blocks(r0, 13)

    r1 = make_request("r1", 14)  # same first 13 tokens, one more
    blocks, num_hit = kv.get_computed_blocks(r1)
    assert (blocks, num_hit) == ([0, 1, 2], 12)
    assert kv.allocate_slots(r1, 2, blocks, num_hit) == [4]
    assert kv.get_block_ids("r1") == [0, 1, 2, 4]
    assert [kv.block_pool.blocks[b].ref_cnt for b in (0, 1, 2, 3, 4)] == [2, 2, 2, 1, 1]

    # A prompt of exactly 3 full blocks hits only 2: its last token must run.
    r2 = make_request("r2", 12)
    assert kv.get_computed_blocks(r2) == ([0, 1], 8)

    kv.free(r0)
    kv.free(r1)
    assert kv.num_free_blocks == 10
    assert kv.block_pool.num_cached_blocks == 3


def test_eviction_takes_least_recently_freed_and_tails_first():
    kv = PagedKVCacheManager(num_blocks=6, block_size=2, enable_caching=True)
    a = make_request("a", 5, offset=0)  # blocks 0,1 full + 2 partial
    assert kv.allocate_slots(a, 5) == [0, 1, 2]
    a.num_computed_tokens = 5
    kv.cache_blocks(a, 5)
    kv.free(a)  # freed tail first: the partial 2 (no hash) goes before the never-used 3, 4, 5; 1, 0 stay cached
    b = make_request("b", 9, offset=100)
    assert kv.allocate_slots(b, 9) == [2, 3, 4, 5, 1]
    # block 1 held a's second block: its hash is gone, block 0 (the head) survives.
    assert kv.get_computed_blocks(make_request("c", 5, offset=0)) == ([0], 2)


def test_swap_out_and_in_map_exact_blocks_and_free_swap_space():
    kv = PagedKVCacheManager(num_blocks=6, block_size=4, enable_caching=False, num_swap_blocks=4)
    r = make_request("r", 7)
    assert kv.allocate_slots(r, 7) == [0, 1]
    r.num_computed_tokens = 7
    assert kv.swap_out(r) == [(0, 0), (1, 1)]
    assert kv.num_free_blocks == 6 and kv.swap_usage == 0.5
    other = make_request("o", 20, offset=50)
    assert kv.allocate_slots(other, 20) == [0, 1, 2, 3, 4]  # the used 0 and 1 first (freed tail first: 0 last)
    assert kv.swap_in(r, 1) is None  # 7 computed + 1 new need 2 blocks, 1 is free
    assert kv.swap_usage == 0.5 and kv.num_free_blocks == 1
    kv.free(other)
    assert kv.swap_in(r, 1) == [(0, 0), (1, 1)]
    assert kv.get_block_ids("r") == [0, 1] and kv.swap_usage == 0.0


def test_swap_out_refuses_when_swap_space_is_full():
    kv = PagedKVCacheManager(num_blocks=6, block_size=4, enable_caching=False, num_swap_blocks=1)
    r = make_request("r", 7)
    kv.allocate_slots(r, 7)
    assert kv.swap_out(r) is None
    assert kv.get_block_ids("r") == [0, 1]


def test_abort_while_swapped_returns_swap_blocks():
    kv = PagedKVCacheManager(num_blocks=4, block_size=4, enable_caching=False, num_swap_blocks=2)
    r = make_request("r", 5)
    kv.allocate_slots(r, 5)
    kv.swap_out(r)
    kv.free(r)
    assert kv.swap_usage == 0.0 and kv.num_free_blocks == 4


def test_cache_salt_separates_otherwise_equal_prefixes():
    kv = PagedKVCacheManager(num_blocks=10, block_size=4, enable_caching=True)
    a = make_request("a", 9)
    a.cache_salt = "tenant-1"
    kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)
    same_salt = make_request("b", 9)
    same_salt.cache_salt = "tenant-1"
    other_salt = make_request("c", 9)
    other_salt.cache_salt = "tenant-2"
    no_salt = make_request("d", 9)
    assert kv.get_computed_blocks(same_salt) == ([0, 1], 8)
    assert kv.get_computed_blocks(other_salt) == ([], 0)
    assert kv.get_computed_blocks(no_salt) == ([], 0)


def test_sha256_hashes_hit_like_builtin_ones():
    kv = PagedKVCacheManager(num_blocks=10, block_size=4, enable_caching=True, hash_algo="sha256")
    a = make_request("a", 9)
    kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)
    blocks, num_hit = kv.get_computed_blocks(make_request("b", 12))
    assert (blocks, num_hit) == ([0, 1], 8)
    assert all(isinstance(h, bytes) and len(h) == 32 for h in kv.req_to_block_hashes["b"])
    assert kv.get_stats()["prefix_cache_hit_rate"] == 8 / 12
