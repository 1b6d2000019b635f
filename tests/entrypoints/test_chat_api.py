"""``LLM.chat`` inputs: content as a list of text parts, and ``tools`` for the template."""

import pytest

from vframe import SamplingParams
from vframe.errors import InvalidRequestError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]

# Renders the tools' names, so that the prompt shows whether the template received them.
TOOLS_TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
)


def test_content_as_text_parts_renders_as_the_joined_string(llm_fp32):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is the capital"}, {"type": "text", "text": "of France?"}]}]
    joined = [{"role": "user", "content": "What is the capital\nof France?"}]
    [from_parts] = llm_fp32.chat(parts, GREEDY, use_tqdm=False)
    [from_str] = llm_fp32.chat(joined, GREEDY, use_tqdm=False)
    assert from_parts.prompt == from_str.prompt
    assert from_parts.outputs[0].token_ids == from_str.outputs[0].token_ids


def test_non_text_content_part_is_refused_with_the_part(llm_fp32):
    image = {"type": "image_url", "image_url": {"url": "http://x/a.png"}}
    with pytest.raises(InvalidRequestError, match="image_url"):
        llm_fp32.chat([{"role": "user", "content": [image]}], GREEDY, use_tqdm=False)


def test_tools_reach_the_chat_template(llm_fp32):
    msg = [{"role": "user", "content": "Weather in Paris?"}]
    [out] = llm_fp32.chat(msg, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE, tools=TOOLS)
    assert out.prompt == "Tools: get_weather\nuser: Weather in Paris?\nassistant:"
    [plain] = llm_fp32.chat(msg, GREEDY, use_tqdm=False, chat_template=TOOLS_TEMPLATE)
    assert plain.prompt == "user: Weather in Paris?\nassistant:"
