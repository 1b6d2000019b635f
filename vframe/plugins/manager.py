"""Finds, validates and loads plugins, and fills the registries from them.

Order: the built-in plugin (``vframe.plugins.builtin``) first, then entry points
of group ``"vframe"`` sorted by name, then plugins added at run time with
``register_plugin``. Every plugin goes through the same hooks.

A third-party plugin that cannot be imported, declares an incompatible
``VFRAME_PLUGIN_API``, implements a hook that does not exist, or raises from a
registration hook is logged, recorded in ``plugin_failures()`` and skipped; the
other plugins still load. A registration hook's entries are applied only when
all of that plugin's registration hooks succeed.

Which entry-point plugins load: the ``plugins`` setting passed to
``load_plugins``, else the ``VFRAME_PLUGINS`` environment variable
(comma-separated entry-point names; empty = none), else all installed.
The built-in plugin always loads.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

import pluggy

from vframe.errors import PluginError
from vframe.plugins import hookspecs
from vframe.plugins.hookspecs import LIFECYCLE_HOOKS, REGISTRATION_HOOKS
from vframe.plugins.registry import BUILTIN, KINDS, Registry
from vframe.plugins.versioning import api_refusal
from vframe.version import __version__

if TYPE_CHECKING:
    from vframe.core.interfaces import (
        AttentionBackend,
        KVCacheManager,
        LogitsProcessor,
        ModelRunner,
        Sampler,
        Scheduler,
    )

logger = logging.getLogger("vframe.plugins")

ENTRY_POINT_GROUP = "vframe"
PLUGINS_ENV = "VFRAME_PLUGINS"


@dataclass(frozen=True)
class PluginInfo:
    name: str  # entry-point name, "builtin", or the name given to register_plugin
    origin: Literal["builtin", "entry_point", "runtime"]
    distribution: str | None = None  # "vframe-plugin-stepstats 0.1.0"
    api_version: str | None = None  # the plugin's VFRAME_PLUGIN_API, if declared
    hooks: tuple[str, ...] = ()  # the hooks it implements, in hookspecs order


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    error: str
    # (kind, name) of the entries the plugin would have registered, where they could
    # be learned: a plugin refused for its API version or a bad hook still says.
    provides: tuple[tuple[str, str], ...] = ()
    skipped: bool = True  # False: the plugin loaded, one of its lifecycle hooks was disabled


@dataclass(frozen=True)
class _Listener:
    plugin: str
    function: Callable[..., Any]
    argnames: tuple[str, ...]


@dataclass
class _State:
    pm: pluggy.PluginManager | None = None
    allow: frozenset[str] | None = None
    plugins: dict[str, PluginInfo] = field(default_factory=dict)
    runtime: dict[str, object] = field(default_factory=dict)  # survive reloads
    failures: list[PluginFailure] = field(default_factory=list)
    not_allowed: set[str] = field(default_factory=set)  # installed entry points the allow-list left out
    registries: dict[str, Registry] = field(default_factory=lambda: {k: Registry(k) for k in KINDS})
    listeners: dict[str, tuple[_Listener, ...]] = field(default_factory=dict)
    disabled: set[tuple[str, str]] = field(default_factory=set)  # (plugin, hook)


_state = _State()
_lock = threading.RLock()


# --------------------------------------------------------------------------- #
# Public API
# --------------------------------------------------------------------------- #


def load_plugins(allow: list[str] | None = None) -> None:
    """Load the built-in plugin and the allowed entry-point plugins.

    ``allow``: entry-point names (the ``plugins`` setting); ``None`` defers to
    ``VFRAME_PLUGINS``, and if that is unset too, every installed plugin loads.
    Calling again with the same allow-list does nothing; with another, reloads.
    Plugins added with ``register_plugin`` are kept across reloads.
    """
    effective = _allow_from_env() if allow is None else frozenset(a.strip() for a in allow if a.strip())
    with _lock:
        if _state.pm is not None and _state.allow == effective:
            return
        _build(effective)


def get_plugin_manager() -> pluggy.PluginManager:
    return _ensure_loaded()


@overload
def get_registry(kind: Literal["attention_backend"]) -> Registry[AttentionBackend]: ...
@overload
def get_registry(kind: Literal["scheduler"]) -> Registry[Scheduler]: ...
@overload
def get_registry(kind: Literal["kv_cache_manager"]) -> Registry[KVCacheManager]: ...
@overload
def get_registry(kind: Literal["sampler"]) -> Registry[Sampler]: ...
@overload
def get_registry(kind: Literal["model_runner"]) -> Registry[ModelRunner]: ...
@overload
def get_registry(kind: Literal["logits_processor"]) -> Registry[LogitsProcessor]: ...
@overload
def get_registry(kind: str) -> Registry[Any]: ...  # "model" (nn.Module classes), "quantizer"


def get_registry(kind: str) -> Registry[Any]:
    """The registry of ``kind`` (one of ``registry.KINDS``), loading plugins on first use."""
    _ensure_loaded()
    registry = _state.registries.get(kind)
    if registry is None:
        raise PluginError(f"unknown registry kind {kind!r}; known: {', '.join(KINDS)}")
    return registry


def register_plugin(plugin: object, name: str) -> None:
    """Add a plugin object (module, class with static hooks, or instance) now.

    Meant for tests and embedding. Unlike entry-point plugins, a broken one
    raises ``PluginError`` here instead of being skipped."""
    with _lock:
        pm = _ensure_loaded()
        if name in _state.plugins:
            raise PluginError(f"a plugin named {name!r} is already registered; unregister it first")
        _add_plugin(pm, plugin, name)
        try:
            staged = _stage_registrations(pm, plugin, name)
        except PluginError:
            pm.unregister(plugin=plugin)
            raise
        _apply(staged)
        _state.plugins[name] = _info(pm, plugin, name, "runtime")
        _state.runtime[name] = plugin
        _state.listeners.clear()


def unregister_plugin(name: str) -> None:
    """Remove a plugin added with ``register_plugin`` and everything it registered."""
    with _lock:
        if name not in _state.runtime:
            raise PluginError(
                f"no plugin named {name!r} was added with register_plugin; "
                f"runtime plugins: {', '.join(_state.runtime) or '(none)'}"
            )
        plugin = _state.runtime.pop(name)
        del _state.plugins[name]
        pm = _ensure_loaded()
        pm.unregister(plugin=plugin)
        _rebuild_registries(pm)


def call_lifecycle(hook_name: str, **kwargs: Any) -> None:
    """Notify every plugin implementing the lifecycle hook ``hook_name``.

    Cheap when nobody implements it (one dict look-up). An implementation that
    raises is logged, recorded in ``plugin_failures()`` and not called again."""
    listeners = _state.listeners.get(hook_name)
    if listeners is None:
        listeners = _listeners(hook_name)
    for listener in listeners:
        try:
            listener.function(**{a: kwargs[a] for a in listener.argnames})
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # noqa: BLE001 - a plugin must never crash the engine, not even by SystemExit
            _disable(hook_name, listener, e)


def has_listeners(hook_name: str) -> bool:
    """Whether any plugin implements ``hook_name`` (to skip work that only feeds it)."""
    listeners = _state.listeners.get(hook_name)
    return bool(_listeners(hook_name) if listeners is None else listeners)


def loaded_plugins() -> list[PluginInfo]:
    _ensure_loaded()
    return list(_state.plugins.values())


def plugin_failures() -> list[PluginFailure]:
    _ensure_loaded()
    return list(_state.failures)


def reset_plugins() -> None:
    """Forget every plugin, runtime ones included; the next use loads afresh. For tests."""
    global _state
    with _lock:
        _state = _State()


# --------------------------------------------------------------------------- #
# Loading
# --------------------------------------------------------------------------- #


def _iter_entry_points() -> list[importlib.metadata.EntryPoint]:
    """Installed plugins. A seam: tests replace it to simulate installed packages."""
    return list(importlib.metadata.entry_points(group=ENTRY_POINT_GROUP))


def _allow_from_env() -> frozenset[str] | None:
    raw = os.environ.get(PLUGINS_ENV)
    if raw is None:
        return None
    return frozenset(p.strip() for p in raw.split(",") if p.strip())


def _ensure_loaded() -> pluggy.PluginManager:
    pm = _state.pm
    if pm is None:
        with _lock:
            if _state.pm is None:
                _build(_allow_from_env())
            pm = _state.pm
    assert pm is not None
    return pm


def _build(allow: frozenset[str] | None) -> None:
    from vframe.plugins import builtin

    pm = pluggy.PluginManager("vframe")
    pm.add_hookspecs(hookspecs)
    _state.failures.clear()
    _state.not_allowed.clear()
    _state.disabled.clear()
    _state.plugins.clear()
    _add_plugin(pm, builtin, BUILTIN)
    _state.plugins[BUILTIN] = _info(pm, builtin, BUILTIN, "builtin", f"vframe {__version__}")

    seen: dict[str, str] = {}
    for ep in sorted(_iter_entry_points(), key=lambda ep: ep.name):
        if allow is not None and ep.name not in allow:
            _state.not_allowed.add(ep.name)
            continue
        dist = f"{ep.dist.name} {ep.dist.version}" if getattr(ep, "dist", None) else None
        if ep.name == BUILTIN or ep.name in seen or ep.name in _state.runtime:
            other = seen.get(ep.name, "vframe" if ep.name == BUILTIN else "a runtime plugin")
            _fail(ep.name, f"entry point {ep.value!r}: the plugin name {ep.name!r} is taken by {other}")
            continue
        seen[ep.name] = dist or ep.value
        try:
            plugin = ep.load()
            if isinstance(plugin, type):
                plugin = plugin()
        except Exception as e:  # noqa: BLE001 - any error in third-party code skips the plugin
            _fail(ep.name, f"cannot import {ep.value!r}: {type(e).__name__}: {e}")
            continue
        try:
            _add_plugin(pm, plugin, ep.name)
        except PluginError as e:
            _fail(ep.name, str(e), _would_register(plugin))
            continue
        _state.plugins[ep.name] = _info(pm, plugin, ep.name, "entry_point", dist)
    for name in sorted((allow or frozenset()) - seen.keys() - {BUILTIN}):
        _fail(name, f"named in the plugin allow-list ({PLUGINS_ENV} / plugins setting) but not installed")

    for name, plugin in _state.runtime.items():
        pm.register(plugin, name=name)
        _state.plugins[name] = _info(pm, plugin, name, "runtime")
    _state.pm = pm
    _state.allow = allow
    _rebuild_registries(pm)


def _add_plugin(pm: pluggy.PluginManager, plugin: object, name: str) -> None:
    """Register ``plugin`` with ``pm`` if it is valid; raise ``PluginError`` (and
    leave ``pm`` unchanged) if not."""
    declared = getattr(plugin, "VFRAME_PLUGIN_API", None)
    if declared is not None and (refusal := api_refusal(name, declared)) is not None:
        raise PluginError(refusal)
    try:
        pm.register(plugin, name=name)
    except Exception as e:  # noqa: BLE001 - pluggy raises ValueError or PluginValidationError
        raise PluginError(f"plugin {name!r} is invalid: {e}") from e
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as e:
        pm.unregister(plugin=plugin)
        raise PluginError(
            f"plugin {name!r} implements a hook vframe does not define ({e}); "
            f"known hooks: {', '.join([*REGISTRATION_HOOKS, *LIFECYCLE_HOOKS])}"
        ) from e
    for caller in pm.get_hookcallers(plugin) or []:
        for impl in caller.get_hookimpls():
            if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper):
                pm.unregister(plugin=plugin)
                raise PluginError(
                    f"plugin {name!r}: {caller.name} is marked as a wrapper; vframe hooks "
                    "are plain calls, remove wrapper=True / hookwrapper=True"
                )


def _declared_api(plugin: object) -> str | None:
    declared = getattr(plugin, "VFRAME_PLUGIN_API", None)
    return None if declared is None else declared if isinstance(declared, str) else repr(declared)


def _info(
    pm: pluggy.PluginManager, plugin: object, name: str, origin: Any, distribution: str | None = None
) -> PluginInfo:
    implemented = {caller.name for caller in pm.get_hookcallers(plugin) or []}
    hooks = tuple(h for h in (*REGISTRATION_HOOKS, *LIFECYCLE_HOOKS) if h in implemented)
    return PluginInfo(name, origin, distribution, _declared_api(plugin), hooks)


def _would_register(plugin: object) -> tuple[tuple[str, str], ...]:
    """What a refused plugin's registration hooks register, learned by calling them
    with a recorder; what cannot be learned (a hook that raises) is left out."""
    provides: list[tuple[str, str]] = []
    for hook_name, kind in REGISTRATION_HOOKS.items():
        function = getattr(plugin, hook_name, None)
        if not callable(function) or not hasattr(function, "vframe_impl"):
            continue
        try:
            function(lambda name, target, *, override=False, _kind=kind: provides.append((_kind, name)))
        except Exception:  # noqa: BLE001, S112 - best effort, for an error message only
            continue
    return tuple(provides)


def skipped_plugin_hint(kind: str, name: str) -> str | None:
    """Why an unknown ``name`` of ``kind`` may be missing: the skipped plugin that
    provides it, or else every skipped plugin (one of them might). ``None`` when
    no plugin was skipped."""
    failures = [f for f in _state.failures if f.skipped]
    for f in failures:
        if (kind, name) in f.provides:
            return f"plugin {f.plugin!r} provides it but was skipped: {f.error}"
    hints = []
    if failures:
        hints.append("skipped plugins (one may provide it): " + "; ".join(f"{f.plugin}: {f.error}" for f in failures))
    if _state.not_allowed:
        hints.append(
            f"installed but not in the plugin allow-list ({PLUGINS_ENV} / plugins setting): "
            + ", ".join(sorted(_state.not_allowed))
        )
    return "; ".join(hints) or None


def _fail(plugin: str, error: str, provides: tuple[tuple[str, str], ...] = ()) -> None:
    logger.warning("vframe plugin %r skipped: %s", plugin, error)
    _state.failures.append(PluginFailure(plugin, error, provides))


# --------------------------------------------------------------------------- #
# Registries
# --------------------------------------------------------------------------- #

_Staged = list[tuple[Registry, str, "str | type", str, bool]]  # registry, name, target, source, override


def _rebuild_registries(pm: pluggy.PluginManager) -> None:
    for registry in _state.registries.values():
        registry.clear()
    for name in list(_state.plugins):
        plugin = pm.get_plugin(name)
        try:
            staged = _stage_registrations(pm, plugin, name)
        except PluginError as e:
            if name == BUILTIN:
                raise
            pm.unregister(plugin=plugin)
            del _state.plugins[name]
            _state.runtime.pop(name, None)
            _fail(name, str(e), _would_register(plugin))
            continue
        _apply(staged)
    _state.listeners.clear()


def _stage_registrations(pm: pluggy.PluginManager, plugin: object, name: str) -> _Staged:
    """Run ``plugin``'s registration hooks, collecting (not applying) what they register."""
    staged: _Staged = []
    for hook_name, kind in REGISTRATION_HOOKS.items():
        registry = _state.registries[kind]

        def register(
            entry_name: str, target: str | type, *, override: bool = False, _registry: Registry = registry
        ) -> None:
            _registry.check_registration(entry_name, target, source=name, override=override)
            staged.append((_registry, entry_name, target, name, override))

        for impl in getattr(pm.hook, hook_name).get_hookimpls():
            if impl.plugin is not plugin:
                continue
            try:
                impl.function(**{arg: register for arg in impl.argnames})
            except Exception as e:  # noqa: BLE001 - reported as this plugin's failure
                detail = str(e) if isinstance(e, PluginError) else f"{type(e).__name__}: {e}"
                raise PluginError(f"plugin {name!r}: {hook_name} failed: {detail}") from e
    return staged


