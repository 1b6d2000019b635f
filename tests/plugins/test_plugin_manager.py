from __future__ import annotations

import logging

import pytest

from vframe.core.interfaces import AttentionBackend, Scheduler
from vframe.errors import PluginError
from vframe.plugins import (
    get_plugin_manager,
    get_registry,
    hookimpl,
    load_plugins,
    loaded_plugins,
    plugin_failures,
    register_plugin,
    unregister_plugin,
)

GOOD_PLUGIN = """
from vframe import hookimpl

@hookimpl
def vframe_register_schedulers(register):
    register("lottery", "acme.sched:LotteryScheduler")
"""


class LotteryScheduler(Scheduler):
    pass


class ThrowawayPlugin:
    @hookimpl
    def vframe_register_schedulers(self, register):
        register("lottery", LotteryScheduler)


@pytest.fixture
def throwaway():
    register_plugin(ThrowawayPlugin(), "throwaway")
    yield
    unregister_plugin("throwaway")


def test_builtin_entries_are_registered_as_lazy_strings():
    assert {
        # Installed contrib plugins add entries of their own; only the built-ins are fixed.
        kind: {e.name: (e.target, e.source) for e in get_registry(kind).entries() if e.source == "builtin"}
        for kind in ("model", "attention_backend", "scheduler", "kv_cache_manager", "sampler", "model_runner")
    } == {
        "model": {
            "BertModel": ("vframe.models.bert:BertModel", "builtin"),
            "DeepseekV2ForCausalLM": ("vframe.models.deepseek:DeepseekV2ForCausalLM", "builtin"),
            "DeepseekV3ForCausalLM": ("vframe.models.deepseek:DeepseekV3ForCausalLM", "builtin"),
            "LlamaForCausalLM": ("vframe.models.llama:LlamaForCausalLM", "builtin"),
            "MistralForCausalLM": ("vframe.models.llama:LlamaForCausalLM", "builtin"),
            "MixtralForCausalLM": ("vframe.models.mixtral:MixtralForCausalLM", "builtin"),
            "Qwen2ForCausalLM": ("vframe.models.qwen:Qwen2ForCausalLM", "builtin"),
            "Qwen3ForCausalLM": ("vframe.models.qwen:Qwen3ForCausalLM", "builtin"),
        },
        "attention_backend": {
            "torch": ("vframe.backends.torch_attn:TorchAttentionBackend", "builtin"),
            "triton": ("vframe.backends.triton.backend:TritonAttentionBackend", "builtin"),
            "flash_attn": ("vframe.backends.flash_attn.backend:FlashAttentionBackend", "builtin"),
            "flex": ("vframe.backends.flex.backend:FlexAttentionBackend", "builtin"),
            "cpu_paged": ("vframe.backends.cpu_paged.backend:CpuPagedAttentionBackend", "builtin"),
        },
        "scheduler": {"default": ("vframe.core.sched.scheduler:DefaultScheduler", "builtin")},
        "kv_cache_manager": {
            "default": ("vframe.core.sched.kv_cache_manager:PagedKVCacheManager", "builtin")
        },
        "sampler": {"default": ("vframe.core.sample.sampler:DefaultSampler", "builtin")},
        "model_runner": {"default": ("vframe.core.worker.model_runner:TorchModelRunner", "builtin")},
    }


def test_throwaway_plugin_is_found_and_removed(throwaway):
    registry = get_registry("scheduler")
    assert {"default", "lottery"} <= set(registry.names())
    assert registry.load("lottery") is LotteryScheduler
    assert registry.get("lottery").source == "throwaway"

    unregister_plugin("throwaway")
    assert "lottery" not in registry.names()
    register_plugin(ThrowawayPlugin(), "throwaway")  # for the fixture's teardown


def test_unknown_name_through_get_registry_lists_known(throwaway):
    with pytest.raises(PluginError, match=r"unknown scheduler 'fifo'; known: default, lottery"):
        get_registry("scheduler").load("fifo")


def test_throwaway_cannot_take_a_builtin_name_without_override():
    class Taker:
        @hookimpl
        def vframe_register_schedulers(self, register):
            register("default", LotteryScheduler)

    with pytest.raises(PluginError, match="'taker'.*already registered by plugin 'builtin'"):
        register_plugin(Taker(), "taker")
    assert "taker" not in [p.name for p in loaded_plugins()]
    assert get_registry("scheduler").get("default").source == "builtin"


def test_override_replaces_builtin_until_unregistered():
    class Overrider:
        @hookimpl
        def vframe_register_schedulers(self, register):
            register("default", LotteryScheduler, override=True)

    register_plugin(Overrider(), "overrider")
    assert get_registry("scheduler").load("default") is LotteryScheduler
    unregister_plugin("overrider")
    assert get_registry("scheduler").get("default").target == "vframe.core.sched.scheduler:DefaultScheduler"


def test_register_plugin_with_misspelled_hook_raises():
    class Typo:
        @hookimpl
        def vframe_register_scheduler(self, register):  # missing "s"
            pass

    with pytest.raises(PluginError, match="'typo' implements a hook vframe does not define"):
        register_plugin(Typo(), "typo")
    get_plugin_manager().check_pending()  # the broken plugin left nothing behind


def test_entry_point_plugin_is_loaded(installed):
    installed("acme", GOOD_PLUGIN)
    assert get_registry("scheduler").get("lottery").source == "acme"
    assert [(p.name, p.origin) for p in loaded_plugins()] == [("builtin", "builtin"), ("acme", "entry_point")]
    assert plugin_failures() == []


