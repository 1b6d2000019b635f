"""``SamplingParams``: how one request is decoded, with vLLM's names and meanings."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from vframe.errors import InvalidRequestError

_GREEDY_EPS = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """Decoding parameters of one request.

    ``temperature=0`` is greedy. ``top_k`` of 0 or -1 disables top-k.
    ``logprobs=k`` returns, for each generated token, the chosen token's logprob
    plus the ``k`` most likely ones (vLLM's shape: one dict per position).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    output_kind: str = "final"
    # Filled in by the engine from the tokenizer / generation config.
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other knobs cannot change the argmax.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, value: object, rule: str) -> InvalidRequestError:
            return InvalidRequestError(f"SamplingParams.{name}={value!r} is invalid: {rule}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if self.temperature < 0.0:
            raise bad("temperature", self.temperature, "must be >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", self.top_k, "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "must be in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, "must be an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or self.logprobs < 0):
            raise bad("logprobs", self.logprobs, "must be an integer >= 0 or None")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer or None")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", self.stop, "must be a non-empty string or a list of them")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be non-negative token ids")
        if self.output_kind not in ("final", "cumulative", "delta"):
            raise bad("output_kind", self.output_kind, "must be 'final', 'cumulative' or 'delta'")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def all_stop_token_ids(self) -> set[int]:
        return self._all_stop_token_ids

    def update_from_tokenizer(self, eos_token_ids: set[int]) -> None:
        """Add the model's end-of-sequence ids unless ``ignore_eos``."""
        if not self.ignore_eos:
            self._all_stop_token_ids = set(self.stop_token_ids) | eos_token_ids

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
