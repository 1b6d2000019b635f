"""Start and stop real ``vframe serve`` processes on free loopback ports.

Servers run float32 (greedy outputs are exact) with a small context and KV
cache so that every test is quick, and with an API key so that every test also
exercises authentication. Servers are always stopped: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
SERVER_FLAGS = [
    "--dtype", "float32",
    "--max-model-len", str(MAX_MODEL_LEN),
    "--kv-cache-memory-bytes", str(128 * 2**20),
    "--no-access-log",
]


@dataclass
class Server:
    process: subprocess.Popen
    base_url: str  # http://127.0.0.1:PORT
    log_path: Path

    @property
    def api_url(self) -> str:
        return self.base_url + "/v1"

    def log(self) -> str:
        return self.log_path.read_text()

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.api_url, api_key=API_KEY, max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.api_url, api_key=API_KEY, max_retries=0, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {API_KEY}", **kwargs.pop("headers", {})}
        return httpx.post(self.base_url + path, headers=headers, timeout=kwargs.pop("timeout", 60), **kwargs)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of /metrics: (name, sorted labels) -> value."""
        text = httpx.get(self.base_url + "/metrics", timeout=10).text
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
        }

    def metric(self, name: str, **labels: str) -> float:
        return self.metrics().get((name, tuple(sorted(labels.items()))), 0.0)

    def wait_for_metric(self, name: str, value: float, timeout_s: float = 10.0) -> float:
        deadline = time.monotonic() + timeout_s
        while (current := self.metric(name)) != value and time.monotonic() < deadline:
            time.sleep(0.05)
        return current


def server_env() -> dict[str, str]:
    """The environment of a test server. OpenMP threads sleep between parallel
    regions instead of spinning: the test machine's cores are shared with other
    suites, and spinning threads that lose their core slow small ops by two orders
    of magnitude (docs/serving.md, "CPU threads"). Correctness does not depend on it."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    env.pop("VFRAME_API_KEY", None)
    return env


def start_server(
    tmp_path: Path,
    *extra: str,
    api_key: str | None = API_KEY,
    timeout_s: float = 180.0,
    entry: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> Server:
    """``entry``: what runs the CLI (default ``python -m vframe.entrypoints.cli``);
    ``env``: variables set for the server on top of ``server_env()``."""
    log_path = tmp_path / "server.log"
    entry = entry or [sys.executable, "-m", "vframe.entrypoints.cli"]
    command = [*entry, "serve", "--host", "127.0.0.1", "--port", "0", *SERVER_FLAGS, *extra]
    env = server_env() | (env or {})
    if api_key is not None:
        command += ["--api-key", api_key]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = None
    try:
        deadline = time.monotonic() + timeout_s
        while server is None:
            match = re.search(r"serving .* on (http://127\.0\.0\.1:\d+)/v1", log_path.read_text())
            if match:
                server = Server(process, match.group(1), log_path)
            elif process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vframe serve did not start:\n{log_path.read_text()[-3000:]}")
            else:
                time.sleep(0.1)
        while True:
            try:
                if httpx.get(server.base_url + "/health", timeout=5).status_code == 200:
                    return server
            except httpx.TransportError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vframe serve never became healthy:\n{server.log()[-3000:]}")
            time.sleep(0.1)
    except BaseException:
        stop_server(process)
        raise


def stop_server(process: subprocess.Popen, timeout_s: float = 30.0) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    return process.returncode
