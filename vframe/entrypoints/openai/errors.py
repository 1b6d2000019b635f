"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

Every failure a client can cause is a 4xx naming the offending field: pydantic
validation errors, vframe's ``InvalidRequestError`` (raised by ``SamplingParams``
and the engine's prompt checks) and any ``ValueError``, ``TypeError`` or
``RecursionError`` raised while a request is prepared (a schema nested too deep
to copy), unknown routes and models, bodies over the size limit. Anything else
is a 500 whose message says it is the server's fault.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vframe.core.async_engine import EngineDeadError

logger = logging.getLogger(__name__)

# What preparing a request raises for bad input: InvalidRequestError (a ValueError)
# and the library errors of a value it cannot take (a schema too deep to copy).
REQUEST_ERRORS = (ValueError, TypeError, RecursionError)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class APIError(Exception):
    """An error answered to the client with ``status_code`` in OpenAI's shape."""

    def __init__(
        self, status_code: int, message: str, *, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code

    @classmethod
    def bad_request(cls, message: str, *, param: str | None = None, code: str | None = None) -> APIError:
        return cls(400, message, param=param, code=code)

    @classmethod
    def from_request_error(cls, error: Exception, prompt_field: str) -> APIError:
        """A 400 for what preparing a request raised, naming the API field it is about."""
        if isinstance(error, RecursionError):
            return cls.bad_request(
                "the request is nested too deeply to process (a JSON schema or a value with hundreds of "
                "levels); flatten it",
                param="response_format" if prompt_field == "response_format" else None,
            )
        return cls.from_invalid_request(error, prompt_field)

    @classmethod
    def from_invalid_request(cls, error: Exception, prompt_field: str) -> APIError:
        """Map the engine's message to the API field it is about."""
        message = str(error) or type(error).__name__
        match = re.match(r"SamplingParams\.(\w+)\b", message)
        if match:
            param: str | None = match.group(1)
        elif message.startswith("structured_outputs"):  # the engine's name of response_format
            param = "response_format"
            message = re.sub(r"^structured_outputs\.json\b", "response_format.json_schema", message)
        elif "logits processor" in message:
            param = "logits_processors"
        elif "prompt" in message:
            param = prompt_field
        elif "max_tokens" in message or "KV cache" in message:
            param = "max_tokens"
        elif message.startswith("priority"):
            param = "priority"
        else:
            param = None
        return cls.bad_request(message, param=param)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)

    def body(self) -> dict[str, Any]:
        return error_body(self.status_code, self.message, param=self.param, code=self.code)


def error_body(
    status_code: int, message: str, *, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    error_type = _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(
    status_code: int, message: str, *, param: str | None = None, code: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(status_code, message, param=param, code=code), status_code=status_code)


def validation_error_response(error: RequestValidationError) -> JSONResponse:
    """400 listing every invalid field; ``param`` is the first one."""
    problems: list[str] = []
    params: list[str] = []
    for err in error.errors():
        loc = [str(p) for p in err.get("loc", ()) if p != "body"]
        field = ".".join(loc)
        if err.get("type") == "json_invalid":
            problems.append(f"the body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})")
            continue
        if err.get("type") == "lone_surrogate":  # protocol._Body: the path is in the context
            field = err["ctx"]["path"]
            problems.append(err["msg"])
        elif err.get("type") == "extra_forbidden":
            problems.append(f"{field}: unknown parameter")
        elif not field:
            problems.append(f"the body must be a JSON object with the request's fields ({err['msg']})")
        else:
            if err.get("type") == "value_error":  # our own validators say what they got
                problems.append(f"{field}: {err['msg'].removeprefix('Value error, ')}")
            else:
                shown = "" if err.get("type") == "missing" else f" (got {_short(err.get('input'))})"
                problems.append(f"{field}: {err['msg']}{shown}")
        if field:
            params.append(field)
    return error_response(400, "; ".join(problems), param=params[0] if params else None)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}; see /docs for the API"
        elif exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(exc.detail)
        code = "request_too_large" if exc.status_code == 413 else None
        response = error_response(exc.status_code, message, code=code)
        if exc.headers:
            response.headers.update(exc.headers)
        return response

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return error_response(503, str(exc))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving %s %s", request.method, request.url.path)
        return error_response(500, f"internal server error ({type(exc).__name__}); see the server log")
