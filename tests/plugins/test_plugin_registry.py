from __future__ import annotations

from collections import OrderedDict

import pytest

from vframe.core.interfaces import Scheduler
from vframe.errors import PluginError
from vframe.plugins.registry import Registry


class FifoScheduler(Scheduler):  # abstract is fine: the registry never instantiates
    pass


def test_lazy_string_target_is_imported_on_load_and_cached():
    reg = Registry("model")
    reg.register("OrderedDictForCausalLM", "collections:OrderedDict", source="acme")

    assert reg.names() == ["OrderedDictForCausalLM"]
    assert reg.load("OrderedDictForCausalLM") is OrderedDict
    assert reg.load("OrderedDictForCausalLM") is OrderedDict
    entry = reg.entries()[0]
    assert (entry.name, entry.target, entry.source) == (
        "OrderedDictForCausalLM",
        "collections:OrderedDict",
        "acme",
    )


def test_class_target_loads_as_is():
    reg = Registry("scheduler")
    reg.register("fifo", FifoScheduler, source="test")
    assert reg.load("fifo") is FifoScheduler
    assert reg.entries()[0].target_str.endswith("test_plugin_registry:FifoScheduler")


def test_unknown_name_lists_known_names():
    reg = Registry("attention_backend")
    reg.register("triton", "x.y:Triton")
    reg.register("torch", "x.y:Torch")
    with pytest.raises(PluginError, match=r"unknown attention backend 'foo'; known: torch, triton"):
        reg.load("foo")
    assert "foo" not in reg


def test_import_failure_names_plugin_and_target():
    reg = Registry("scheduler")
    reg.register("lottery", "no_such_module_vframe_test:Lottery", source="acme-sched")
    with pytest.raises(PluginError) as e:
        reg.load("lottery")
    msg = str(e.value)
    assert "scheduler 'lottery' from plugin 'acme-sched'" in msg
    assert "'no_such_module_vframe_test:Lottery'" in msg
    assert "ModuleNotFoundError" in msg


def test_missing_attribute_is_an_import_failure():
    reg = Registry("model")
    reg.register("X", "collections:NoSuchClass", source="acme")
    with pytest.raises(PluginError, match="cannot import 'collections:NoSuchClass': AttributeError"):
        reg.load("X")


def test_class_must_implement_the_kind_interface():
    reg = Registry("scheduler")
    reg.register("wrong", "collections:OrderedDict", source="acme")
    with pytest.raises(PluginError, match="not a subclass of vframe.core.interfaces:Scheduler"):
        reg.load("wrong")


@pytest.mark.parametrize("target", ["no_colon.module", ":Cls", "mod:", 42, None])
def test_malformed_target_is_refused(target):
    with pytest.raises(PluginError, match="'package.module:ClassName' string or a class"):
        Registry("sampler").register("bad", target, source="acme")


def test_name_of_another_plugin_needs_override():
    reg = Registry("scheduler")
    reg.register("default", "a.b:Default")  # builtin
    with pytest.raises(PluginError, match="already registered by plugin 'builtin'.*override=True"):
        reg.register("default", "acme.sched:Better", source="acme")
    assert reg.get("default").source == "builtin"

    reg.register("default", "acme.sched:Better", source="acme", override=True)
    assert (reg.get("default").target, reg.get("default").source) == ("acme.sched:Better", "acme")


def test_same_plugin_may_replace_its_own_entry():
    reg = Registry("sampler")
    reg.register("fast", "a:One", source="acme")
    reg.register("fast", "a:Two", source="acme")
    assert reg.get("fast").target == "a:Two"


def test_unknown_kind():
    with pytest.raises(PluginError, match="unknown registry kind 'tokenizer'"):
        Registry("tokenizer")
