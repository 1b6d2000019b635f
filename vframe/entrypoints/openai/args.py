"""Command-line flags of ``vframe serve`` (engine flags are added by the CLI)."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vframe.entrypoints.openai.tools import ToolCallingConfig

DEFAULT_PORT = 8000
# Big enough for a full 131,072-token context sent as token ids (about 7 bytes
# each in JSON, 0.9 MB) with room to spare; small enough that parsing a body,
# which happens on the event loop, stays near 20 ms.
DEFAULT_MAX_REQUEST_BODY_BYTES = 2 * 2**20


@dataclass(frozen=True)
class ServerPolicy:
    """What the server accepts from clients and tells them, set by the operator's flags."""

    api_key: str | None = None
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    # Host names the server answers; None: loopback names, checked only when the
    # server listens on a loopback address without an API key (DNS rebinding).
    allowed_hosts: list[str] | None = None
    check_host: bool = False
    trust_request_chat_template: bool = False
    enable_prompt_tokens_details: bool = False  # usage.prompt_tokens_details.cached_tokens
    tool_calling: ToolCallingConfig | None = None  # None: no --enable-auto-tool-choice, no parser
    chat_template: str | None = None  # --chat-template: replaces the model's

    @classmethod
    def from_args(cls, args: argparse.Namespace, loopback: bool) -> ServerPolicy:
        """Raises ``ConfigError`` for flags that do not go together."""
        from vframe.entrypoints.openai.tools import ToolCallingConfig

        api_key = args.api_key or os.environ.get("VFRAME_API_KEY") or None
        hosts = [h.strip() for h in args.allowed_hosts.split(",") if h.strip()] if args.allowed_hosts else None
        return cls(
            api_key=api_key,
            max_request_body_bytes=args.max_request_body_bytes,
            allowed_hosts=hosts,
            check_host=hosts is not None or (loopback and api_key is None),
            trust_request_chat_template=args.trust_request_chat_template,
            enable_prompt_tokens_details=args.enable_prompt_tokens_details,
            tool_calling=ToolCallingConfig.from_flags(
                args.enable_auto_tool_choice, args.tool_call_parser, args.exclude_tools_when_tool_choice_none
            ),
            chat_template=load_chat_template(args.chat_template),
        )


def load_chat_template(value: str | None) -> str | None:
    """``--chat-template``: a file's contents, or the value itself when it is a Jinja
    template (vLLM's rule: it holds one of ``{}`` or a newline); ``ConfigError`` for a
    path that does not exist."""
    from vframe.errors import ConfigError

    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            return f.read()
    except OSError as e:
        if any(c in value for c in "{}\n"):
            return value
        raise ConfigError(
            f"--chat-template {value!r} looks like a file path, but it cannot be read ({e.strerror}); "
            "give a template file or the template itself"
        ) from None


@dataclass(frozen=True)
class LoRAModule:
    """One ``--lora-modules`` entry: ``name=path`` or a JSON object (vLLM's two forms)."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModule:
        """Raises ``ValueError`` naming the entry and the accepted forms."""
        forms = "give name=path or '{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'"
        if text.lstrip().startswith("{"):
            try:
                fields = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{text!r} is not valid JSON ({e}); {forms}") from e
            if not isinstance(fields, dict):
                raise ValueError(f"{text!r}: a JSON entry must be an object; {forms}")
            unknown = set(fields) - {"name", "path", "base_model_name"}
            name, path = fields.get("name"), fields.get("path")
            base = fields.get("base_model_name")
            strings = all(isinstance(v, str) and v for v in (name, path)) and isinstance(base, str | None)
            if unknown or not strings:
                raise ValueError(
                    f"{text!r}: needs the strings name and path, optionally base_model_name; {forms}"
                )
            return cls(name, path, base)
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"{text!r}: {forms}")
        return cls(name, path)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive number of bytes, got {text}")
    return value


def _lora_module(text: str) -> LoRAModule:
    try:
        return LoRAModule.parse(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    from vframe.engine.arg_utils import add_vllm_flag_syntax

    add_vllm_flag_syntax(parser)  # -tp, --max-model-len 32k, JSON --hf-overrides ... as vllm serve takes them
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
        "--served-model-name", nargs="+", default=None, metavar="NAME",
        help="the model names clients may send, listed by /v1/models; responses give the first "
        "(default: MODEL as given, or SmolLM2-135M-Instruct)",
    )
    server.add_argument(
        "--chat-template", default=None,
        help="the chat template to use instead of the model's: a file, or the Jinja template itself",
    )
    server.add_argument(
        "--shutdown-timeout", type=float, default=30.0,
        help="seconds a SIGTERM waits for in-flight requests before aborting them",
    )
    server.add_argument(
        "--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="refuse request bodies larger than this with 413 (default: 2 MiB)",
    )
    server.add_argument(
        "--allowed-hosts", default=None,
        help="comma-separated Host names the server answers ('*': any). Default: on a loopback --host "
        "without an API key, loopback names only (DNS-rebinding protection); otherwise any",
    )
    server.add_argument(
        "--trust-request-chat-template", action="store_true",
        help="let requests send their own chat template (chat_template), rendered sandboxed with a time bound",
    )
    server.add_argument(
        "--lora-modules", nargs="+", default=None, type=_lora_module, metavar="NAME=PATH",
        help="LoRA adapters to serve under their names (needs --enable-lora): name=path, or vLLM's JSON "
        "'{\"name\": ..., \"path\": ..., \"base_model_name\": ...}'; loaded and checked at start-up",
    )
    server.add_argument(
        "--enable-prompt-tokens-details", action="store_true",
        help="report usage.prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache",
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    server.add_argument("--no-access-log", action="store_true", help="do not log one line per HTTP request")
    tools = parser.add_argument_group("tool calling (tools and tool_choice in chat requests)")
    tools.add_argument(
        "--enable-auto-tool-choice", action="store_true",
        help='serve tool_choice "auto" (the default with tools): the model decides, --tool-call-parser reads '
        "its calls out of the text. Without it, such a request is a 400; required and named choices always work",
    )
    tools.add_argument(
        "--tool-call-parser", default=None, metavar="NAME",
        help="the tool_parser plugin that reads the model's calls (built in: hermes, llama3_json; "
        "vframe plugins lists all)",
    )
    tools.add_argument(
        "--exclude-tools-when-tool-choice-none", action="store_true",
        help='with tool_choice "none", do not give the tools to the chat template (default: give them, as vLLM)',
    )
