"""Property-based: random sequences of add / step / abort on a tiny cache.

Whatever happens, no block is both free and in use, every reference is owned by
a block table, swap blocks are either free or owned, and once every request has
ended all blocks are free with no reference left."""

from collections import Counter

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vframe.core.config import EngineConfig
from vframe.core.outputs import ModelRunnerOutput
from vframe.core.request import Request
from vframe.core.sampling_params import SamplingParams
from vframe.core.sched.kv_cache_manager import PagedKVCacheManager
from vframe.core.sched.scheduler import DefaultScheduler

NUM_BLOCKS, BLOCK_SIZE, NUM_SWAP_BLOCKS = 8, 4, 6

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"),
            st.lists(st.integers(0, 3), min_size=1, max_size=20),  # few ids: prefixes repeat
            st.integers(1, 8),
        ),
        st.tuples(st.just("step")),
        st.tuples(st.just("abort"), st.integers(0, 15)),
    ),
    min_size=20,
    max_size=80,
)


def check_invariants(sched: DefaultScheduler, kv: PagedKVCacheManager) -> None:
    pool = kv.block_pool
    owners = Counter(b for blocks in kv.req_to_blocks.values() for b in blocks)
    free = pool.free_block_ids()
    for block in pool.blocks:
        assert (block.block_id in free) == (block.ref_cnt == 0), block
        assert block.ref_cnt == owners[block.block_id], block
    swapped = [b for blocks in kv.req_to_swap_blocks.values() for b in blocks]
    assert len(swapped) == len(set(swapped))
    assert sorted(swapped + kv.free_swap_blocks) == list(range(NUM_SWAP_BLOCKS))
    # requests the scheduler still runs own their blocks; finished ones own none
    assert set(kv.req_to_blocks) | set(kv.req_to_swap_blocks) <= set(sched.requests)


def run_step(sched: DefaultScheduler) -> None:
    out = sched.schedule()
    for rid, n in out.num_scheduled_tokens.items():
        request = sched.requests[rid]
        blocks = sched.kv_cache_manager.get_block_ids(rid)
        assert len(blocks) * BLOCK_SIZE >= request.num_computed_tokens  # room for what runs
    sampled = {
        rid: 3
        for rid in out.num_scheduled_tokens
        if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens
    }
    sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    budget=st.sampled_from([4, 7, 16, 64]),
    caching=st.booleans(),
    mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_blocks_are_never_lost_or_double_owned(ops, budget, caching, mode, policy):
    config = EngineConfig.from_sources(
        env={}, max_num_batched_tokens=budget, max_num_seqs=4, block_size=BLOCK_SIZE,
        preemption_mode=mode, scheduling_policy=policy,
    )
    kv = PagedKVCacheManager(NUM_BLOCKS, BLOCK_SIZE, caching, num_swap_blocks=NUM_SWAP_BLOCKS)
    sched = DefaultScheduler(config, kv)
    next_id = 0
    for op in ops:
        if op[0] == "add":
            _, prompt, max_tokens = op
            request = Request(str(next_id), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            request.priority = next_id % 3 if policy == "priority" else 0
            sched.add_request(request)
            next_id += 1
        elif op[0] == "step":
            run_step(sched)
        else:
            sched.abort_requests([str(op[1])])
        check_invariants(sched, kv)

    for _ in range(500):  # everything finishes: no request waits forever
        if not sched.has_unfinished_requests():
            break
        run_step(sched)
        check_invariants(sched, kv)
    assert not sched.has_unfinished_requests()
    assert kv.num_free_blocks == NUM_BLOCKS
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    assert sorted(kv.free_swap_blocks) == list(range(NUM_SWAP_BLOCKS))
    assert kv.req_to_blocks == {} and kv.req_to_swap_blocks == {}
