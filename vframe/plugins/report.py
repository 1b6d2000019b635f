"""What ``vframe plugins`` shows: every registered entry, where it came from,
whether it can run on this machine, and which plugins were skipped and why.

Unlike the rest of ``vframe.plugins`` this imports every registered class.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vframe.errors import PluginError
from vframe.plugins.manager import (
    PluginFailure,
    PluginInfo,
    get_registry,
    loaded_plugins,
    plugin_failures,
)
from vframe.plugins.hookspecs import LIFECYCLE_HOOKS, REGISTRATION_HOOKS
from vframe.plugins.registry import KINDS
from vframe.version import PLUGIN_API_VERSION


@dataclass(frozen=True)
class PluginRow:
    kind: str  # registry kind, e.g. "attention_backend"
    name: str  # what configuration selects it by
    target: str  # "module:Class"
    source: str  # plugin that registered it
    usable: bool
    reasons: list[str] = field(default_factory=list)  # why not usable; empty if usable


def describe_plugins() -> list[PluginRow]:
    """One row per registry entry, by kind then name, with its availability here."""
    rows = []
    for kind in KINDS:
        registry = get_registry(kind)
        for entry in registry.entries():
            reasons = _unavailable_reasons(kind, entry.name)
            rows.append(
                PluginRow(kind, entry.name, entry.target_str, entry.source, not reasons, reasons)
            )
    return rows


def _unavailable_reasons(kind: str, name: str) -> list[str]:
    try:
        cls = get_registry(kind).load(name)
    except PluginError as e:
        cause = e.__cause__
        return [f"{type(cause).__name__}: {cause}" if cause else str(e)]
    if kind not in ("attention_backend", "structured_output", "quant_kernel"):
        return []
    try:
        return list(cls.check_available())
    except Exception as e:  # noqa: BLE001 - a faulty check still must not break the listing
        return [f"check_available() raised {type(e).__name__}: {e}"]


def format_plugins(
    rows: list[PluginRow],
    failures: list[PluginFailure] | None = None,
    plugins: list[PluginInfo] | None = None,
) -> str:
    """A plain-text report: loaded plugins, a table of entries, skipped plugins.

    ``failures`` / ``plugins`` default to the current plugin manager's."""
    failures = plugin_failures() if failures is None else failures
    plugins = loaded_plugins() if plugins is None else plugins

    lines = [f"Plugins (this vframe provides plugin API {PLUGIN_API_VERSION}):"]
    for p in plugins:
        api = f"API {p.api_version}" if p.api_version else "API not declared"
        extra = ", ".join(x for x in (p.distribution, api) if x)
        lines.append(f"  {p.name} ({p.origin}, {extra})")
        registration = [h.removeprefix("vframe_register_") for h in p.hooks if h in REGISTRATION_HOOKS]
        lifecycle = [h for h in p.hooks if h in LIFECYCLE_HOOKS]
        if registration:
            lines.append(f"    registers: {', '.join(registration)}")
        if lifecycle:
            lines.append(f"    lifecycle hooks: {', '.join(lifecycle)}")

    header = ("KIND", "NAME", "SOURCE", "USABLE", "TARGET")
    table = [
        (r.kind, r.name, r.source, "yes" if r.usable else "no", r.target) for r in rows
    ]
    widths = [max(len(str(c)) for c in col) for col in zip(header, *table, strict=True)]
    lines.append("")
    for cells in (header, *table):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    unusable = [r for r in rows if not r.usable]
    if unusable:
        lines.append("")
        lines.append("Not usable here:")
        for r in unusable:
            for reason in r.reasons:
                lines.append(f"  {r.kind} {r.name!r}: {reason}")
    if failures:
        lines.append("")
        lines.append("Skipped plugins:")
        for f in failures:
            lines.append(f"  {f.plugin}: {f.error}")
    return "\n".join(lines)
