"""The contrib vframe-plugin-sjf package, installed by `make test`, found through its
real entry point and selected by configuration."""

import importlib.metadata

import pytest

from vframe.core.config import EngineConfig
from vframe.core.outputs import ModelRunnerOutput
from vframe.core.request import Request
from vframe.core.sampling_params import SamplingParams
from vframe.core.sched.kv_cache_manager import PagedKVCacheManager
from vframe.plugins import get_registry, hookimpl, loaded_plugins, register_plugin, unregister_plugin
from vframe.testing.scheduler import check_scheduling_policy

pytestmark = pytest.mark.skipif(
    not any(ep.name == "sjf" for ep in importlib.metadata.entry_points(group="vframe")),
    reason="vframe-plugin-sjf is not installed (make test installs it)",
)


def test_sjf_is_a_scheduling_policy_of_plugin_api_1_2():
    entry = next(e for e in get_registry("scheduling_policy").entries() if e.name == "sjf")
    assert (entry.source, entry.target_str) == ("sjf", "vframe_plugin_sjf.policy:ShortestJobFirst")
    [info] = [p for p in loaded_plugins() if p.name == "sjf"]
    assert info.api_version == "1.2"


def test_sjf_admits_the_smallest_expected_work_first():
    config = EngineConfig.from_sources(
        env={}, scheduling_policy="sjf", max_num_seqs=1, max_num_batched_tokens=64
    )
    sched_cls = get_registry("scheduler").load(config.scheduler.scheduler)
    sched = sched_cls(config, PagedKVCacheManager(32, 4, enable_caching=False))
    assert type(sched.policy).__name__ == "ShortestJobFirst"
    work = {"long": (20, 8), "short": (2, 1), "mid": (5, 3), "mid-later": (6, 2)}  # prompt tokens, max_tokens
    for rid, (n, m) in work.items():
        sched.add_request(Request(rid, list(range(n)), SamplingParams(max_tokens=m)))
    admitted = []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        admitted += [r.req_id for r in out.scheduled_new_reqs]
        sampled = {
            r: 7
            for r in out.num_scheduled_tokens
            if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens
        }
        sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), sampled))
    assert admitted == ["short", "mid", "mid-later", "long"]  # 3, 8, 8 (ties by arrival), 28


class FinishRecorder:
    def __init__(self):
        self.finished: list[str] = []

    @hookimpl
    def vframe_request_finished(self, request_id):
        self.finished.append(request_id)


def test_an_engine_configured_with_sjf_finishes_short_jobs_first():
    from vframe import LLM

    recorder = FinishRecorder()
    register_plugin(recorder, "finish-recorder")
    try:
        llm = LLM(dtype="float32", num_threads=2, max_model_len=256, scheduling_policy="sjf", max_num_seqs=1)
        prompts = [{"prompt_token_ids": list(range(10, 10 + n))} for n in (20, 3, 8)]
        params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (1, 2, 1)]
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        unregister_plugin("finish-recorder")
    work = {o.request_id: len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outs}
    assert [work[r] for r in recorder.finished] == [5, 9, 21]


def test_sjf_passes_the_scheduling_policy_conformance_kit():
    check_scheduling_policy("sjf")