def _apply(staged: _Staged) -> None:
    for registry, entry_name, target, source, override in staged:
        registry.register(entry_name, target, source=source, override=override)


# --------------------------------------------------------------------------- #
# Lifecycle
# --------------------------------------------------------------------------- #


def _listeners(hook_name: str) -> tuple[_Listener, ...]:
    if hook_name not in LIFECYCLE_HOOKS:
        raise PluginError(f"unknown lifecycle hook {hook_name!r}; known: {', '.join(LIFECYCLE_HOOKS)}")
    pm = _ensure_loaded()
    with _lock:
        # pluggy's call order: tryfirst first, otherwise the last registered first.
        listeners = tuple(
            _Listener(impl.plugin_name, impl.function, tuple(impl.argnames))
            for impl in reversed(getattr(pm.hook, hook_name).get_hookimpls())
            if (impl.plugin_name, hook_name) not in _state.disabled
        )
        _state.listeners[hook_name] = listeners
    return listeners


def _disable(hook_name: str, listener: _Listener, error: BaseException) -> None:
    with _lock:
        _state.disabled.add((listener.plugin, hook_name))
        _state.listeners.pop(hook_name, None)
    logger.warning(
        "vframe plugin %r: %s raised %s: %s; this hook of the plugin is disabled",
        listener.plugin, hook_name, type(error).__name__, error, exc_info=error,
    )
    _state.failures.append(
        PluginFailure(
            listener.plugin, f"{hook_name} raised {type(error).__name__}: {error}; hook disabled", skipped=False
        )
    )
