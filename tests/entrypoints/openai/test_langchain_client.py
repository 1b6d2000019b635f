"""A third-party client against ``vframe serve``: LangChain's ``ChatOpenAI`` (the
``langchain-openai`` package) chats, streams and binds a pydantic tool on the shared
``server`` (float32, greedy outputs exact).

LangChain counts tokens with tiktoken only when asked (``get_num_tokens``), which
would download an encoding: the ``no_tiktoken`` fixture makes any such load fail, so
the tests show that chat, streaming and tools need no network.
"""

from __future__ import annotations

import json
from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, ToolMessage
from langchain_openai import ChatOpenAI
from openai_server import API_KEY, Server
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"
ANSWER = "The capital of France is Paris."


class GetWeather(BaseModel):
    """The current weather in a city."""

    city: Literal["Paris", "London", "Tokyo"] = Field(description="the city")
    unit: Literal["celsius", "fahrenheit"] = Field(description="the temperature unit")


@pytest.fixture(autouse=True)
def no_tiktoken(monkeypatch: pytest.MonkeyPatch) -> None:
    import tiktoken

    def refuse(*args, **kwargs):
        raise AssertionError("tiktoken loaded an encoding (a download without a cache)")

    monkeypatch.setattr(tiktoken, "get_encoding", refuse)
    monkeypatch.setattr(tiktoken, "encoding_for_model", refuse)


@pytest.fixture
def chat_model(server: Server):
    return ChatOpenAI(
        model=MODEL, base_url=server.api_url, api_key=API_KEY, temperature=0, max_tokens=8, max_retries=0,
    )


def test_invoke_answers_as_the_openai_client_does(chat_model, client):
    messages = [SystemMessage("Be brief."), HumanMessage("What is the capital of France?")]
    reply = chat_model.invoke(messages)
    expected = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0,
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "What is the capital of France?"}],
    )
    assert isinstance(reply, AIMessage) and reply.content == expected.choices[0].message.content == ANSWER
    assert reply.response_metadata["finish_reason"] == "stop"
    assert reply.response_metadata["model_name"] == MODEL
    assert reply.usage_metadata["output_tokens"] == expected.usage.completion_tokens
    assert reply.usage_metadata["input_tokens"] == expected.usage.prompt_tokens


def test_stream_chunks_add_up_to_the_invoked_reply(server: Server):
    # stream_usage: LangChain asks for the usage chunk (stream_options.include_usage) only when told
    chat_model = ChatOpenAI(
        model=MODEL, base_url=server.api_url, api_key=API_KEY, temperature=0, max_tokens=8, max_retries=0,
        stream_usage=True,
    )
    messages = [SystemMessage("Be brief."), HumanMessage("What is the capital of France?")]
    invoked = chat_model.invoke(messages)
    chunks = list(chat_model.stream(messages))
    assert len([c for c in chunks if c.content]) > 1  # streamed, not one block
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole = whole + chunk
    assert whole.content == ANSWER
    assert whole.response_metadata["finish_reason"] == "stop"
    assert whole.usage_metadata == invoked.usage_metadata  # from the stream's usage chunk


def test_bind_tools_with_a_forced_call_returns_parsed_tool_calls(chat_model):
    # the named tool_choice holds the reply to GetWeather's schema (structured outputs); LangChain
    # sends it without additionalProperties, which the server reads as false, as vLLM does
    model = chat_model.bind_tools([GetWeather], tool_choice="GetWeather").bind(max_tokens=40)
    question = HumanMessage("What is the weather in Paris, in celsius?")
    reply = model.invoke([question])
    assert reply.invalid_tool_calls == []
    [call] = reply.tool_calls
    assert call["name"] == "GetWeather" and call["id"].startswith("chatcmpl-tool-")
    weather = GetWeather(**call["args"])  # the arguments are valid for the tool
    assert weather == GetWeather(city="Paris", unit="celsius")

    # streamed, the call's argument fragments reassemble into the same call
    streamed = None
    for chunk in model.stream([question]):
        streamed = chunk if streamed is None else streamed + chunk
    assert [(c["name"], c["args"]) for c in streamed.tool_calls] == [("GetWeather", call["args"])]

    # the call and its result go back to the server (arguments as a JSON string, OpenAI's shape)
    follow_up = chat_model.bind_tools([GetWeather]).bind(tool_choice="none").invoke(
        [question, reply, ToolMessage(json.dumps({"temperature": 18}), tool_call_id=call["id"])]
    )
    assert isinstance(follow_up.content, str) and follow_up.tool_calls == []
