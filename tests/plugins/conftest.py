"""Every plugin test starts and ends with no plugins loaded and no VFRAME_PLUGINS."""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import textwrap
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from vframe.plugins import manager, reset_plugins


@pytest.fixture(autouse=True)
def fresh_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("VFRAME_PLUGINS", raising=False)
    reset_plugins()
    yield
    reset_plugins()


InstallFn = Callable[..., str]


@pytest.fixture
def installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[InstallFn]:
    """``installed(name, source)`` writes ``source`` as a real module file and makes it
    look like an installed plugin with entry point ``name``; returns the module name.
    ``attr=`` points the entry point at an object inside the module."""
    entry_points: list[importlib.metadata.EntryPoint] = []
    module_names: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(manager, "_iter_entry_points", lambda: list(entry_points))

    def install(name: str, source: str, attr: str | None = None) -> str:
        module = f"vframe_test_plugin_{name}_{uuid.uuid4().hex[:8]}"
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        importlib.invalidate_caches()
        module_names.append(module)
        value = f"{module}:{attr}" if attr else module
        entry_points.append(importlib.metadata.EntryPoint(name=name, value=value, group="vframe"))
        return module

    yield install
    for module in module_names:
        sys.modules.pop(module, None)
