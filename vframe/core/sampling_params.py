"""How one request is decoded, with vLLM's names and meanings.

``SamplingParams`` (sampling, penalties, stops, logprobs, constraints),
``StructuredOutputsParams`` (JSON schema / regex / choice / grammar; the older
name ``GuidedDecodingParams`` is accepted) and ``BeamSearchParams`` (for
``LLM.beam_search``). Every value is checked at construction: a bad one raises
``InvalidRequestError`` naming the field, the value and the rule.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, IntEnum
from typing import Any, Union

from vframe.errors import InvalidRequestError

_GREEDY_EPS = 1e-5
_INT64_MAX = 2**63 - 1
# Seeds are 64-bit: torch takes [-2**63, 2**64 - 1] (negative ones as two's complement).
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1
MAX_N = 1024  # completions per request (n, best_of): each is a sequence in the engine
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values

# A per-request logits processor: a callable ``(output_token_ids, logits[V]) -> logits[V]``
# (or ``(prompt_token_ids, output_token_ids, logits[V])``), the name of a registered
# ``logits_processor`` plugin, or ``(name, constructor kwargs)``.
LogitsProcessorSpec = Union[Callable[..., Any], str, tuple[str, dict[str, Any]]]


class RequestOutputKind(str, Enum):
    """vLLM's names for ``SamplingParams.output_kind``; each member equals its string
    (``RequestOutputKind.DELTA == "delta"``), so either form may be passed or compared."""

    CUMULATIVE = "cumulative"  # every output holds everything generated so far
    DELTA = "delta"  # every output holds only what is new since the last one
    FINAL_ONLY = "final"  # one output, when the request finishes


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


def _bad(owner: str, name: str, value: object, rule: str) -> InvalidRequestError:
    return InvalidRequestError(f"{owner}.{name}={value!r} is invalid: {rule}")


def _is_int(x: object) -> bool:
    """A 64-bit integer (not a bool): anything larger cannot become a tensor."""
    return isinstance(x, int) and not isinstance(x, bool) and -_INT64_MAX - 1 <= x <= _INT64_MAX


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class StructuredOutputsParams:
    """Constrain the output to a JSON schema, a regex, one of several strings or a
    grammar (Lark or GBNF). Exactly one of ``json``, ``regex``, ``choice``,
    ``grammar`` and ``json_object`` is set.

    ``json`` is a schema (dict or JSON string); ``json_object=True`` is any JSON
    object. ``disable_any_whitespace`` forbids whitespace between JSON tokens,
    ``disable_additional_properties`` treats objects without
    ``additionalProperties`` as closed. ``backend`` names a registered
    structured-output backend (None: the default, ``"guidance"``).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    backend: str | None = None

    def __post_init__(self) -> None:
        owner = type(self).__name__
        kinds = self.constraint_kinds()
        if len(kinds) != 1:
            raise InvalidRequestError(
                f"{owner} needs exactly one of json, regex, choice, grammar, json_object; got "
                f"{', '.join(kinds) or 'none'}"
            )
        if self.choice is not None and (
            not isinstance(self.choice, (list, tuple))
            or not self.choice
            or any(not isinstance(c, str) for c in self.choice)
        ):
            raise _bad(owner, "choice", self.choice, "must be a non-empty list of strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _bad(owner, name, value, "must be a non-empty string")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise _bad(owner, "json", self.json, "must be a JSON schema, as a dict or a JSON string")

    def constraint_kinds(self) -> list[str]:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        return kinds


class GuidedDecodingParams(StructuredOutputsParams):
    """vLLM's older name for ``StructuredOutputsParams``."""


@dataclass
class SamplingParams:
    """Decoding parameters of one request; vLLM's fields, names and meanings.

    ``temperature=0`` is greedy (top-p/top-k/min-p then have no effect; penalties,
    bias and constraints still do). ``top_k`` of 0 or -1 disables top-k.
    ``logprobs=k`` returns, per generated token, the chosen token's logprob plus
    the ``k`` most likely ones; ``prompt_logprobs=k`` the same for every prompt
    token after the first. ``presence_penalty``/``frequency_penalty`` apply to the
    generated tokens, ``repetition_penalty`` to prompt and generated tokens.
    ``best_of`` completions are generated and the ``n`` with the highest
    cumulative logprob returned. ``use_beam_search`` (with ``best_of`` or ``n`` as
    the beam width, ``length_penalty``, ``early_stopping``) is served by
    ``LLM.generate`` through ``LLM.beam_search``.
    """

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logits_processors: list[LogitsProcessorSpec] | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    output_kind: str | RequestOutputKind = "final"
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: GuidedDecodingParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    # vLLM's free-form arguments for plugins (a logits processor may read them);
    # nothing built in reads them.
    extra_args: dict[str, Any] | None = None

    # Filled in by the engine when the request is added (see core/sample/request_setup.py).
    _all_stop_token_ids: set[int] = field(default_factory=set, init=False, repr=False, compare=False)
    _bad_words_token_ids: list[list[int]] = field(default_factory=list, init=False, repr=False, compare=False)
    _logits_processor_factories: list[Any] = field(default_factory=list, init=False, repr=False, compare=False)
    _grammar: Any = field(default=None, init=False, repr=False, compare=False)  # a CompiledGrammar

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.output_kind, RequestOutputKind):
            self.output_kind = self.output_kind.value
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidRequestError(
                    "SamplingParams: give structured_outputs or its older name guided_decoding, not both"
                )
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.logit_bias is not None and isinstance(self.logit_bias, dict):
            # JSON clients send token ids as strings.
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise _bad("SamplingParams", "logit_bias", self.logit_bias, "keys must be token ids") from None
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:  # noqa: C901 - one flat list of rules reads best
        def bad(name: str, value: object, rule: str) -> InvalidRequestError:
            return _bad("SamplingParams", name, value, rule)

        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, f"must be an integer in [1, {MAX_N}]")
        if self.best_of is not None and (not _is_int(self.best_of) or not self.n <= self.best_of <= MAX_N):
            raise bad("best_of", self.best_of, f"must be an integer in [n ({self.n}), {MAX_N}] or None")
        for name, lo, hi in (("presence_penalty", -2.0, 2.0), ("frequency_penalty", -2.0, 2.0)):
            value = getattr(self, name)
            if not _is_number(value) or not lo <= value <= hi:
                raise bad(name, value, f"must be in [{lo}, {hi}]")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "must be > 0 (1 means off)")
        if not _is_number(self.temperature) or self.temperature < 0.0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise bad("top_k", self.top_k, f"must be 0 or -1 (disabled) or a positive integer <= {_INT64_MAX}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.seed is not None and (
            not isinstance(self.seed, int) or isinstance(self.seed, bool) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise bad("seed", self.seed, f"must be a 64-bit integer in [{SEED_MIN}, {SEED_MAX}] or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "must be a non-empty string or a list of them")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be non-negative 64-bit token ids")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or value < 0):
                raise bad(name, value, "must be an integer >= 0 or None")
        if self.truncate_prompt_tokens is not None and (
            not _is_int(self.truncate_prompt_tokens)
            or (self.truncate_prompt_tokens < 1 and self.truncate_prompt_tokens != -1)
        ):
            raise bad(
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens,
                "must be an integer >= 1 (keep that many last prompt tokens), -1 (max_model_len) or None",
            )
        if self.output_kind not in ("final", "cumulative", "delta"):
            raise bad("output_kind", self.output_kind, "must be 'final', 'cumulative' or 'delta'")
        if self.logit_bias is not None and (
            not isinstance(self.logit_bias, dict)
            or any(
                not _is_int(k) or k < 0 or not _is_number(v) or abs(v) > MAX_LOGIT_BIAS
                for k, v in self.logit_bias.items()
            )
        ):
            raise bad(
                "logit_bias",
                self.logit_bias,
                f"must map non-negative token ids to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            )
        if self.allowed_token_ids is not None and (
            not isinstance(self.allowed_token_ids, (list, tuple))
            or not self.allowed_token_ids
            or any(not _is_int(t) or t < 0 for t in self.allowed_token_ids)
        ):
            raise bad("allowed_token_ids", self.allowed_token_ids, "must be a non-empty list of token ids")
        if self.bad_words is not None and any(not isinstance(w, str) or not w.strip() for w in self.bad_words):
            raise bad("bad_words", self.bad_words, "must be a list of non-empty strings")
        if self.logits_processors is not None:
            for lp in self.logits_processors:
                ok = callable(lp) or isinstance(lp, str) or (
                    isinstance(lp, tuple) and len(lp) == 2 and isinstance(lp[0], str) and isinstance(lp[1], dict)
                )
                if not ok:
                    raise bad(
                        "logits_processors",
                        lp,
                        "each entry must be a callable, a registered name, or (name, kwargs)",
                    )
        if self.structured_outputs is not None and not isinstance(
            self.structured_outputs, StructuredOutputsParams
        ):
            raise bad("structured_outputs", self.structured_outputs, "must be a StructuredOutputsParams")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", self.early_stopping, "must be True, False or 'never'")
        if not _is_number(self.length_penalty):
            raise bad("length_penalty", self.length_penalty, "must be a finite number")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", self.extra_args, "must be a dict or None")
        if self.use_beam_search:
            self._verify_beam_search(bad)
        else:
            if self.length_penalty != 1.0:
                raise bad("length_penalty", self.length_penalty, "only applies with use_beam_search=True")
            if self.early_stopping is not False:
                raise bad("early_stopping", self.early_stopping, "only applies with use_beam_search=True")
            if (self.best_of or 1) > 1 and self.temperature < _GREEDY_EPS:
                raise bad("best_of", self.best_of, "must be 1 with greedy sampling (temperature=0)")
            if (self.best_of or self.n) > self.n and self.output_kind != "final":
                raise bad("best_of", self.best_of, "must equal n when streaming (output_kind != 'final')")

    def _verify_beam_search(self, bad: Callable[[str, object, str], InvalidRequestError]) -> None:
        if self.temperature >= _GREEDY_EPS:
            raise bad("temperature", self.temperature, "must be 0 with use_beam_search=True")
        if self.top_p != 1.0 or self.top_k != 0 or self.min_p != 0.0:
            raise bad("use_beam_search", True, "top_p, top_k and min_p must keep their defaults")
        if self.output_kind != "final":
            raise bad("output_kind", self.output_kind, "must be 'final' with use_beam_search=True")
        for name in ("structured_outputs", "logits_processors", "prompt_logprobs"):
            if getattr(self, name):
                raise bad(name, getattr(self, name), "is not supported with use_beam_search=True")

    # ------------------------------------------------------------------ #

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    @property
    def bad_words_token_ids(self) -> list[list[int]]:
        """Token sequences of ``bad_words``, filled by ``update_from_tokenizer``."""
        return self._bad_words_token_ids

    def update_from_tokenizer(self, eos_token_ids: set[int], tokenizer: Any = None) -> None:
        """Add the model's end-of-sequence ids unless ``ignore_eos``; tokenize ``bad_words``.

        Each bad word is banned at the start of the text and after a space (vLLM's
        rule): its tokens with and without a leading space."""
        if not self.ignore_eos:
            self._all_stop_token_ids = set(self.stop_token_ids) | eos_token_ids
        if not self.bad_words:
            return
        if tokenizer is None:
            raise InvalidRequestError("SamplingParams.bad_words needs a tokenizer (skip_tokenizer_init is set)")
        sequences: list[list[int]] = []
        for word in self.bad_words:
            plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
            spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
            sequences.append(plain)
            if spaced != plain:
                sequences.append(spaced)
        self._bad_words_token_ids = sequences

    @property
    def beam_width(self) -> int:
        return self.best_of or self.n

    def clone(self) -> SamplingParams:
        """A deep copy that shares the user's logits processors, the structured-output
        request and the compiled grammar (callables may hold state the user owns;
        the constraint is read only, and a deeply nested JSON schema must not hit
        the recursion limit of ``copy.deepcopy``)."""
        shared = [
            *(self.logits_processors or []),
            *self._logits_processor_factories,
            self._grammar,
            self.structured_outputs,
        ]
        return copy.deepcopy(self, memo={id(obj): obj for obj in shared if obj is not None})

    def child_seed(self, index: int) -> int | None:
        """The seed of completion ``index`` of ``n``: ``seed + index``, wrapped to 64 bits."""
        return None if self.seed is None else (self.seed + index) % 2**64


@dataclass
class BeamSearchParams:
    """``LLM.beam_search`` parameters (vLLM's names).

    ``beam_width`` beams are kept; each step every beam proposes its
    ``2 * beam_width`` most likely next tokens. A beam ends at an end-of-sequence
    token (unless ``ignore_eos``) or after ``max_tokens``. Scores are cumulative
    logprobs divided by ``generated_length ** length_penalty``. ``early_stopping``
    follows transformers: ``True`` stops once ``beam_width`` beams have finished,
    ``False`` when no running beam can beat the worst finished one at its current
    length, ``"never"`` only when none could at any length.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> InvalidRequestError:
            return _bad("BeamSearchParams", name, getattr(self, name), rule)

        if not _is_int(self.beam_width) or self.beam_width < 1:
            raise bad("beam_width", "must be an integer >= 1")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise bad("max_tokens", "must be an integer >= 1")
        if self.temperature != 0.0:
            raise bad("temperature", "must be 0: vframe's beam search is deterministic")
        if not _is_number(self.length_penalty):
            raise bad("length_penalty", "must be a finite number")
        if self.early_stopping not in (True, False, "never"):
            raise bad("early_stopping", "must be True, False or 'never'")

