"""The plugin API version policy (docs/plugins.md, "API versioning"): a plugin loads
when its declared major equals vframe's and its minor is at most vframe's; any
other declaration skips it with a message that says which side to upgrade. And an
unknown name that a skipped plugin provides says so, with the reason."""

from __future__ import annotations

import pytest

import vframe
from vframe.errors import PluginError
from vframe.plugins import get_registry, loaded_plugins, plugin_failures
from vframe.plugins.versioning import api_refusal, parse_api_version

ACME = """
from vframe import hookimpl

VFRAME_PLUGIN_API = {declared}

@hookimpl
def vframe_register_attention_backends(register):
    register("acme", "acme_attention.backend:AcmeBackend")
"""


def test_running_version_is_1_23():
    assert vframe.PLUGIN_API_VERSION == "1.23"
    assert parse_api_version(vframe.PLUGIN_API_VERSION) == (1, 23)


@pytest.mark.parametrize(
    ("value", "parsed"),
    [("1.2", (1, 2)), ("1", (1, 0)), (" 2.10 ", (2, 10)), ("1.2.3", None), ("v1.2", None),
     ("one", None), ("", None), (1.2, None), (1, None), (None, None)],
)
def test_parse_api_version(value, parsed):
    assert parse_api_version(value) == parsed


@pytest.mark.parametrize("declared", ['"1.0"', '"1.1"', '"1.2"', '"1.3"', '"1.4"', '"1.5"', '"1.6"', '"1.7"', '"1.8"', '"1.9"', '"1.10"', '"1.11"', '"1.12"', '"1.13"', '"1.14"', '"1.15"', '"1.16"', '"1.17"', '"1.18"', '"1.19"',
                                      '"1.20"', '"1.21"', '"1.22"', '"1.23"', '"1"'])
def test_same_major_and_lower_or_equal_minor_loads(installed, declared):
    installed("acme", ACME.format(declared=declared))
    assert get_registry("attention_backend").get("acme").source == "acme"
    assert plugin_failures() == []
    info = {p.name: p for p in loaded_plugins()}["acme"]
    assert info.api_version == declared.strip('"')


@pytest.mark.parametrize(
    ("declared", "message"),
    [
        (
            '"1.24"',
            "plugin 'acme' needs vframe plugin API 1.24, but this vframe provides 1.23; "
            "upgrade vframe (or install an older release of the plugin)",
        ),
        (
            '"2.0"',
            "plugin 'acme' needs vframe plugin API 2.0, but this vframe provides 1.23; "
            "upgrade vframe (or install an older release of the plugin)",
        ),
        (
            '"0.9"',
            "plugin 'acme' was written for vframe plugin API 0.x, but this vframe provides 1.23, "
            "which is not compatible with it; install a release of the plugin made for plugin "
            "API 1.x (docs/plugins.md lists what changed)",
        ),
        (
            '"latest"',
            "plugin 'acme' declares VFRAME_PLUGIN_API='latest', which is not a 'MAJOR.MINOR' "
            "version string such as '1.23'",
        ),
        (
            "1.2",  # a float, not a string: 1.10 and 1.1 would be the same number
            "plugin 'acme' declares VFRAME_PLUGIN_API=1.2, which is not a 'MAJOR.MINOR' "
            "version string such as '1.23'",
        ),
    ],
)
def test_incompatible_declaration_is_skipped_with_its_message(installed, declared, message):
    installed("acme", ACME.format(declared=declared))
    [failure] = plugin_failures()
    assert (failure.plugin, failure.error) == ("acme", message)
    assert [p.name for p in loaded_plugins()] == ["builtin"]
    # What it would have provided is known, so asking for it names the plugin and why.
    assert failure.provides == (("attention_backend", "acme"),)
    with pytest.raises(PluginError) as e:
        get_registry("attention_backend").load("acme")
    assert str(e.value).startswith(
        f"unknown attention backend 'acme'; known: cpu_paged, flash_attn, flex, torch, triton; plugin 'acme' provides it but was skipped: {message}"
    )


def test_api_refusal_is_none_for_compatible():
    assert api_refusal("p", "1.0", provided="1.2") is None
    assert api_refusal("p", "1.2", provided="1.2") is None
    assert "needs vframe plugin API 1.3" in api_refusal("p", "1.3", provided="1.2")


def test_unknown_name_lists_plugins_that_failed_to_import(installed):
    installed("acme", "import acme_attention_cuda_extension_missing\n")
    with pytest.raises(PluginError) as e:
        get_registry("attention_backend").load("acme")
    message = str(e.value)
    assert message.startswith(
        "unknown attention backend 'acme'; known: cpu_paged, flash_attn, flex, torch, triton; skipped plugins (one may provide it): "
        "acme: cannot import 'vframe_test_plugin_acme_"
    )
    assert "ModuleNotFoundError: No module named 'acme_attention_cuda_extension_missing'" in message


def test_unknown_name_names_installed_plugins_left_out_by_the_allow_list(installed, monkeypatch):
    installed("acme", ACME.format(declared='"1.2"'))
    monkeypatch.setenv("VFRAME_PLUGINS", "")
    with pytest.raises(PluginError, match=(
        r"unknown attention backend 'acme'; known: cpu_paged, flash_attn, flex, torch, triton; installed but not in the plugin "
        r"allow-list \(VFRAME_PLUGINS / plugins setting\): acme"
    )):
        get_registry("attention_backend").load("acme")


def test_unknown_name_without_skipped_plugins_has_no_hint():
    with pytest.raises(PluginError) as e:
        get_registry("attention_backend").load("acme")
    assert str(e.value) == (
        "unknown attention backend 'acme'; known: cpu_paged, flash_attn, flex, torch, triton "
        "(`vframe plugins` lists installed plugins and why any were skipped)"
    )


def test_loaded_plugin_lists_its_hooks(installed):
    installed(
        "acme",
        """
        from vframe import hookimpl

        VFRAME_PLUGIN_API = "1.2"

        @hookimpl
        def vframe_engine_step(num_scheduled_tokens):
            pass

        @hookimpl
        def vframe_register_logits_processors(register):
            register("acme_ban", "acme.lp:Ban")
        """,
    )
    info = {p.name: p for p in loaded_plugins()}["acme"]
    assert info.hooks == ("vframe_register_logits_processors", "vframe_engine_step")


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"scheduling_policy": "sjff"}, "unknown scheduling policy 'sjff'; known: fcfs, priority"),
        ({"attention_backend": "acme"}, "unknown attention backend 'acme'; known: cpu_paged, flash_attn, flex, torch, triton"),
        ({"sampler": "nope"}, "unknown sampler 'nope'; known: default"),
    ],
)
def test_engine_checks_every_configured_name_before_loading_the_model(monkeypatch, setting, message):
    from vframe import LLM

    monkeypatch.setenv("VFRAME_PLUGINS", "")  # installed contrib plugins stay out of the lists
    # The model path does not exist: the name error comes first, not a missing-model error.
    with pytest.raises(PluginError, match=message):
        LLM(model="/nonexistent/vframe-model", **setting)
