"""Which chat template a request may use: the checks before a client template renders.

The model's own template is trusted. A template sent by a client (top-level
``chat_template`` or ``chat_template_kwargs.chat_template``, vLLM's extensions)
is code chosen by the client, so it is refused with a 400 unless the operator
runs ``vframe serve --trust-request-chat-template``. Even then it is:

* at most ``MAX_TEMPLATE_CHARS`` characters, without the ``*`` and ``**``
  operators (the cheapest way to build a gigabyte string in one step);
* rendered by transformers in jinja2's ``ImmutableSandboxedEnvironment`` (no
  attribute escapes, no mutation of the inputs);
* rendered in a child process of its own, and stopped after ``RENDER_TIMEOUT_S``
  (see ``template_sandbox.py``).

The model's template renders in a worker thread (see ``prompts.py``), never on
the event loop. ``chat_template_kwargs`` become template variables;
names that ``apply_chat_template`` itself takes (``tools``, ``tokenize``,
``return_dict`` ...) are refused, so that the request cannot change what the
call returns or pass ``tools`` around the request's ``tools`` and ``tool_choice``.
"""

from __future__ import annotations

import inspect
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols

from vframe.entrypoints.openai.errors import APIError

MAX_TEMPLATE_CHARS = 64 * 1024
TRUST_FLAG = "--trust-request-chat-template"


def template_kwargs(
    tokenizer: Any, kwargs: dict[str, Any] | None, chat_template: str | None, trusted: bool
) -> tuple[str | None, dict[str, Any]]:
    """``(the request's template or None, the template variables)``; raises a 400 for
    what the request may not send."""
    variables = dict(kwargs or {})
    if "chat_template" in variables:
        if chat_template is not None:
            raise APIError.bad_request(
                "give chat_template once: top-level or in chat_template_kwargs, not both", param="chat_template"
            )
        chat_template = variables.pop("chat_template")
        param = "chat_template_kwargs.chat_template"
    else:
        param = "chat_template"
    if "tools" in variables:
        raise APIError.bad_request(
            "chat_template_kwargs.tools: send the tools in the request's tools field (tool_choice says how "
            "they are used)",
            param="chat_template_kwargs",
        )
    reserved = sorted(set(variables) & _call_parameters(tokenizer))
    if reserved:
        raise APIError.bad_request(
            f"chat_template_kwargs may not set {reserved}: they are arguments of the template call, "
            "not template variables (use the request's own fields)",
            param="chat_template_kwargs",
        )
    if chat_template is not None:
        _check_request_template(chat_template, param, trusted)
    return chat_template, variables


def _call_parameters(tokenizer: Any) -> set[str]:
    params = inspect.signature(tokenizer.apply_chat_template).parameters.values()
    return {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)} | {"conversation", "messages"}


def _check_request_template(template: Any, param: str, trusted: bool) -> None:
    if not trusted:
        raise APIError.bad_request(
            f"{param}: this server renders only the model's chat template; a request may send its own only "
            f"when the operator starts vframe serve with {TRUST_FLAG}",
            param=param,
        )
    if not isinstance(template, str) or not template:
        raise APIError.bad_request(f"{param} must be a non-empty string (a Jinja template)", param=param)
    if len(template) > MAX_TEMPLATE_CHARS:
        raise APIError.bad_request(
            f"{param} is {len(template)} characters, over the limit of {MAX_TEMPLATE_CHARS}", param=param
        )
    env = jinja2.Environment(extensions=[loopcontrols, _GenerationTag])
    try:
        tree = env.parse(template)
    except jinja2.TemplateSyntaxError as e:
        raise APIError.bad_request(f"{param} is not a valid Jinja template: {e} (line {e.lineno})", param=param) from e
    if any(True for _ in tree.find_all((nodes.Mul, nodes.Pow))):
        raise APIError.bad_request(
            f"{param} uses the '*' or '**' operator, which request templates may not use (memory bound)", param=param
        )


class _GenerationTag(Extension):
    """Parses transformers' ``{% generation %}...{% endgeneration %}`` blocks for the check above."""

    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body).set_lineno(lineno)
