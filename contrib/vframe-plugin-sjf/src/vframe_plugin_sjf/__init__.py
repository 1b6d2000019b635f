"""Shortest-job-first scheduling for vframe, selected with ``scheduler="sjf"``."""

from __future__ import annotations

import vframe

VFRAME_PLUGIN_API = "1.0"


@vframe.hookimpl
def vframe_register_schedulers(register) -> None:
    register("sjf", "vframe_plugin_sjf.scheduler:ShortestJobFirstScheduler")
