"""The ``server`` fixture: one real ``vframe serve`` process shared by the server tests."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai_server import Server, start_server, stop_server


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("vframe-serve"))
    yield srv
    stop_server(srv.process)


@pytest.fixture
def client(server: Server) -> Iterator[openai.OpenAI]:
    with server.client() as c:
        yield c
