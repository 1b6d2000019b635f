"""vLLM's ``AsyncLLM`` (``vllm.v1.engine.async_llm``): the engine stepping in its
own thread, fed from asyncio, with vLLM's method names and signatures.

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=...))
    async for output in engine.generate(prompt, sampling_params, request_id):
        ...   # as SamplingParams.output_kind says: "final" (vframe's default), CUMULATIVE or DELTA
    engine.shutdown()

It is a thin face over ``vframe.core.async_engine.AsyncLLMEngine`` (what ``vframe
serve`` runs): requests from one event loop, the one that first calls ``generate``.
vframe's default ``output_kind`` is ``"final"``, where vLLM's ``SamplingParams``
default is ``CUMULATIVE``: pass ``output_kind`` to stream (docs/compatibility.md).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable
from typing import Any

from vframe.core.async_engine import AsyncLLMEngine, EngineDeadError
from vframe.core.config import EngineConfig
from vframe.core.engine import PromptType
from vframe.core.outputs import RequestOutput
from vframe.core.sampling_params import SamplingParams
from vframe.lora.request import LoRARequest


class AsyncLLM:
    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine
        self._started = False

    @classmethod
    def from_engine_args(cls, engine_args: Any, **_vllm_options: Any) -> AsyncLLM:
        """Build and load the engine (in its thread) from ``AsyncEngineArgs``.
        vLLM's other arguments (``usage_context``, ``stat_loggers``,
        ``start_engine_loop``) do not apply and are ignored."""
        return cls.from_vllm_config(engine_args.create_engine_config())

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, **_vllm_options: Any) -> AsyncLLM:
        return cls(AsyncLLMEngine.from_config(vllm_config))

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        **_vllm_options: Any,
    ) -> AsyncIterator[RequestOutput]:
        """Queue the request and yield its outputs as ``sampling_params.output_kind``
        says; stopping the iteration early (``break``) aborts the request."""
        if not self._started:
            self.engine.start()  # binds the engine to this event loop
            self._started = True
        stream = await self.engine.add_request(request_id, prompt, sampling_params, priority, lora_request)
        async with stream:
            async for output in stream:
                yield output

    async def abort(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            self.engine.abort(rid)

    async def get_tokenizer(self, lora_request: LoRARequest | None = None) -> Any:
        return self.engine.tokenizer

    async def get_vllm_config(self) -> EngineConfig:
        return self.engine.config

    async def check_health(self) -> None:
        """Raise ``EngineDeadError`` once the engine has failed or stopped."""
        if not self.engine.is_running:
            raise EngineDeadError(f"the engine is not running ({self.engine.dead_error or 'shut down'})")

    @property
    def is_running(self) -> bool:
        return self.engine.is_running

    @property
    def errored(self) -> bool:
        return self.engine.dead_error is not None

    @property
    def dead_error(self) -> BaseException | None:
        return self.engine.dead_error

    def shutdown(self) -> None:
        """Abort what is running and stop the engine thread (and any tensor-parallel workers)."""
        self.engine.shutdown_blocking()
