"""The contrib vframe-plugin-sjf package, installed by `make test`, found through its
real entry point and selected by configuration."""

import importlib.metadata

import pytest

from vframe.core.config import EngineConfig
from vframe.core.outputs import ModelRunnerOutput
from vframe.core.request import Request
from vframe.core.sampling_params import SamplingParams
from vframe.core.sched.kv_cache_manager import PagedKVCacheManager
from vframe.plugins import get_registry

pytestmark = pytest.mark.skipif(
    not any(ep.name == "sjf" for ep in importlib.metadata.entry_points(group="vframe")),
    reason="vframe-plugin-sjf is not installed (make test installs it)",
)


def test_sjf_admits_the_smallest_expected_work_first():
    config = EngineConfig.from_sources(env={}, scheduler="sjf", max_num_seqs=1, max_num_batched_tokens=64)
    sched_cls = get_registry("scheduler").load(config.scheduler.scheduler)
    assert sched_cls.__name__ == "ShortestJobFirstScheduler"
    sched = sched_cls(config, PagedKVCacheManager(32, 4, enable_caching=False))
    work = {"long": (20, 8), "short": (2, 1), "mid": (5, 3)}  # prompt tokens, max_tokens
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
    assert admitted == ["short", "mid", "long"]
