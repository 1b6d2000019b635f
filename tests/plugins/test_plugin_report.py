from __future__ import annotations

import pytest

from vframe.core.interfaces import AttentionBackend
from vframe.plugins import hookimpl, register_plugin, unregister_plugin
from vframe.plugins.report import describe_plugins, format_plugins


class GpuOnlyBackend(AttentionBackend):
    name = "gpuonly"

    @classmethod
    def check_available(cls) -> list[str]:
        return ["needs an NVIDIA GPU", "needs the 'gpuonly' package"]


class ReadyBackend(AttentionBackend):
    name = "ready"


class Plugin:
    @hookimpl
    def vframe_register_attention_backends(self, register):
        register("gpuonly", GpuOnlyBackend)
        register("ready", ReadyBackend)

    @hookimpl
    def vframe_register_samplers(self, register):
        register("ghost", "vframe_no_such_module:Ghost")


@pytest.fixture
def plugin():
    register_plugin(Plugin(), "reporter")
    yield
    unregister_plugin("reporter")


def test_describe_reports_availability_per_entry(plugin):
    rows = {(r.kind, r.name): r for r in describe_plugins() if r.source == "reporter"}
    assert {k: (r.usable, r.reasons) for k, r in rows.items()} == {
        ("attention_backend", "gpuonly"): (False, ["needs an NVIDIA GPU", "needs the 'gpuonly' package"]),
        ("attention_backend", "ready"): (True, []),
        ("sampler", "ghost"): (False, ["ModuleNotFoundError: No module named 'vframe_no_such_module'"]),
    }
    assert rows[("sampler", "ghost")].target == "vframe_no_such_module:Ghost"


def test_format_lists_plugins_entries_reasons_and_failures(plugin):
    from vframe.plugins import PluginFailure

    rows = [r for r in describe_plugins() if r.source == "reporter"]
    text = format_plugins(rows, failures=[PluginFailure("broken", "cannot import 'broken': boom")])
    lines = text.splitlines()
    assert lines[0] == "Plugins (this vframe provides plugin API 1.23):"
    at = lines.index("  reporter (runtime, API not declared)")
    assert lines[at + 1] == "    registers: attention_backends, samplers"
    assert any(line.split()[:4] == ["attention_backend", "gpuonly", "reporter", "no"] for line in lines)
    assert any(line.split()[:4] == ["attention_backend", "ready", "reporter", "yes"] for line in lines)
    assert "  attention_backend 'gpuonly': needs an NVIDIA GPU" in lines
    assert "Skipped plugins:" in lines
    assert "  broken: cannot import 'broken': boom" in lines
