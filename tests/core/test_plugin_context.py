"""PluginContext, EngineView and the ``context`` constructor rule (plugin API 1.2).
End to end, with two engines: tests/entrypoints/test_two_engines_plugin_context.py."""

from __future__ import annotations

import weakref

import pytest
import torch

from vframe.core.config import EngineConfig
from vframe.core.plugin_context import EngineView, PluginContext, next_engine_id, takes_context


def make_context(vocab_size: int = 8) -> PluginContext:
    return PluginContext(
        engine_config=EngineConfig(),
        model_config=None,
        tokenizer=None,
        vocab_size=vocab_size,
        eos_token_ids=frozenset({2}),
        device=torch.device("cpu"),
        dtype=torch.float32,
    )


def test_engine_ids_count_up_across_the_process():
    first = next_engine_id()
    n = int(first.removeprefix("engine-"))
    assert [next_engine_id(), next_engine_id()] == [f"engine-{n + 1}", f"engine-{n + 2}"]


class Positional:
    def __init__(self, substring: str, context: PluginContext) -> None: ...


class KeywordOnly:
    def __init__(self, *, context: PluginContext, substring: str = "x") -> None: ...


class Legacy:
    def __init__(self, token_id: int) -> None: ...


class CatchAll:
    def __init__(self, **kwargs: object) -> None: ...


class NoInit:
    pass


@pytest.mark.parametrize(
    ("cls", "expected"),
    [(Positional, True), (KeywordOnly, True), (Legacy, False), (CatchAll, False), (NoInit, False)],
)
def test_a_class_gets_the_context_only_when_its_init_names_it(cls, expected):
    assert takes_context(cls) is expected


def test_contexts_are_told_apart_by_identity_so_plugins_can_cache_per_engine():
    a, b = make_context(), make_context()
    assert a != b and a == a
    cache: weakref.WeakKeyDictionary[PluginContext, str] = weakref.WeakKeyDictionary()
    cache[a], cache[b] = "engine a", "engine b"
    assert (cache[a], cache[b]) == ("engine a", "engine b")
    del a
    assert list(cache.values()) == ["engine b"]


def test_contexts_are_read_only():
    context = make_context()
    with pytest.raises(AttributeError):
        context.vocab_size = 9  # type: ignore[misc]


def test_engine_view_stats_are_a_fresh_copy_of_the_engines_counters():
    counters = {"num_running": 1.0, "kv_cache_usage": 0.25}
    view = EngineView("engine-9", "model-dir", make_context(), 128, 16, 40, _stats=lambda: counters)
    stats = view.stats()
    stats["num_running"] = 5.0
    assert view.stats() == {"num_running": 1.0, "kv_cache_usage": 0.25}
    assert EngineView("engine-9", "model-dir", make_context(), 128, 16, 40).stats() == {}


def test_reprs_stay_short():
    context = make_context()
    view = EngineView("engine-9", "model-dir", context, 128, 16, 40)
    assert repr(view) == (
        "EngineView(engine_id='engine-9', model='model-dir', max_model_len=128, block_size=16, num_kv_blocks=40)"
    )
    assert repr(context) == (
        "PluginContext(vocab_size=8, eos_token_ids=frozenset({2}), device=device(type='cpu'), dtype=torch.float32)"
    )
