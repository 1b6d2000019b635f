"""Plugins: pluggy hooks, name registries and the loader that fills them.

``get_registry("scheduler").load("default")`` returns the class configured by
name; third-party packages add entries through the hooks in ``hookspecs``.
See docs/plugins.md.
"""

from __future__ import annotations

from vframe.errors import PluginError
from vframe.plugins.hookspecs import RegisterFn, hookimpl, hookspec
from vframe.plugins.manager import (
    PluginFailure,
    PluginInfo,
    call_lifecycle,
    get_plugin_manager,
    get_registry,
    has_listeners,
    load_plugins,
    loaded_plugins,
    plugin_failures,
    register_plugin,
    reset_plugins,
    unregister_plugin,
)
from vframe.plugins.registry import KINDS, Registry, RegistryEntry

__all__ = [
    "KINDS",
    "PluginError",
    "PluginFailure",
    "PluginInfo",
    "RegisterFn",
    "Registry",
    "RegistryEntry",
    "call_lifecycle",
    "get_plugin_manager",
    "get_registry",
    "has_listeners",
    "hookimpl",
    "hookspec",
    "load_plugins",
    "loaded_plugins",
    "plugin_failures",
    "register_plugin",
    "reset_plugins",
    "unregister_plugin",
]