def test_class_entry_point_is_instantiated(installed):
    installed(
        "classy",
        """
        from vframe import hookimpl

        class Plugin:
            VFRAME_PLUGIN_API = "1.0"

            @hookimpl
            def vframe_register_samplers(self, register):
                register("classy", "acme.sample:Classy")
        """,
        attr="Plugin",
    )
    assert get_registry("sampler").get("classy").source == "classy"


BROKEN = {
    "importerror": (
        "import no_such_dependency_vframe_test\n",
        "cannot import 'vframe_test_plugin_importerror_",
    ),
    "raising": (
        """
        from vframe import hookimpl

        @hookimpl
        def vframe_register_models(register):
            register("HalfDoneForCausalLM", "acme.models:HalfDone")

        @hookimpl
        def vframe_register_samplers(register):
            raise RuntimeError("sampler table corrupt")
        """,
        "plugin 'raising': vframe_register_samplers failed: RuntimeError: sampler table corrupt",
    ),
    "typo": (
        """
        from vframe import hookimpl

        @hookimpl
        def vframe_register_schedular(register):
            pass
        """,
        "plugin 'typo' implements a hook vframe does not define",
    ),
    "oldapi": (
        'VFRAME_PLUGIN_API = "0.3"\n',
        "plugin 'oldapi' was written for vframe plugin API 0.x, but this vframe provides 1.23",
    ),
    "wrapper": (
        """
        from vframe import hookimpl

        @hookimpl(wrapper=True)
        def vframe_engine_step(engine):
            yield
        """,
        "vframe_engine_step is marked as a wrapper",
    ),
    "badtarget": (
        """
        from vframe import hookimpl

        @hookimpl
        def vframe_register_samplers(register):
            register("bad", "not-a-target")
        """,
        "'package.module:ClassName' string or a class",
    ),
}


def test_broken_plugins_are_logged_recorded_and_skipped(installed, caplog):
    installed("acme", GOOD_PLUGIN)
    for name, (source, _) in BROKEN.items():
        installed(name, source)

    with caplog.at_level(logging.WARNING, logger="vframe.plugins"):
        schedulers = get_registry("scheduler")

    assert schedulers.get("lottery").source == "acme"
    assert [p.name for p in loaded_plugins()] == ["builtin", "acme"]
    # the raising plugin's successful hook was not applied either
    assert "HalfDoneForCausalLM" not in get_registry("model")
    failures = {f.plugin: f.error for f in plugin_failures()}
    assert sorted(failures) == sorted(BROKEN)
    for name, (_, expected) in BROKEN.items():
        assert expected in failures[name]
        assert any(
            f"vframe plugin {name!r} skipped" in r.getMessage() and expected in r.getMessage()
            for r in caplog.records
        ), name
    get_plugin_manager().check_pending()


def test_conflicting_entry_point_plugins_second_is_skipped(installed):
    installed("a_first", GOOD_PLUGIN)
    installed("b_second", GOOD_PLUGIN)
    assert get_registry("scheduler").get("lottery").source == "a_first"
    [failure] = plugin_failures()
    assert failure.plugin == "b_second"
    assert "already registered by plugin 'a_first'" in failure.error


def test_env_allow_list(installed, monkeypatch):
    installed("acme", GOOD_PLUGIN)
    installed("other", GOOD_PLUGIN.replace("lottery", "other"))

    monkeypatch.setenv("VFRAME_PLUGINS", " acme ")
    assert get_registry("scheduler").names() == ["default", "lottery"]

    load_plugins(None)  # same effective list: nothing to do
    monkeypatch.setenv("VFRAME_PLUGINS", "")
    load_plugins(None)
    assert get_registry("scheduler").names() == ["default"]  # builtins always load
    assert [p.name for p in loaded_plugins()] == ["builtin"]


def test_config_allow_list_wins_over_env_and_reports_missing(installed, monkeypatch):
    installed("acme", GOOD_PLUGIN)
    installed("other", GOOD_PLUGIN.replace("lottery", "other"))
    monkeypatch.setenv("VFRAME_PLUGINS", "acme")

    load_plugins(["other", "missing"])
    assert get_registry("scheduler").names() == ["default", "other"]
    [failure] = plugin_failures()
    assert failure.plugin == "missing"
    assert "not installed" in failure.error


def test_same_allow_list_is_a_noop_and_runtime_plugins_survive_reload(installed, throwaway):
    installed("acme", GOOD_PLUGIN.replace("lottery", "acme"))
    load_plugins(["acme"])
    pm = get_plugin_manager()
    load_plugins(["acme"])
    assert get_plugin_manager() is pm

    load_plugins([])
    assert get_plugin_manager() is not pm
    assert get_registry("scheduler").names() == ["default", "lottery"]


def test_backend_interface_check_applies_to_plugins():
    class Backend(AttentionBackend):
        name = "fake"

    class Plugin:
        @hookimpl
        def vframe_register_attention_backends(self, register):
            register("fake", Backend)
            register("notabackend", LotteryScheduler)

    register_plugin(Plugin(), "plugin")
    assert get_registry("attention_backend").load("fake") is Backend
    with pytest.raises(PluginError, match="not a subclass of vframe.core.interfaces:AttentionBackend"):
        get_registry("attention_backend").load("notabackend")
    unregister_plugin("plugin")
