"""Command-line flags of ``vframe serve`` (engine flags are added by the CLI)."""

from __future__ import annotations

import argparse

DEFAULT_PORT = 8000


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "model_tag", nargs="?", default=None, metavar="MODEL",
        help="GGUF file or Hugging Face directory (default: the embedded SmolLM2-135M-Instruct)",
    )
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    server.add_argument("--port", type=int, default=DEFAULT_PORT, help="port to listen on (0: any free port)")
    server.add_argument(
        "--api-key", default=None,
        help="require 'Authorization: Bearer KEY' on the API (default: $VFRAME_API_KEY; none = open)",
    )
    server.add_argument(
        "--served-model-name", default=None,
        help="the model name clients send (default: MODEL as given, or SmolLM2-135M-Instruct)",
    )
    server.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="seconds a SIGTERM waits for in-flight requests before aborting them",
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    server.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
