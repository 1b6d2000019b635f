"""``LLM``: the offline API, with vLLM's names and meanings."""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import Any

from vframe.core.config import EngineConfig
from vframe.core.engine import LLMEngine, PromptType
from vframe.core.outputs import RequestOutput
from vframe.core.sampling_params import SamplingParams
from vframe.errors import InvalidRequestError

logger = logging.getLogger(__name__)

Message = dict[str, Any]


class LLM:
    """Generate text from prompts with an in-process engine.

    ``LLM()`` serves the embedded SmolLM2-135M-Instruct; ``LLM(model=path)``
    takes a GGUF file or a Hugging Face directory. Every engine setting is a
    keyword argument named as in vLLM (``max_num_seqs``, ``block_size``,
    ``enable_prefix_caching``, ``attention_backend`` ...), see
    ``docs/configuration.md``; ``config_file=`` reads them from YAML or TOML.
    """

    def __init__(self, model: str | None = None, *, config_file: str | None = None, **kwargs: Any) -> None:
        if model is not None:
            kwargs["model"] = model
        self.llm_engine = LLMEngine(EngineConfig.from_sources(config_file=config_file, **kwargs))
        # Plugins hear vframe_engine_shutdown when the LLM is dropped or at exit.
        self._finalizer = weakref.finalize(self, self.llm_engine.shutdown)

    def shutdown(self) -> None:
        """Abort what is still running and tell plugins the engine is done."""
        self._finalizer()

    @property
    def config(self) -> EngineConfig:
        return self.llm_engine.config

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    # ------------------------------------------------------------------ #

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompts = list(prompts)
        params = self._per_prompt(sampling_params, len(prompts), "sampling_params")
        priorities = self._per_prompt(priority, len(prompts), "priority", default=0)
        return self._run(list(zip(prompts, params, priorities)), use_tqdm)

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations,
        formatted with the tokenizer's chat template."""
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise InvalidRequestError("chat() needs a tokenizer; do not set skip_tokenizer_init")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts: list[PromptType] = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(
                conversation,
                chat_template=chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **(chat_template_kwargs or {}),
            )
            # The template already holds any special tokens it wants.
            ids = tokenizer(text, add_special_tokens=False).input_ids
            prompts.append({"prompt": text, "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, items: list[tuple[PromptType, SamplingParams, int]], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        order: dict[str, int] = {}
        try:
            for i, (prompt, params, prio) in enumerate(items):
                order[engine.add_request(None, prompt, params, priority=prio)] = i
        except Exception:
            engine.abort_request(list(order))
            raise
        results: list[RequestOutput | None] = [None] * len(items)
        bar = _progress_bar(len(items)) if use_tqdm else None
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished and out.request_id in order:
                        results[order[out.request_id]] = out
                        if bar is not None:
                            bar.update(1)
        except BaseException:
            engine.abort_request(list(order))
            raise
        finally:
            if bar is not None:
                bar.close()
        return results  # type: ignore[return-value]

    @staticmethod
    def _per_prompt(value, n: int, name: str, default: Any = None) -> list[Any]:
        if value is None:
            return [SamplingParams() if default is None else default for _ in range(n)]
        if isinstance(value, (list, tuple)):
            if len(value) != n:
                raise InvalidRequestError(f"{name} has {len(value)} entries for {n} prompts")
            return list(value)
        return [value] * n

    # ------------------------------------------------------------------ #

    def start_profile(self) -> None:
        """Start a torch profiler trace, written to ``torch_profiler_dir`` or
        ``VFRAME_TORCH_PROFILER_DIR`` by ``stop_profile()``."""
        self.llm_engine.model_runner.profile(is_start=True)

    def stop_profile(self) -> None:
        self.llm_engine.model_runner.profile(is_start=False)

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def get_stats(self) -> dict[str, float]:
        return self.llm_engine.get_stats()


def _progress_bar(total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="Processed prompts", dynamic_ncols=True)
