"""Chat messages as chat templates read them, shared by ``LLM.chat`` and the server."""

from __future__ import annotations

import json
from typing import Any

from vframe.errors import InvalidRequestError


def tool_call_arguments(arguments: str | dict[str, Any] | None, field: str) -> dict[str, Any]:
    """An assistant's tool-call ``arguments`` as an object. OpenAI messages carry them
    as a JSON string, but tool-use templates index them as a mapping
    (``call.function.arguments.city``), so a string is parsed, as vLLM does; ``""`` and
    ``None`` are ``{}``. ``field`` names the arguments in the error."""
    if isinstance(arguments, dict):
        return arguments
    if arguments is None or (isinstance(arguments, str) and not arguments.strip()):
        return {}
    value = None
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{field} must be a JSON object, as a string; got {str(arguments)[:40]!r}")
    return value
