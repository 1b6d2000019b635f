"""Structured output through the llguidance backend plugin: JSON schema, regex, choice, grammar."""

import builtins
import json
import re

import jsonschema
import pytest

from vframe import SamplingParams
from vframe.core.sample.request_setup import SamplingSetup
from vframe.core.sampling_params import GuidedDecodingParams, StructuredOutputsParams
from vframe.errors import ConfigError, InvalidRequestError
from vframe.plugins import get_registry

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK_JSON = [{"role": "user", "content": "Describe a person as JSON with name, age and city."}]


def test_twenty_json_generations_parse_and_validate(llm_fp32):
    params = SamplingParams(
        n=20, temperature=1.0, seed=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    [out] = llm_fp32.chat(ASK_JSON, params, use_tqdm=False)
    assert len(out.outputs) == 20
    for completion in out.outputs:
        assert completion.finish_reason == "stop"
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_regex_constraint_always_matches(llm_fp32):
    pattern = r"[A-Z][a-z]{2,8} [0-9]{2}"
    params = SamplingParams(
        n=20, temperature=1.0, seed=1, max_tokens=30, structured_outputs=StructuredOutputsParams(regex=pattern)
    )
    [out] = llm_fp32.generate("My name and age:", params, use_tqdm=False)
    assert all(re.fullmatch(pattern, c.text) for c in out.outputs), [c.text for c in out.outputs]


def test_choice_grammar_and_older_name(llm_fp32):
    choices = ["yes", "no", "maybe"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, structured_outputs=StructuredOutputsParams(choice=choices)),
        SamplingParams(temperature=0.8, seed=2, max_tokens=10, guided_decoding=GuidedDecodingParams(choice=choices)),
        SamplingParams(
            temperature=0.0,
            max_tokens=20,
            structured_outputs=StructuredOutputsParams(grammar='start: "The answer is " ("A" | "B") "."'),
        ),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),  # unconstrained, same batch
    ]
    outs = llm_fp32.generate(["Is the sky blue? Answer:"] * 4, params, use_tqdm=False)
    assert outs[0].outputs[0].text in choices and outs[1].outputs[0].text in choices
    assert outs[2].outputs[0].text in ("The answer is A.", "The answer is B.")
    assert len(outs[3].outputs[0].token_ids) == 5


def test_json_object_without_whitespace(llm_fp32):
    so = StructuredOutputsParams(json_object=True, disable_any_whitespace=True)
    [out] = llm_fp32.chat(ASK_JSON, SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=so), use_tqdm=False)
    text = out.outputs[0].text
    assert isinstance(json.loads(text), dict) and not re.search(r"\s(?=[\"{}\[\],:])|[{,:]\s", text)


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (StructuredOutputsParams(regex="(unclosed"), r"(?s)structured_outputs.regex is invalid: .*unclosed group"),
        (StructuredOutputsParams(json={"type": "objectx"}), r"structured_outputs.json is invalid: .*objectx"),
        (StructuredOutputsParams(json="{not json"), r"structured_outputs: "),
    ],
)
def test_invalid_constraints_fail_when_added(llm_fp32, so, message):
    with pytest.raises(InvalidRequestError, match=message):
        llm_fp32.generate("Hi", SamplingParams(structured_outputs=so), use_tqdm=False)
    assert not llm_fp32.llm_engine.has_unfinished_requests()


def test_backend_is_a_registered_plugin(llm_fp32):
    assert get_registry("structured_output").get("guidance").target_str == (
        "vframe.structured.guidance:GuidanceBackend"
    )
    with pytest.raises(Exception, match="unknown structured-output backend 'xgrammar'; known: guidance"):
        SamplingSetup(llm_fp32.llm_engine.plugin_context).backend("xgrammar")


def test_missing_library_gives_a_clear_error(monkeypatch, llm_fp32):
    real_import = builtins.__import__

    def no_llguidance(name, *args, **kwargs):
        if name.startswith("llguidance"):
            raise ImportError("No module named 'llguidance'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_llguidance)
    cls = get_registry("structured_output").load("guidance")
    assert cls.check_available() == [
        "structured output needs the llguidance package: pip install llguidance (or 'vframe[structured]')"
    ]
    with pytest.raises(ConfigError, match="pip install llguidance"):
        SamplingSetup(llm_fp32.llm_engine.plugin_context).prepare(
            SamplingParams(structured_outputs=StructuredOutputsParams(regex="a+"))
        )
