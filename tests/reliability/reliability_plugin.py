"""A throwaway vframe plugin for the reliability suite: logits processors that
raise on a chosen call, so that a test can make one request fail mid-step.

Registered at run time (``vframe.plugins.register_plugin``) by
``reliability_launcher.py`` in a server process, or by a test in its own process.
Each completion gets a fresh instance, so the call count is per request.
"""

from __future__ import annotations

import torch

from vframe.core.interfaces import LogitsProcessor
from vframe.plugins import RegisterFn, hookimpl

RAISE_ON_CALL_1 = "reliability_raise_on_call_1"
RAISE_ON_CALL_3 = "reliability_raise_on_call_3"
IDENTITY = "reliability_identity"
ERROR_TEXT = "reliability plugin: injected failure"


class RaisingProcessor(LogitsProcessor):
    """Leaves the logits alone until call ``fail_on_call``, which raises RuntimeError."""

    fail_on_call = 1

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.fail_on_call:
            raise RuntimeError(f"{ERROR_TEXT} on call {self.calls}")
        return logits


class RaiseOnFirstCall(RaisingProcessor):
    fail_on_call = 1  # while sampling the first token, right after the prefill


class RaiseOnThirdCall(RaisingProcessor):
    fail_on_call = 3  # mid-decode: the request already holds KV blocks and output tokens


class Identity(LogitsProcessor):
    def __call__(self, token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        return logits


@hookimpl
def vframe_register_logits_processors(register: RegisterFn) -> None:
    register(RAISE_ON_CALL_1, RaiseOnFirstCall)
    register(RAISE_ON_CALL_3, RaiseOnThirdCall)
    register(IDENTITY, Identity)
