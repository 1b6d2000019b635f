"""SamplingParams / StructuredOutputsParams / BeamSearchParams: vLLM's names, checked at construction."""

import pytest

from vframe.core.sampling_params import (
    BeamSearchParams,
    GuidedDecodingParams,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)
from vframe.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"best_of": 1, "n": 2}, r"SamplingParams.best_of=1 is invalid: must be an integer in \[n \(2\), 1024\]"),
        ({"n": 10**9}, r"n=1000000000 is invalid: must be an integer in \[1, 1024\]"),
        # issue 9 item 5: numbers that passed a sign check and then broke a step
        ({"top_k": 2**63}, r"top_k=9223372036854775808 is invalid"),
        ({"seed": 2**64}, r"seed=18446744073709551616 is invalid: must be a 64-bit integer"),
        ({"seed": -(2**63) - 1}, r"seed=-9223372036854775809 is invalid"),
        ({"stop_token_ids": [2**70]}, r"stop_token_ids=\[1180591620717411303424\] is invalid"),
        ({"max_tokens": 2**64}, r"max_tokens=18446744073709551616 is invalid"),
        ({"logprobs": 2**63}, r"logprobs=9223372036854775808 is invalid"),
        ({"logit_bias": {5: 1e39}}, r"logit_bias=\{5: 1e\+39\} is invalid: must map non-negative token ids to numbers in \[-100, 100\]"),
        ({"logit_bias": {2**64: 1.0}}, r"logit_bias=.* is invalid"),
        ({"best_of": 3, "temperature": 0.0}, r"best_of=3 is invalid: must be 1 with greedy sampling"),
        ({"best_of": 3, "output_kind": "delta"}, r"best_of=3 is invalid: must equal n when streaming"),
        ({"presence_penalty": 2.5}, r"presence_penalty=2.5 is invalid: must be in \[-2.0, 2.0\]"),
        ({"frequency_penalty": -3}, r"frequency_penalty=-3 is invalid"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty=0.0 is invalid: must be > 0"),
        ({"prompt_logprobs": -1}, r"prompt_logprobs=-1 is invalid"),
        ({"truncate_prompt_tokens": 0}, r"truncate_prompt_tokens=0 is invalid"),
        ({"logit_bias": {"x": 1.0}}, r"logit_bias=\{'x': 1.0\} is invalid: keys must be token ids"),
        ({"logit_bias": {5: float("nan")}}, r"logit_bias=.* is invalid: must map non-negative token ids"),
        ({"allowed_token_ids": []}, r"allowed_token_ids=\[\] is invalid: must be a non-empty list"),
        ({"bad_words": ["ok", " "]}, r"bad_words=\['ok', ' '\] is invalid"),
        ({"logits_processors": [42]}, r"logits_processors=42 is invalid: each entry must be a callable"),
        ({"length_penalty": 0.5}, r"length_penalty=0.5 is invalid: only applies with use_beam_search=True"),
        ({"early_stopping": True}, r"early_stopping=True is invalid: only applies with use_beam_search=True"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.5}, r"temperature=0.5 is invalid: must be 0 with use_beam_search"),
        ({"use_beam_search": True, "temperature": 0, "early_stopping": "sometimes"}, r"early_stopping='sometimes' is invalid"),
        ({"seed": 1.5}, r"seed=1.5 is invalid"),
        ({"temperature": True}, r"temperature=True is invalid"),
    ],
)
def test_invalid_values_name_the_field(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs)


def test_child_seeds_wrap_to_64_bits():
    assert SamplingParams(seed=2**64 - 1, n=2).child_seed(1) == 0
    assert SamplingParams(seed=7, n=3).child_seed(2) == 9
    assert SamplingParams(seed=-1, n=2).child_seed(0) == 2**64 - 1  # torch's reading of -1
    assert SamplingParams(n=2).child_seed(1) is None


def test_clone_shares_a_deeply_nested_schema():
    schema: dict = {"type": "string"}
    for _ in range(300):
        schema = {"type": "object", "properties": {"a": schema}}
    sp = SamplingParams(structured_outputs=StructuredOutputsParams(json=schema))
    assert sp.clone().structured_outputs is sp.structured_outputs  # was a RecursionError


def test_defaults_and_normalization():
    sp = SamplingParams(stop="END", top_k=-1, logit_bias={"17": 2.5}, bad_words="oops")
    assert sp.stop == ["END"] and sp.top_k == 0 and sp.logit_bias == {17: 2.5} and sp.bad_words == ["oops"]
    assert (sp.n, sp.best_of, sp.repetition_penalty, sp.presence_penalty) == (1, None, 1.0, 0.0)
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.1, repetition_penalty=1.2)
    assert greedy.sampling_type == SamplingType.GREEDY
    assert (greedy.top_p, greedy.top_k, greedy.min_p, greedy.repetition_penalty) == (1.0, 0, 0.0, 1.2)
    assert SamplingParams(seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_structured_outputs_need_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="needs exactly one of json, regex, choice, grammar, json_object; got none"):
        StructuredOutputsParams()
    with pytest.raises(InvalidRequestError, match="got json, regex"):
        StructuredOutputsParams(json={"type": "object"}, regex="a+")
    with pytest.raises(InvalidRequestError, match=r"choice=\[\] is invalid"):
        StructuredOutputsParams(choice=[])


def test_guided_decoding_is_the_older_name():
    sp = SamplingParams(guided_decoding=GuidedDecodingParams(regex="[0-9]+"))
    assert sp.structured_outputs.regex == "[0-9]+" and sp.guided_decoding is None
    with pytest.raises(InvalidRequestError, match="not both"):
        SamplingParams(
            guided_decoding=GuidedDecodingParams(regex="a"), structured_outputs=StructuredOutputsParams(regex="b")
        )


def test_clone_shares_logits_processors_and_copies_the_rest():
    class Stateful:
        def __init__(self):
            self.seen = 0

        def __call__(self, output_ids, logits):
            self.seen += 1
            return logits

    processor = Stateful()
    sp = SamplingParams(logits_processors=[processor], stop=["x"])
    copy = sp.clone()
    assert copy.logits_processors[0] is processor
    copy.stop.append("y")
    assert sp.stop == ["x"]


def test_bad_words_are_banned_with_and_without_a_leading_space(tokenizer):
    sp = SamplingParams(bad_words=["Paris", "hello world"])
    sp.update_from_tokenizer({2}, tokenizer)
    encode = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert sp.bad_words_token_ids == [encode("Paris"), encode(" Paris"), encode("hello world"), encode(" hello world")]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beam_width": 0, "max_tokens": 4}, r"BeamSearchParams.beam_width=0 is invalid"),
        ({"beam_width": 2, "max_tokens": 0}, r"BeamSearchParams.max_tokens=0 is invalid"),
        ({"beam_width": 2, "max_tokens": 4, "temperature": 0.7}, r"temperature=0.7 is invalid: must be 0"),
        ({"beam_width": 2, "max_tokens": 4, "early_stopping": 1.5}, r"early_stopping=1.5 is invalid"),
    ],
)
def test_invalid_beam_search_params(kwargs, message):
    with pytest.raises(InvalidRequestError, match=message):
        BeamSearchParams(**kwargs)
