"""The ``guidance`` structured-output backend, on llguidance.

llguidance computes a token mask from the grammar's lexer and Earley parser
state in tens of microseconds per request and fills a batch of masks with its
own thread pool (``LLExecutor``), straight into the bitmask tensor.
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


class GuidanceGrammar(CompiledGrammar):
    def __init__(self, backend: GuidanceBackend, grammar: str) -> None:
        self.backend = backend
        self.grammar = grammar

    def new_matcher(self) -> GuidanceMatcher:
        import llguidance

        return GuidanceMatcher(llguidance.LLMatcher(self.backend.ll_tokenizer, self.grammar, log_level=0))


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
        error = LLMatcher.validate_grammar(grammar, self.ll_tokenizer)
        if error:
            kind = params.constraint_kinds()[0]
            raise InvalidRequestError(f"structured_outputs.{kind} is invalid: {error}")
        return GuidanceGrammar(self, grammar)

    def fill_bitmask(self, matchers: list[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        assert bitmask.dtype == torch.int32 and bitmask.is_contiguous() and bitmask.device.type == "cpu"
        pairs = [(m.matcher, row) for m, row in matchers]  # type: ignore[attr-defined]
        self.executor.unsafe_compute_mask_ptr(
            pairs, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0]
        )


def _close_objects(schema: Any) -> Any:
    """``additionalProperties: false`` on every object schema that does not say otherwise."""
    if isinstance(schema, dict):
        schema = {k: _close_objects(v) for k, v in schema.items()}
        if schema.get("type") == "object" or "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_close_objects(v) for v in schema]
    return schema
