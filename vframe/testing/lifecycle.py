"""Conformance check for lifecycle-hook plugins: ``check_lifecycle_hooks``.

A lifecycle hook that raises is disabled for the rest of the process and the
engine goes on (docs/plugins.md, "Lifecycle hooks"): a metrics plugin with a
bug does not crash anything, it just silently stops reporting. This check
catches that before users do. It runs a real engine on the embedded model
through one workload that raises every lifecycle hook with every finish reason
(``"length"`` for one completion and for ``n=2``, ``"abort"``, ``"error"`` from a
logits processor that raises, ``"stop"`` from a stop token) and asserts that:

* the plugin is loaded (else the reason it was skipped);
* the engine raised each hook the plugin implements, with ``engine_view``;
* none of the plugin's hooks raised (none was disabled).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from vframe.plugins import (
    hookimpl,
    loaded_plugins,
    plugin_failures,
    register_plugin,
    unregister_plugin,
)
from vframe.plugins.hookspecs import LIFECYCLE_HOOKS

_RECORDER = "vframe-testing-lifecycle-recorder"


class _Recorder:
    """Counts the lifecycle events the engine raised, and their finish reasons."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.finish_reasons: set[str] = set()
        self.views: set[str] = set()

    @hookimpl
    def vframe_engine_started(self, engine_view: Any) -> None:
        self._seen("vframe_engine_started", engine_view)

    @hookimpl
    def vframe_request_added(self, engine_view: Any) -> None:
        self._seen("vframe_request_added", engine_view)

    @hookimpl
    def vframe_engine_step(self, engine_view: Any) -> None:
        self._seen("vframe_engine_step", engine_view)

    @hookimpl
    def vframe_request_finished(self, finish_reason: str, engine_view: Any) -> None:
        self._seen("vframe_request_finished", engine_view)
        self.finish_reasons.update(str(finish_reason).split(","))

    @hookimpl
    def vframe_engine_shutdown(self, engine_view: Any) -> None:
        self._seen("vframe_engine_shutdown", engine_view)

    def _seen(self, hook: str, engine_view: Any) -> None:
        self.calls[hook] += 1
        self.views.add(engine_view.engine_id)


def _failing_processor(output_token_ids: list[int], logits: Any) -> Any:
    raise RuntimeError("vframe.testing: this request is meant to fail")


def check_lifecycle_hooks(plugin: str, **engine_kwargs: Any) -> None:
    """Run the workload above with ``plugin`` (its plugin name: the entry-point
    name, or the name given to ``register_plugin``) loaded; raise
    ``AssertionError`` naming the hook and the error if any of its hooks was
    disabled. ``engine_kwargs`` go to the engine (default: the embedded model
    in float32); the plugin must be allowed by ``VFRAME_PLUGINS`` / ``plugins``.
    """
    from vframe.core.engine import LLMEngine
    from vframe.core.sampling_params import SamplingParams

    info = {p.name: p for p in loaded_plugins()}.get(plugin)
    if info is None:
        reasons = [f.error for f in plugin_failures() if f.plugin == plugin]
        raise AssertionError(
            f"plugin {plugin!r} is not loaded: "
            + ("; ".join(reasons) if reasons else "not installed, or left out by VFRAME_PLUGINS / plugins")
        )
    hooks = [h for h in info.hooks if h in LIFECYCLE_HOOKS]
    if not hooks:
        raise AssertionError(f"plugin {plugin!r} implements no lifecycle hook (it has: {', '.join(info.hooks)})")
    failures_before = len(plugin_failures())
    recorder = _Recorder()
    register_plugin(recorder, _RECORDER)
    try:
        engine = LLMEngine.from_kwargs(**{"dtype": "float32", "max_model_len": 256, **engine_kwargs})
        try:
            _run_workload(engine, SamplingParams)
        finally:
            engine.shutdown()
    finally:
        unregister_plugin(_RECORDER)

    not_raised = [h for h in hooks if recorder.calls[h] == 0]
    assert not not_raised, f"the engine never raised {', '.join(not_raised)} (a bug in the check)"
    expected = {"length", "abort", "error", "stop"}
    assert expected <= recorder.finish_reasons, (
        f"the workload finished with {sorted(recorder.finish_reasons)}, not every one of {sorted(expected)}"
    )
    disabled = [f.error for f in plugin_failures()[failures_before:] if f.plugin == plugin]
    assert not disabled, f"plugin {plugin!r}: " + "; ".join(disabled)


def _run_workload(engine: Any, SamplingParams: type) -> None:  # noqa: N803 - the class, imported late
    greedy = {"temperature": 0.0, "ignore_eos": True}
    engine.add_request("length", "Hello", SamplingParams(max_tokens=3, **greedy))
    engine.add_request("n2", "Once upon a time", SamplingParams(n=2, max_tokens=2, seed=0))
    engine.add_request("abort", "Count to ten:", SamplingParams(max_tokens=64, **greedy))
    engine.add_request("error", "Hi", SamplingParams(max_tokens=4, logits_processors=[_failing_processor]))
    # Whatever token comes first ends the request as a stop.
    engine.add_request("stop", "The sky is", SamplingParams(max_tokens=8, stop_token_ids=list(range(engine.vocab_size))))
    engine.step()
    engine.abort_request("abort")
    for _ in range(100):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise AssertionError("the workload did not finish in 100 steps (a bug in the check)")
