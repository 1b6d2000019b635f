"""Shortest-job-first scheduling for vframe, selected with ``scheduling_policy="sjf"``."""

from __future__ import annotations

import vframe
from vframe.plugins import RegisterFn

VFRAME_PLUGIN_API = "1.2"  # the scheduling-policy interface


@vframe.hookimpl
def vframe_register_scheduling_policies(register: RegisterFn) -> None:
    register("sjf", "vframe_plugin_sjf.policy:ShortestJobFirst")
