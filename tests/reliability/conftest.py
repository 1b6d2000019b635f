"""Fixtures of the reliability suite: one shared server (restarted when a test
kills it) started with the test plugin, and servers of their own for the tests
that stop theirs. See README.md."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The server helpers of the OpenAI server tests, shared rather than copied.
sys.path.insert(0, str(Path(__file__).parents[1] / "entrypoints" / "openai"))

from openai_server import Server  # noqa: E402
from reliability_harness import SharedServer  # noqa: E402

LAST = "test_shared_server_does_not_leak"


@pytest.fixture(scope="session")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedServer]:
    keeper = SharedServer(tmp_path_factory)
    yield keeper
    keeper.stop()


@pytest.fixture
def server(shared: SharedServer) -> Server:
    return shared.get()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The leak check runs after every other test that used the shared server."""
    items.sort(key=lambda item: item.name == LAST)
