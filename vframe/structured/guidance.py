"""The ``guidance`` structured-output backend, on llguidance.

llguidance computes a token mask from the grammar's lexer and Earley parser
state in tens of microseconds per request and fills a batch of masks with its
own thread pool (``LLExecutor``), straight into the bitmask tensor.

Its lexer is built lazily, on the first mask: for a hostile regex
(``"pattern": "^(a{1000}){1000}$"``) that first mask took seconds, on the
engine thread, stalling every stream. So ``compile`` does the expensive part:
it builds one prototype ``LLMatcher``, computes its first mask, and then probes
one token further, all under ``grammar_limits()``; a grammar that fails there
(over a limit, or matching nothing, as ``{"$ref": "#"}`` does) is refused with
``InvalidRequestError``. ``new_matcher()`` is then a cheap ``deep_copy()`` of the
prototype, on the engine thread. ``compile`` is thread-safe and a server runs it
in a worker thread (llguidance releases the GIL while it works).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from vframe.core.sample.structured import (
    CompiledGrammar,
    GrammarMatcher,
    StructuredOutputBackend,
)
from vframe.core.sampling_params import StructuredOutputsParams
from vframe.errors import ConfigError, InvalidRequestError

_INSTALL_HINT = "structured output needs the llguidance package: pip install llguidance (or 'vframe[structured]')"


class GuidanceMatcher(GrammarMatcher):
    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def accept_token(self, token_id: int) -> bool:
        return self.matcher.consume_token(token_id)


def grammar_limits() -> Any:
    """llguidance's parser and lexer limits for every request's grammar, written
    out so that an error naming one can be looked up here. They are llguidance's
    defaults except ``initial_lexer_fuel`` (default 1,000,000), the budget of
    building the lexer: at 200,000 the regex ``^(a{1000}){1000}$`` is refused after
    0.4 s instead of 3.7 s of compile, while schemas with a 1,000-value enum, 200
    properties, formats and patterns compile as before (2 shared cores).
    ``step_lexer_fuel`` bounds the work of each later mask, on the engine thread."""
    from llguidance import LLParserLimits

    return LLParserLimits(
        max_items_in_row=2_000,
        initial_lexer_fuel=200_000,
        step_lexer_fuel=200_000,
        step_max_items=50_000,
        max_lexer_states=250_000,
        max_grammar_size=500_000,
        verbose_errors=False,  # the message goes to the client: no parser dumps
    )


class GuidanceGrammar(CompiledGrammar):
    def __init__(self, backend: GuidanceBackend, prototype: Any) -> None:
        self.backend = backend
        self.prototype = prototype  # an LLMatcher at the start, its lexer warmed by one mask

    def new_matcher(self) -> GuidanceMatcher:
        return GuidanceMatcher(self.prototype.deep_copy())


class GuidanceBackend(StructuredOutputBackend):
    name = "guidance"

    @classmethod
    def check_available(cls) -> list[str]:
        try:
            import llguidance  # noqa: F401
        except ImportError:
            return [_INSTALL_HINT]
        return []

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> None:
        super().__init__(tokenizer, vocab_size, eos_token_ids)
        try:
            import llguidance
        except ImportError as e:
            raise ConfigError(_INSTALL_HINT) from e
        backend_tokenizer = getattr(tokenizer, "backend_tokenizer", None)
        if backend_tokenizer is None:
            raise ConfigError("structured output needs a fast (tokenizers-based) tokenizer")
        # Building the token trie takes about a second; done once per engine.
        self.ll_tokenizer = llguidance.LLTokenizer(
            backend_tokenizer.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_token_ids)
        )
        self.executor = llguidance.LLExecutor()

    def compile(self, params: StructuredOutputsParams) -> GuidanceGrammar:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark

        try:
            if params.json is not None or params.json_object:
                schema = params.json if params.json is not None else {"type": "object"}
                if isinstance(schema, str):
                    schema = json.loads(schema)
                if params.disable_additional_properties:
                    schema = _close_objects(schema)
                grammar = LLMatcher.grammar_from_json_schema(
                    schema, defaults={"whitespace_flexible": not params.disable_any_whitespace}
                )
            elif params.regex is not None:
                grammar = LLMatcher.grammar_from_regex(params.regex)
            elif params.choice is not None:
                grammar = LLMatcher.grammar_from_lark(
                    "start: " + " | ".join(json.dumps(c) for c in params.choice)
                )
            else:
                grammar = LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
        except (ValueError, TypeError) as e:
            raise InvalidRequestError(f"structured_outputs: {e}") from e
        kind = params.constraint_kinds()[0]
        limits = grammar_limits()
        error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer, limits=limits)
        if error:
            raise InvalidRequestError(f"structured_outputs.{kind} is invalid: {error}")
        prototype = LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        error = self._warm(prototype)
        if error:
            raise InvalidRequestError(f"structured_outputs.{kind} cannot be enforced: {error}")
        return GuidanceGrammar(self, prototype)

    def _warm(self, prototype: Any) -> str:
        """Compute the prototype's first mask, then the mask after one allowed
        non-EOS token (on a copy); the error message of the first failure, or ''."""
        mask = prototype.compute_bitmask()
        if prototype.is_error():
            return _first_line(prototype.get_error())
        allowed = _first_allowed(mask, exclude=self.eos_token_ids)
        if allowed is None:  # only end-of-sequence: an empty output
            return ""
        probe = prototype.deep_copy()
        probe.consume_token(allowed)
        probe.compute_bitmask()
        return _first_line(probe.get_error()) if probe.is_error() else ""

    def fill_bitmask(self, matchers: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
        pairs = [(m.matcher, row) for m, row in matchers]  # type: ignore[attr-defined]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )


def _first_allowed(mask: bytes, exclude: set[int]) -> int | None:
    """The lowest token id whose bit is set in a little-endian bitmask."""
    for byte_index, byte in enumerate(mask):
        while byte:
            bit = (byte & -byte).bit_length() - 1
            token_id = 8 * byte_index + bit
            if token_id not in exclude:
                return token_id
            byte &= byte - 1
    return None


def _first_line(error: str) -> str:
    line = error.strip().splitlines()[0] if error.strip() else error
    if line == "NoExtensionBias":  # llguidance's name for "nothing can follow"
        return "no text matches it (a schema that refers only to itself, such as {\"$ref\": \"#\"})"
    return line


def _close_objects(schema: Any) -> Any:
    """``additionalProperties: false`` on every object schema that does not say otherwise."""
    if isinstance(schema, dict):
        schema = {k: _close_objects(v) for k, v in schema.items()}
        if schema.get("type") == "object" or "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_close_objects(v) for v in schema]
    return schema
