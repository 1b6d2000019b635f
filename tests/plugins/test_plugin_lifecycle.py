from __future__ import annotations

import logging
import time

import pytest

from vframe.errors import PluginError
from vframe.plugins import (
    call_lifecycle,
    has_listeners,
    hookimpl,
    load_plugins,
    plugin_failures,
    register_plugin,
    unregister_plugin,
)


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    @hookimpl
    def vframe_request_added(self, request_id, prompt_token_ids):  # a subset of the spec's args
        self.calls.append(("added", request_id, prompt_token_ids))

    @hookimpl
    def vframe_engine_step(self, engine, num_scheduled_tokens, elapsed_s):
        self.calls.append(("step", engine, num_scheduled_tokens, elapsed_s))

    @hookimpl
    def vframe_request_finished(self, request_id, finish_reason, num_prompt_tokens, num_output_tokens):
        self.calls.append(("finished", request_id, finish_reason, num_prompt_tokens, num_output_tokens))


class Exploding:
    @hookimpl
    def vframe_engine_step(self, num_scheduled_tokens):
        raise ValueError("disk full")


@pytest.fixture(autouse=True)
def no_installed_plugins():
    load_plugins([])  # only the built-in plugin and the ones registered here


@pytest.fixture
def recorder():
    rec = Recorder()
    register_plugin(rec, "recorder")
    yield rec
    unregister_plugin("recorder")


def test_lifecycle_hooks_receive_the_arguments_they_declare(recorder):
    engine = object()
    call_lifecycle("vframe_request_added", request_id="r0", prompt_token_ids=[1, 2, 3], sampling_params=None)
    call_lifecycle("vframe_engine_step", engine=engine, num_scheduled_tokens=3, elapsed_s=0.25)
    call_lifecycle(
        "vframe_request_finished", request_id="r0", finish_reason="length", num_prompt_tokens=3, num_output_tokens=1
    )
    call_lifecycle("vframe_engine_shutdown", engine=engine)  # nobody implements it

    assert recorder.calls == [
        ("added", "r0", [1, 2, 3]),
        ("step", engine, 3, 0.25),
        ("finished", "r0", "length", 3, 1),
    ]


def test_has_listeners_follows_registration():
    assert not has_listeners("vframe_engine_step")
    register_plugin(Recorder(), "recorder")
    assert has_listeners("vframe_engine_step")
    assert not has_listeners("vframe_engine_started")
    unregister_plugin("recorder")
    assert not has_listeners("vframe_engine_step")


def test_raising_hook_is_logged_disabled_and_others_still_run(recorder, caplog):
    register_plugin(Exploding(), "exploding")
    with caplog.at_level(logging.WARNING, logger="vframe.plugins"):
        call_lifecycle("vframe_engine_step", engine=None, num_scheduled_tokens=1, elapsed_s=0.1)
        call_lifecycle("vframe_engine_step", engine=None, num_scheduled_tokens=2, elapsed_s=0.1)

    assert [c[2] for c in recorder.calls] == [1, 2]
    [failure] = plugin_failures()
    assert failure.plugin == "exploding"
    assert failure.error == "vframe_engine_step raised ValueError: disk full; hook disabled"
    assert sum("'exploding'" in r.getMessage() for r in caplog.records) == 1
    unregister_plugin("exploding")


def test_unknown_lifecycle_hook():
    with pytest.raises(PluginError, match="unknown lifecycle hook 'vframe_engine_stepped'"):
        call_lifecycle("vframe_engine_stepped", engine=None)


def test_call_without_listeners_is_cheap():
    call_lifecycle("vframe_engine_step", engine=None, num_scheduled_tokens=1, elapsed_s=0.0)
    start = time.perf_counter()
    for _ in range(100_000):
        call_lifecycle("vframe_engine_step", engine=None, num_scheduled_tokens=1, elapsed_s=0.0)
    # about 0.05 s on a laptop; the bound only catches a per-call plugin-manager walk
    assert time.perf_counter() - start < 1.0
