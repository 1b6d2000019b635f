"""``vframe serve`` with a throwaway ``logits_processor`` plugin registered at run
time, so that a test server can run a processor that requests name."""

from __future__ import annotations

import sys

from vframe.core.interfaces import LogitsProcessor
from vframe.entrypoints.cli import main
from vframe.plugins import hookimpl, register_plugin


class BanToken(LogitsProcessor):
    """Never sample ``token_id``."""

    def __init__(self, token_id: int) -> None:
        self.token_id = token_id

    def __call__(self, token_ids, logits):
        logits[self.token_id] = float("-inf")
        return logits


class Plugin:
    @hookimpl
    def vframe_register_logits_processors(self, register):
        register("ban_token", BanToken)


if __name__ == "__main__":
    register_plugin(Plugin(), "openai-test-plugin")
    sys.exit(main(sys.argv[1:]))
