"""The contrib plugin vframe-plugin-stepstats, found through its real entry point.

Installed by `pip install -e contrib/vframe-plugin-stepstats` (the Makefile does it)."""

from __future__ import annotations

import importlib.metadata

import pytest

from vframe import LLM, SamplingParams
from vframe.core.plugin_context import EngineView
from vframe.plugins import call_lifecycle, load_plugins, loaded_plugins, plugin_failures

pytestmark = pytest.mark.skipif(
    "stepstats" not in {ep.name for ep in importlib.metadata.entry_points(group="vframe")},
    reason="vframe-plugin-stepstats is not installed: pip install -e contrib/vframe-plugin-stepstats",
)


def run_engine_events() -> None:
    """The events of a two-request run, raised by hand. Only ``engine_id`` of the
    view is read by the plugin, so the view has no ``PluginContext``."""
    engine = object()
    view = EngineView("engine-7", "synthetic", context=None, max_model_len=64, block_size=16, num_kv_blocks=4)
    call_lifecycle("vframe_engine_started", engine=engine, engine_view=view)
    for request_id, prompt in (("a", [1, 2, 3]), ("b", [4, 5])):
        call_lifecycle(
            "vframe_request_added", request_id=request_id, prompt_token_ids=prompt, sampling_params=None,
            engine_view=view,
        )
    call_lifecycle("vframe_engine_step", engine=engine, num_scheduled_tokens=5, elapsed_s=0.5, engine_view=view)
    call_lifecycle("vframe_engine_step", engine=engine, num_scheduled_tokens=2, elapsed_s=0.25, engine_view=view)
    call_lifecycle(
        "vframe_request_finished", request_id="a", finish_reason="length", num_prompt_tokens=3, num_output_tokens=2,
        engine_view=view,
    )
    call_lifecycle(
        "vframe_request_finished", request_id="b", finish_reason="stop", num_prompt_tokens=2, num_output_tokens=1,
        engine_view=view,
    )
    call_lifecycle("vframe_engine_shutdown", engine=engine, engine_view=view)


def test_discovered_through_entry_point():
    load_plugins(["stepstats"])
    [info] = [p for p in loaded_plugins() if p.name == "stepstats"]
    assert info.origin == "entry_point"
    assert info.distribution == "vframe-plugin-stepstats 0.1.0"
    assert info.api_version == "1.2"
    assert plugin_failures() == []


def test_writes_json_lines(tmp_path, monkeypatch):
    from vframe_plugin_stepstats import read_records

    path = tmp_path / "stats.jsonl"
    monkeypatch.setenv("VFRAME_STEPSTATS_FILE", str(path))
    load_plugins(["stepstats"])
    run_engine_events()

    records = read_records(path)
    for r in records:
        assert isinstance(r.pop("time"), float)
        assert r.pop("engine_id") == "engine-7"
    latencies = [r.pop("latency_s") for r in records if r["event"] == "request"]
    assert all(0.0 <= s < 5.0 for s in latencies)
    summary = records[-1]
    assert summary.pop("mean_request_latency_s") == pytest.approx(sum(latencies) / 2)
    assert records == [
        {"event": "step", "step": 1, "num_scheduled_tokens": 5, "elapsed_s": 0.5},
        {"event": "step", "step": 2, "num_scheduled_tokens": 2, "elapsed_s": 0.25},
        {"event": "request", "request_id": "a", "finish_reason": "length",
         "num_prompt_tokens": 3, "num_output_tokens": 2},
        {"event": "request", "request_id": "b", "finish_reason": "stop",
         "num_prompt_tokens": 2, "num_output_tokens": 1},
        {
            "event": "summary",
            "num_steps": 2,
            "num_scheduled_tokens": 7,
            "step_time_s": 0.75,
            "mean_step_s": 0.375,
            "max_step_s": 0.5,
            "tokens_per_s": 7 / 0.75,
            "num_requests": 2,
        },
    ]


def test_two_engines_in_one_process_write_apart(tmp_path, monkeypatch):
    from vframe_plugin_stepstats import read_records

    path = tmp_path / "stats.jsonl"
    monkeypatch.setenv("VFRAME_STEPSTATS_FILE", str(path))
    settings = dict(plugins=["stepstats"], max_model_len=128, kv_cache_memory_bytes=8 << 20, num_threads=1)
    first, second = LLM(**settings), LLM(**settings)
    greedy = dict(temperature=0.0, ignore_eos=True)
    first.generate("Hello", SamplingParams(max_tokens=3, **greedy), use_tqdm=False)
    second.generate(["One", "Two"], SamplingParams(max_tokens=2, **greedy), use_tqdm=False)
    first.shutdown()
    second.shutdown()

    records = read_records(path)
    first_id, second_id = first.llm_engine.engine_view.engine_id, second.llm_engine.engine_view.engine_id
    assert first_id != second_id
    assert {r["engine_id"] for r in records} == {first_id, second_id}
    summaries = {r["engine_id"]: r for r in records if r["event"] == "summary"}
    # prefill + 2 decodes for the first engine's request; the second's two run side by side
    assert [(s["num_steps"], s["num_requests"]) for s in (summaries[first_id], summaries[second_id])] == [
        (3, 1),
        (2, 2),
    ]
    finished = sorted((r["engine_id"] == first_id, r["num_output_tokens"]) for r in records if r["event"] == "request")
    assert finished == [(False, 2), (False, 2), (True, 3)]
    assert plugin_failures() == []


def test_does_nothing_without_env(tmp_path, monkeypatch):
    monkeypatch.delenv("VFRAME_STEPSTATS_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    load_plugins(["stepstats"])
    run_engine_events()
    assert list(tmp_path.iterdir()) == []
    assert plugin_failures() == []


def test_passes_the_lifecycle_conformance_check(tmp_path, monkeypatch):
    from vframe_plugin_stepstats import read_records

    from vframe.testing.lifecycle import check_lifecycle_hooks

    path = tmp_path / "stats.jsonl"
    monkeypatch.setenv("VFRAME_STEPSTATS_FILE", str(path))
    load_plugins(["stepstats"])
    check_lifecycle_hooks("stepstats", num_threads=2)
    records = read_records(path)
    finished = sorted(r["finish_reason"] for r in records if r["event"] == "request")
    assert finished == ["abort", "error", "length", "length", "stop"]
    assert records[-1]["event"] == "summary"
