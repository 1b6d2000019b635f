"""Request input to token ids, off the event loop.

Tokenizing a long text or rendering a chat template takes milliseconds to
seconds; on the event loop it would stall every stream and ``/health``. So it
runs in a small thread pool, and each worker thread has its own copy of the
tokenizer: a Hugging Face fast tokenizer used by two threads at once raises
"Already borrowed". (The tokenizers library releases the GIL while it encodes.)

A text that cannot fit the context whatever its tokens are is refused before
it is tokenized: ``max_prompt_chars`` is ``max_model_len`` times the longest
token of the vocabulary, in characters.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from vframe.entrypoints.chat_utils import tool_call_arguments
from vframe.entrypoints.openai.chat_template import template_kwargs
from vframe.entrypoints.openai.errors import APIError
from vframe.entrypoints.openai.protocol import ChatMessage
from vframe.entrypoints.openai.template_sandbox import TemplateRenderError, TemplateSandbox, TemplateTimeoutError
from vframe.errors import InvalidRequestError

T = TypeVar("T")
NUM_WORKERS = 2


@dataclass
class Prompt:
    text: str | None
    token_ids: list[int]


class PromptBuilder:
    """Texts and conversations to ``Prompt``s, in ``NUM_WORKERS`` worker threads."""

    def __init__(self, tokenizer: Any, max_model_len: int, trust_request_chat_template: bool = False) -> None:
        self._source = copy.deepcopy(tokenizer)  # never used to encode: only copied from
        self._copy_lock = threading.Lock()
        self._local = threading.local()
        self._executor = ThreadPoolExecutor(NUM_WORKERS, thread_name_prefix="vframe-prompts")
        self.trust_request_chat_template = trust_request_chat_template
        # Client templates render in a child process (template_sandbox.py).
        self._sandbox = TemplateSandbox(self._source) if trust_request_chat_template else None
        self.max_prompt_chars = _max_prompt_chars(self._source, max_model_len)

    def _tokenizer(self) -> Any:
        tokenizer = getattr(self._local, "tokenizer", None)
        if tokenizer is None:
            with self._copy_lock:
                tokenizer = self._local.tokenizer = copy.deepcopy(self._source)
        return tokenizer

    async def _in_worker(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._sandbox is not None:
            self._sandbox.shutdown()

    # ------------------------------------------------------------------ #

    def check_chars(self, num_chars: int, field: str) -> None:
        if self.max_prompt_chars is not None and num_chars > self.max_prompt_chars:
            raise APIError.bad_request(
                f"{field} has {num_chars} characters; no tokenization of that many fits this model's context "
                f"(at most {self.max_prompt_chars} characters); shorten the prompt",
                param=field,
                code="context_length_exceeded",
            )

    async def texts(self, texts: list[str], add_special_tokens: bool = True, field: str = "prompt") -> list[Prompt]:
        for text in texts:
            self.check_chars(len(text), field)
        return await self._in_worker(self._encode_all, texts, add_special_tokens)

    def _encode_all(self, texts: list[str], add_special_tokens: bool) -> list[Prompt]:
        tokenizer = self._tokenizer()
        return [Prompt(t, tokenizer(t, add_special_tokens=add_special_tokens).input_ids) for t in texts]

    async def chat(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> Prompt:
        """The conversation rendered with the chat template, then tokenized (the
        rendered text already holds the special tokens the template wants).
        ``tools`` (OpenAI function tools) become the template's ``tools``."""
        if add_generation_prompt and continue_final_message:
            raise APIError.bad_request(
                "add_generation_prompt and continue_final_message cannot both be true",
                param="continue_final_message",
            )
        conversation = [_template_message(i, m) for i, m in enumerate(messages)]
        self.check_chars(sum(len(m["content"]) for m in conversation), "messages")
        template, variables = template_kwargs(
            self._source, chat_template_kwargs, chat_template, self.trust_request_chat_template
        )
        options = {
            "add_generation_prompt": add_generation_prompt,
            "continue_final_message": continue_final_message,
            "chat_template": template,
            **({"tools": tools} if tools else {}),
            **variables,
        }
        if template is None:
            text = await self._in_worker(self._render, conversation, options)
        else:
            assert self._sandbox is not None  # template_kwargs refuses templates unless trusted
            try:
                text = await self._sandbox.render(conversation, options)
            except TemplateTimeoutError as e:
                raise APIError.bad_request(f"{e}; simplify the template", param="chat_template") from e
            except TemplateRenderError as e:
                raise _rejected(e) from e
        [prompt] = await self.texts([text], add_special_tokens=False, field="messages")
        return prompt

    def _render(self, conversation: list[dict[str, Any]], options: dict[str, Any]) -> str:
        try:
            return self._tokenizer().apply_chat_template(conversation, tokenize=False, **options)
        except Exception as e:  # jinja2 errors raised by the template itself ("roles must alternate")
            raise _rejected(e) from e

    async def token_strs(self, token_ids: list[int]) -> list[str]:
        return await self._in_worker(lambda: self._tokenizer().convert_ids_to_tokens(token_ids))

    async def decode(self, token_ids: list[int]) -> str:
        return await self._in_worker(lambda: self._tokenizer().decode(token_ids))


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates read it. An assistant's call arguments, a JSON
    string on the wire, become an object: tool-use templates expect one (vLLM does the same)."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            field = f"messages.{index}.tool_calls.{j}.function.arguments"
            try:
                arguments = tool_call_arguments(call.function.arguments, field)
            except InvalidRequestError as e:
                raise APIError.bad_request(str(e), param=field) from e
            function = {"name": call.function.name, "arguments": arguments}
            calls.append({"id": call.id, "type": call.type, "function": function})
        rendered["tool_calls"] = calls
    return rendered


def _rejected(error: Exception) -> APIError:
    return APIError.bad_request(f"the chat template rejected the messages: {error}", param="messages")


def _max_prompt_chars(tokenizer: Any, max_model_len: int) -> int | None:
    """No text longer than this fits ``max_model_len`` tokens: a token covers at most
    as many characters as its vocabulary entry has. ``None`` when a normalizer may
    shorten the text before it is split (then that bound does not hold)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    return max_model_len * longest
