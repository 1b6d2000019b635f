"""The contrib plugin vframe-plugin-stepstats, found through its real entry point.

Installed by `pip install -e contrib/vframe-plugin-stepstats` (the Makefile does it)."""

from __future__ import annotations

import importlib.metadata

import pytest

from vframe.plugins import call_lifecycle, load_plugins, loaded_plugins, plugin_failures

pytestmark = pytest.mark.skipif(
    "stepstats" not in {ep.name for ep in importlib.metadata.entry_points(group="vframe")},
    reason="vframe-plugin-stepstats is not installed: pip install -e contrib/vframe-plugin-stepstats",
)


def run_engine_events() -> None:
    engine = object()
    call_lifecycle("vframe_engine_started", engine=engine)
    call_lifecycle("vframe_request_added", request_id="a", prompt_token_ids=[1, 2, 3], sampling_params=None)
    call_lifecycle("vframe_request_added", request_id="b", prompt_token_ids=[4, 5], sampling_params=None)
    call_lifecycle("vframe_engine_step", engine=engine, num_scheduled_tokens=5, elapsed_s=0.5)
    call_lifecycle("vframe_engine_step", engine=engine, num_scheduled_tokens=2, elapsed_s=0.25)
    call_lifecycle(
        "vframe_request_finished", request_id="a", finish_reason="length", num_prompt_tokens=3, num_output_tokens=2
    )
    call_lifecycle(
        "vframe_request_finished", request_id="b", finish_reason="stop", num_prompt_tokens=2, num_output_tokens=1
    )
    call_lifecycle("vframe_engine_shutdown", engine=engine)


def test_discovered_through_entry_point():
    load_plugins(["stepstats"])
    [info] = [p for p in loaded_plugins() if p.name == "stepstats"]
    assert info.origin == "entry_point"
    assert info.distribution == "vframe-plugin-stepstats 0.1.0"
    assert info.api_version == "1.0"
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


def test_does_nothing_without_env(tmp_path, monkeypatch):
    monkeypatch.delenv("VFRAME_STEPSTATS_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    load_plugins(["stepstats"])
    run_engine_events()
    assert list(tmp_path.iterdir()) == []
    assert plugin_failures() == []
