"""After the suite's traffic (the corpus, load, disconnect storm, failing
processors), the shared server holds about the file descriptors and threads it
held after its first request, and has started no child process. Runs last
(conftest.py); a server restarted by a crash is measured from its restart."""

from __future__ import annotations

import time

import pytest
from reliability_harness import Resources, SharedServer, alive_pids

pytestmark = pytest.mark.reliability

FD_SLACK = 16  # keep-alive sockets close within uvicorn's 5 s; a few files open lazily
THREAD_SLACK = 8  # worker pools grow to their maximum size on first use


def test_shared_server_does_not_leak(shared: SharedServer):
    server = shared.get()
    baseline = shared.baseline
    deadline = time.monotonic() + 15
    while (now := Resources.of(server.process.pid)).fds > baseline.fds + FD_SLACK and time.monotonic() < deadline:
        time.sleep(0.5)
    assert now.fds <= baseline.fds + FD_SLACK, f"{now.fds} open fds, {baseline.fds} after the first request"
    assert now.threads <= baseline.threads + THREAD_SLACK, f"{now.threads} threads, {baseline.threads} at first"
    assert alive_pids(now.children) == list(baseline.children)
