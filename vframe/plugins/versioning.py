"""The plugin API version and the rule that decides whether a plugin may load.

A plugin declares the version it was written against as ``VFRAME_PLUGIN_API =
"MAJOR.MINOR"`` on its plugin object (the module its entry point names, or the
class). vframe provides ``vframe.PLUGIN_API_VERSION``. The plugin loads when
the majors are equal and the plugin's minor is at most vframe's: a minor
release only adds (hooks, interface methods with defaults, fields, hook
arguments), so code written for 1.1 runs on 1.1, 1.2, 1.9. Anything else is
refused with a message that says which side to upgrade. A plugin that declares
nothing always loads (and gets no protection).

The policy for changing the version is in docs/plugins.md, "API versioning".
"""

from __future__ import annotations

import re

from vframe.version import PLUGIN_API_VERSION

_VERSION = re.compile(r"(\d+)(?:\.(\d+))?")


def parse_api_version(value: object) -> tuple[int, int] | None:
    """``"1.2"`` -> ``(1, 2)``; ``"1"`` -> ``(1, 0)``; anything else -> ``None``."""
    if not isinstance(value, str):
        return None
    match = _VERSION.fullmatch(value.strip())
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2) or 0)


def api_refusal(plugin: str, declared: object, provided: str = PLUGIN_API_VERSION) -> str | None:
    """Why ``plugin``, declaring ``declared``, cannot load on plugin API ``provided``;
    ``None`` when it can."""
    have = parse_api_version(provided)
    assert have is not None, provided
    need = parse_api_version(declared)
    if need is None:
        return (
            f"plugin {plugin!r} declares VFRAME_PLUGIN_API={declared!r}, which is not a "
            f"'MAJOR.MINOR' version string such as {PLUGIN_API_VERSION!r}"
        )
    if need[0] > have[0] or (need[0] == have[0] and need[1] > have[1]):
        return (
            f"plugin {plugin!r} needs vframe plugin API {need[0]}.{need[1]}, but this vframe "
            f"provides {have[0]}.{have[1]}; upgrade vframe (or install an older release of the plugin)"
        )
    if need[0] < have[0]:
        return (
            f"plugin {plugin!r} was written for vframe plugin API {need[0]}.x, but this vframe "
            f"provides {have[0]}.{have[1]}, which is not compatible with it; install a release "
            f"of the plugin made for plugin API {have[0]}.x (docs/plugins.md lists what changed)"
        )
    return None
