"""vframe.testing.lifecycle: a real engine raises every lifecycle hook with every
finish reason; a plugin whose hook raises fails the check instead of silently
going quiet in production."""

from __future__ import annotations

import uuid
from collections import Counter

import pytest

from vframe.plugins import hookimpl, register_plugin, unregister_plugin
from vframe.testing.lifecycle import check_lifecycle_hooks


class Counting:
    """A metrics plugin that works."""

    def __init__(self) -> None:
        self.events: Counter[str] = Counter()
        self.finish_reasons: Counter[str] = Counter()

    @hookimpl
    def vframe_engine_started(self, engine_view):
        self.events["started"] += 1

    @hookimpl
    def vframe_request_added(self, request_id):
        self.events["added"] += 1

    @hookimpl
    def vframe_request_finished(self, finish_reason):
        self.finish_reasons[finish_reason] += 1

    @hookimpl
    def vframe_engine_shutdown(self):
        self.events["shutdown"] += 1


class ReasonCodes:
    """A metrics plugin written before finish_reason "error" existed."""

    CODES = {"stop": 0, "length": 1, "abort": 2}

    @hookimpl
    def vframe_request_finished(self, finish_reason):
        for reason in finish_reason.split(","):
            self.CODES[reason]


@pytest.fixture
def plugin_named():
    names = []

    def register(plugin: object) -> str:
        names.append(f"kit-lifecycle-{uuid.uuid4().hex[:8]}")
        register_plugin(plugin, names[-1])
        return names[-1]

    yield register
    for name in names:
        unregister_plugin(name)


def test_a_working_plugin_passes_and_sees_every_finish_reason(plugin_named):
    plugin = Counting()
    check_lifecycle_hooks(plugin_named(plugin), num_threads=2)
    assert plugin.events == {"started": 1, "added": 5, "shutdown": 1}
    assert plugin.finish_reasons == {"length": 2, "abort": 1, "error": 1, "stop": 1}


def test_a_hook_that_raises_fails_the_check_naming_hook_and_error(plugin_named):
    name = plugin_named(ReasonCodes())
    with pytest.raises(AssertionError) as e:
        check_lifecycle_hooks(name, num_threads=2)
    assert str(e.value) == (
        f"plugin {name!r}: vframe_request_finished raised KeyError: 'error'; hook disabled"
    )


def test_a_plugin_that_is_not_loaded_fails_with_the_reason():
    with pytest.raises(AssertionError, match=(
        "plugin 'vframe-no-such-plugin' is not loaded: not installed, or left out by VFRAME_PLUGINS"
    )):
        check_lifecycle_hooks("vframe-no-such-plugin")
