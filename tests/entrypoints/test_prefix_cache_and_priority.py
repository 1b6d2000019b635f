"""Prefix-cache hits skip computation; priority orders completion. Real weights."""

import pytest

from vframe import LLM, SamplingParams
from vframe.plugins import hookimpl
from vframe.plugins.manager import register_plugin, unregister_plugin


class StepRecorder:
    """A throwaway plugin: what each engine step computed, and who finished when."""

    def __init__(self):
        self.scheduled_tokens: list[int] = []
        self.finished: list[str] = []

    @hookimpl
    def vframe_engine_step(self, num_scheduled_tokens):
        self.scheduled_tokens.append(num_scheduled_tokens)

    @hookimpl
    def vframe_request_finished(self, request_id):
        self.finished.append(request_id)


@pytest.fixture
def recorder():
    rec = StepRecorder()
    register_plugin(rec, "step-recorder")
    yield rec
    unregister_plugin("step-recorder")


def test_shared_three_block_prefix_is_hit_and_not_recomputed(recorder):
    llm = LLM(dtype="float32", block_size=16, num_threads=2)
    engine = llm.llm_engine
    prefix = list(range(1000, 1048))  # exactly 3 blocks of 16
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    [first] = llm.generate({"prompt_token_ids": prefix + [7, 8, 9]}, params, use_tqdm=False)
    assert first.num_cached_tokens == 0
    recorder.scheduled_tokens.clear()
    [second] = llm.generate({"prompt_token_ids": prefix + [5, 6, 7, 8, 9]}, params, use_tqdm=False)
    assert second.num_cached_tokens == 48  # 3 blocks hit
    assert recorder.scheduled_tokens == [5]  # only its own 5 tokens were computed
    stats = engine.get_stats()
    assert stats["prefix_cache_hits"] == 48

    # A different cache_salt shares nothing.
    recorder.scheduled_tokens.clear()
    [salted] = llm.generate(
        {"prompt_token_ids": prefix + [5, 6, 7, 8, 9], "cache_salt": "tenant-b"}, params, use_tqdm=False
    )
    assert salted.num_cached_tokens == 0 and recorder.scheduled_tokens == [53]
    assert salted.outputs[0].token_ids == second.outputs[0].token_ids

    # After a reset nothing is hit any more.
    assert llm.reset_prefix_cache() is True
    [third] = llm.generate({"prompt_token_ids": prefix + [5, 6, 7, 8, 9]}, params, use_tqdm=False)
    assert third.num_cached_tokens == 0


def test_completion_order_follows_priority(recorder):
    llm = LLM(dtype="float32", scheduling_policy="priority", max_num_seqs=1, num_threads=2)
    prompts = ["Alpha", "Bravo", "Charlie", "Delta"]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    outs = llm.generate(prompts, params, priority=[3, 0, 2, 1], use_tqdm=False)
    by_id = {o.request_id: o.prompt for o in outs}
    assert [by_id[r] for r in recorder.finished] == ["Bravo", "Delta", "Charlie", "Alpha"]


def test_priority_needs_the_priority_policy():
    from vframe.errors import InvalidRequestError

    llm = LLM(dtype="float32", num_threads=2)
    with pytest.raises(InvalidRequestError, match="priority=5 needs scheduling_policy='priority'"):
        llm.generate(["x"], SamplingParams(max_tokens=1), priority=[5], use_tqdm=False)


def test_parallel_samples_share_the_prompt_blocks():
    llm = LLM(dtype="float32", block_size=16, num_threads=2)
    engine = llm.llm_engine
    prompt = list(range(2000, 2053))  # 3 full blocks + 5 tokens
    engine.add_request("par", {"prompt_token_ids": prompt}, SamplingParams(n=4, temperature=1.0, max_tokens=3))
    kv = engine.kv_cache_manager
    engine.step()  # the prompt runs once; the siblings wait for its blocks to be written
    assert kv.get_block_ids("0_par") and not any(kv.get_block_ids(f"{i}_par") for i in (1, 2, 3))
    engine.step()  # now they are hits
    tables = [kv.get_block_ids(f"{i}_par") for i in range(4)]
    shared = tables[0][:3]
    assert all(t[:3] == shared for t in tables)
    assert [kv.block_pool.blocks[b].ref_cnt for b in shared] == [4, 4, 4]
    assert len({t[3] for t in tables}) == 4  # each completion continues in its own block
    assert kv.block_pool.num_free_blocks == kv.num_blocks - 3 - 4
    assert engine.get_stats()["prefix_cache_hits"] == 3 * 48
    while engine.has_unfinished_requests():
        engine.step()
    assert kv.usage == 0.0
