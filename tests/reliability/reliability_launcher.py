"""``python reliability_launcher.py serve ...``: ``vframe serve`` with the suite's
test plugin (``reliability_plugin``) registered first, so that requests can name
its logits processors."""

from __future__ import annotations

import sys

import reliability_plugin  # found next to this script: sys.path[0] is its directory

from vframe.entrypoints.cli import main
from vframe.plugins import register_plugin

if __name__ == "__main__":
    register_plugin(reliability_plugin, "reliability")
    sys.exit(main(sys.argv[1:]))
