"""Client chat templates, rendered in a child process with a time bound.

A template sent by a client (allowed by ``--trust-request-chat-template``) is code
the client chose. Rendered in the server's process, a looping template holds the
GIL, so every step of the engine thread waits for it, and it occupies a prompt
worker that ordinary requests queue behind: a normal stream waited 7.3 s for a
token during the stall probe. So client templates render in one child process of
their own, spawned when the server starts:

* in the child, a trace function on the compiled template's frames raises once
  ``RENDER_TIMEOUT_S`` has passed, which ends any loop in the template;
* in the server, a render that has not answered ``_KILL_AFTER_S`` later (stuck in
  C code, or queued behind other client templates) is refused, and the child is
  killed and replaced.

The child holds a copy of the tokenizer (transformers renders the template in
jinja2's ``ImmutableSandboxedEnvironment``) and imports nothing of vframe's
engine. The model's own template is trusted and renders in the server.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from types import FrameType
from typing import Any

RENDER_TIMEOUT_S = 1.0
# Beyond the render bound: the child's start-up (a second or two) on the first
# request, or other client templates ahead in its queue.
_KILL_AFTER_S = 10.0


class TemplateTimeoutError(Exception):
    """A request's chat template ran past ``RENDER_TIMEOUT_S``."""


class TemplateRenderError(Exception):
    """The client's template raised (``raise_exception``, a bad filter ...)."""


class TemplateSandbox:
    """One child process that renders client templates, one at a time."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._pool = self._start()

    def _start(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_init_child,
            initargs=(self._tokenizer,),
        )
        pool.submit(int)  # start the child now, not on the first request
        return pool

    async def render(self, conversation: list[dict[str, Any]], options: dict[str, Any]) -> str:
        """The rendered text; raises ``TemplateTimeoutError`` past the time bound
        and ``TemplateRenderError`` for what the template itself raised."""
        future = asyncio.get_running_loop().run_in_executor(self._pool, _render, conversation, options)
        try:
            outcome, result = await asyncio.wait_for(future, RENDER_TIMEOUT_S + _KILL_AFTER_S)
        except (asyncio.TimeoutError, BrokenProcessPool):
            self._restart()
            raise TemplateTimeoutError(f"the chat template ran longer than {RENDER_TIMEOUT_S:g} s") from None
        if outcome == "timeout":
            raise TemplateTimeoutError(result)
        if outcome == "error":
            raise TemplateRenderError(result)
        return result

    def _restart(self) -> None:
        self.shutdown()
        self._pool = self._start()

    def shutdown(self) -> None:
        # The executor has no way to stop a running task: kill the child outright.
        for process in list(getattr(self._pool, "_processes", {}).values()):
            process.kill()
        self._pool.shutdown(wait=False, cancel_futures=True)


@contextmanager
def time_bound(seconds: float) -> Iterator[None]:
    """Raise ``TemplateTimeoutError`` inside any Jinja template code that this thread
    runs after ``seconds``. Only frames of compiled templates (file ``<template>``)
    are traced line by line, so the rest of the call runs at full speed."""
    deadline = time.monotonic() + seconds

    def on_line(frame: FrameType, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise TemplateTimeoutError(f"the chat template ran longer than {seconds:g} s")
        return on_line

    def on_call(frame: FrameType, event: str, arg: Any) -> Any:
        return on_line if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        yield
    finally:
        sys.settrace(previous)


# --------------------------------------------------------------------------- #
# in the child process
# --------------------------------------------------------------------------- #

_child_tokenizer: Any = None


def _init_child(tokenizer: Any) -> None:
    global _child_tokenizer
    _child_tokenizer = tokenizer


def _render(conversation: list[dict[str, Any]], options: dict[str, Any]) -> tuple[str, str]:
    """``("ok", text)``, ``("timeout", why)`` or ``("error", why)``: plain strings
    cross the process boundary whatever the template raised."""
    try:
        with time_bound(RENDER_TIMEOUT_S):
            return "ok", _child_tokenizer.apply_chat_template(conversation, tokenize=False, **options)
    except TemplateTimeoutError as e:
        return "timeout", str(e)
    except Exception as e:  # noqa: BLE001 - jinja2 errors raised by the template itself
        return "error", str(e)
