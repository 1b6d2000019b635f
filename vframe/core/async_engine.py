"""``AsyncLLMEngine``: an ``LLMEngine`` stepping in its own thread, fed from asyncio.

The engine is touched by one thread only, the engine thread. asyncio code talks
to it through a command queue that the thread drains between steps, and hears
back through ``loop.call_soon_threadsafe``::

    event loop (HTTP handlers)                 engine thread
    ---------------------------                -------------------------------------
    add_request() --- _Add ----> commands ---> drain: engine.add_request()
                  <-- accepted / error ------- (call_soon_threadsafe)
    add_lora()    --- _Call ---> commands ---> drain: engine.add_lora() (likewise
                  <-- result / error --------  remove_lora, list_loras)
    RequestStream <-- RequestOutputs -------- engine.step() -> outputs, stats snapshot
    abort()       --- _Abort --> commands ---> drain: engine.abort_request()

torch releases the GIL inside its kernels, so the event loop keeps serving HTTP
while a step computes, and a step never waits for a slow client.

Work that depends on one request only and can take long is done before the
request reaches the engine thread: ``compile_structured_output`` compiles a
grammar in a worker thread, so that no step waits for it.

The engine is also *built* in the engine thread (``AsyncLLMEngine(config)``): with
OpenMP (libgomp), once two threads have each run parallel torch work, there are
more OpenMP threads than cores and the runtime stops spin-waiting between
parallel regions; every small op then pays a futex wake-up. Measured on 2 cores:
a decode step of SmolLM2 took 36 ms in the thread that loaded the model and
58 ms in a second thread. So no torch work should run in the event loop's thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from vframe.core.config import EngineConfig
from vframe.core.engine import LLMEngine, PromptType
from vframe.core.outputs import RequestOutput
from vframe.core.pooling_params import PoolingParams
from vframe.core.sampling_params import SamplingParams
from vframe.errors import VFrameError
from vframe.lora.request import LoRARequest

logger = logging.getLogger(__name__)


class EngineDeadError(VFrameError):
    """The engine thread stopped (an error inside a step, or shutdown); no request can run."""


class RequestAbortedError(VFrameError):
    """The server aborted the request (``abort_all``, at shutdown); the outputs so far stand."""


@dataclass
class _Add:
    request_id: str
    prompt: PromptType
    params: SamplingParams
    priority: int
    lora_request: LoRARequest | None
    accepted: asyncio.Future[None]


@dataclass
class _Call:
    """Run ``fn(engine)`` on the engine thread between steps; its result or error goes to ``done``."""

    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future[Any]


@dataclass
class _Abort:
    request_id: str


class RequestStream:
    """The outputs of one request, in order, ending with a ``finished`` one.

    Iterate it with ``async for``. Leaving the loop early (``break``, an exception,
    the task being cancelled) must be followed by ``abort()``, which frees the
    request's KV blocks at the engine's next turn; ``async with`` does that."""

    def __init__(self, request_id: str, engine: AsyncLLMEngine) -> None:
        self.request_id = request_id
        self._engine = engine
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.finished = False

    def _put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Stop generating if still running; a no-op after the last output."""
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.abort()


class AsyncLLMEngine:
    """Runs ``LLMEngine.step()`` in a dedicated thread beside an asyncio event loop.

    Create it, then ``start()`` it from inside the running event loop that will
    call ``add_request``; ``shutdown()`` aborts what is left and joins the thread.
    Constant facts about the engine (``tokenizer``, ``max_model_len``, ``config``)
    are read directly; live numbers come from ``stats``, a snapshot the engine
    thread refreshes after each step and each batch of commands."""

    def __init__(
        self, engine: EngineConfig | LLMEngine, on_dead: Callable[[BaseException], None] | None = None
    ) -> None:
        """``engine``: an ``EngineConfig`` to build the engine in the engine thread
        (what a server wants, see the module docstring), or an ``LLMEngine`` built
        elsewhere, which then must not be used by any other thread."""
        self._config = engine if isinstance(engine, EngineConfig) else None
        self.engine: LLMEngine | None = engine if isinstance(engine, LLMEngine) else None
        self.on_dead = on_dead  # called on the event loop if the engine thread fails
        self._commands: queue.SimpleQueue[_Add | _Abort | _Call] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._streams: dict[str, RequestStream] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._loaded = threading.Event()
        self._load_error: BaseException | None = None
        self._setup: Callable[[LLMEngine], None] | None = None
        self._stats: dict[str, float] = {}
        self.dead_error: BaseException | None = None
        # Held while queueing an add and while the thread closes its queue for good,
        # so that no add is queued after the thread's last drain (it would wait forever).
        self._closing = threading.Lock()
        self._closed = False
        # Grammar compilation: llguidance releases the GIL while it builds a lexer.
        self._compile_pool = ThreadPoolExecutor(2, thread_name_prefix="vframe-grammar")

    @classmethod
    def from_config(
        cls, config: EngineConfig, setup: Callable[[LLMEngine], None] | None = None
    ) -> AsyncLLMEngine:
        """Build the engine in the engine thread and wait until it is loaded.
        ``setup`` runs there next, before any request (a server's LoRA adapters);
        what it raises is raised here."""
        engine = cls(config)
        engine._setup = setup
        engine.load()
        return engine

    # ------------------------------------------------------------------ #
    # read-only facts
    # ------------------------------------------------------------------ #

    @property
    def config(self) -> EngineConfig:
        return self._loaded_engine.config

    @property
    def tokenizer(self) -> Any:
        return self._loaded_engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._loaded_engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self._loaded_engine.vocab_size

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return self._loaded_engine.generation_defaults

    @property
    def runner_type(self) -> str:
        """``"generate"`` or ``"pooling"`` (the ``runner`` setting as resolved for the model)."""
        return self._loaded_engine.runner_type

    @property
    def _loaded_engine(self) -> LLMEngine:
        if self.engine is None:
            raise RuntimeError("the engine is not loaded yet: call AsyncLLMEngine.load() first")
        return self.engine

    @property
    def stats(self) -> dict[str, float]:
        """``LLMEngine.get_stats()`` as of the engine thread's last turn."""
        return self._stats

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ #
    # lifecycle
    # ------------------------------------------------------------------ #

    def load(self) -> None:
        """Start the engine thread, which builds the engine when given a config;
        returns once it is ready, or raises what building it raised."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._thread_main, name="vframe-engine", daemon=True)
            self._thread.start()
        self._loaded.wait()
        if self._load_error is not None:
            raise self._load_error

    def start(self) -> None:
        """Serve requests from the running event loop; loads the engine first if needed.
        Call it from inside that loop (a server's startup)."""
        if self._loop is not None:
            raise RuntimeError("AsyncLLMEngine.start() was already called")
        self.load()
        self._loop = asyncio.get_running_loop()

    async def shutdown(self, timeout_s: float = 10.0) -> None:
        """Abort every request still running (their streams raise ``RequestAbortedError``),
        stop the engine thread and wait for it."""
        self._begin_shutdown()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
            self._check_stopped(timeout_s)

    def shutdown_blocking(self, timeout_s: float = 10.0) -> None:
        """``shutdown`` for a caller that cannot await (vLLM's ``AsyncLLM.shutdown()``
        is synchronous): the caller's thread waits for the engine thread."""
        self._begin_shutdown()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._check_stopped(timeout_s)

    def _begin_shutdown(self) -> None:
        self.abort_all("the engine shut down")
        self._compile_pool.shutdown(wait=False, cancel_futures=True)
        self._stop.set()
        self._wake.set()

    def _check_stopped(self, timeout_s: float) -> None:
        if self._thread is not None and self._thread.is_alive():
            logger.warning("the engine thread did not stop within %.0f s", timeout_s)

    # ------------------------------------------------------------------ #
    # requests (event loop side)
    # ------------------------------------------------------------------ #

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Queue a request and wait until the engine accepts it.

        Raises what ``LLMEngine.add_request`` raises for bad input
        (``InvalidRequestError``, ``LoRAAdapterError``), or ``EngineDeadError``."""
        self._check_running()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = RequestStream(request_id, self)
        accepted: asyncio.Future[None] = self._loop.create_future()
        with self._closing:
            if self._closed:
                raise EngineDeadError(f"the engine is not running ({self.dead_error or 'shut down'})")
            self._streams[request_id] = stream
            self._submit(_Add(request_id, prompt, params, priority, lora_request, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            stream.abort()  # the add may already have happened
            self._streams.pop(request_id, None)
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """``LLMEngine.add_lora`` on the engine thread, between two steps (the load
        from disk delays one step, never a request's admission)."""
        await self._call(lambda engine: engine.add_lora(lora_request))

    async def remove_lora(self, lora_int_id: int) -> bool:
        """``LLMEngine.remove_lora``: False if unknown or requests in flight use it."""
        return await self._call(lambda engine: engine.remove_lora(lora_int_id))

    async def list_loras(self) -> list[LoRARequest]:
        return await self._call(lambda engine: engine.list_loras())

    async def encode(self, prompts: list[PromptType], pooling_params: list[PoolingParams]) -> list[Any]:
        """``LLMEngine.encode`` (pooling runner) on the engine thread, between two steps."""
        return await self._call(lambda engine: engine.encode(prompts, pooling_params))

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        self._check_running()
        assert self._loop is not None
        done: asyncio.Future[Any] = self._loop.create_future()
        with self._closing:
            if self._closed:
                raise EngineDeadError(f"the engine is not running ({self.dead_error or 'shut down'})")
            self._submit(_Call(fn, done))
        return await done

    def _check_running(self) -> None:
        if self.dead_error is not None or self._stop.is_set():
            raise EngineDeadError(f"the engine is not running ({self.dead_error or 'shut down'})")
        if self._loop is None:
            raise RuntimeError("call AsyncLLMEngine.start() first")

    async def compile_structured_output(self, params: SamplingParams) -> None:
        """Compile ``params.structured_outputs`` into ``params`` in a worker thread;
        ``add_request`` then skips the compile on the engine thread. Raises what the
        backend raises for a bad constraint (``InvalidRequestError``)."""
        setup = self._loaded_engine.sampling_setup
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._compile_pool, setup.compile_structured_output, params)

    async def generate(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """``add_request`` and iterate its outputs; aborts the request if the caller stops early."""
        stream = await self.add_request(request_id, prompt, params, priority)
        async with stream:
            async for output in stream:
                yield output

    def abort(self, request_id: str) -> None:
        """Abort a request; safe to call for one that already finished."""
        self._streams.pop(request_id, None)
        if self._thread is not None and self._thread.is_alive():
            self._submit(_Abort(request_id))

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight; each stream ends by raising
        ``RequestAbortedError(reason)`` after the outputs it already has.
        Returns how many were aborted."""
        streams = list(self._streams.values())
        for stream in streams:
            stream._put(RequestAbortedError(reason))
            self.abort(stream.request_id)
        return len(streams)

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        self._commands.put(command)
        self._wake.set()

    # ------------------------------------------------------------------ #
    # the engine thread
    # ------------------------------------------------------------------ #

    def _thread_main(self) -> None:
        try:
            if self.engine is None:
                assert self._config is not None
                self.engine = LLMEngine(self._config)
            if self._setup is not None:
                self._setup(self.engine)
            self._stats = dict(self.engine.get_stats())
        except BaseException as e:  # a bad model path, out of memory: load() raises it
            self._load_error = e
            self._closed = True
            return
        finally:
            self._loaded.set()
        self._run(self.engine)

    def _run(self, engine: LLMEngine) -> None:
        try:
            while True:
                self._wake.clear()
                self._drain_commands()
                if not engine.has_unfinished_requests():
                    self._stats = dict(engine.get_stats())
                    if self._stop.is_set():
                        break
                    self._wake.wait()
                    continue
                outputs = engine.step()
                self._stats = dict(engine.get_stats())
                if outputs:
                    self._to_loop(self._deliver, outputs)
        except BaseException as e:  # a bug or resource error inside a step
            logger.exception("the engine thread failed; failing every request in flight")
            self.dead_error = e
            self._to_loop(self._fail_all, EngineDeadError(f"the engine failed: {e!r}"))
        else:
            engine.shutdown()
        finally:
            with self._closing:
                self._closed = True
                self._drain_commands(refuse=True)

    def _drain_commands(self, refuse: bool = False) -> None:
        assert self.engine is not None
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Abort):
                if not refuse:
                    self.engine.abort_request(command.request_id)
                continue
            result: Any = None
            if refuse or self._stop.is_set():
                error: BaseException | None = EngineDeadError("the engine is shutting down")
            else:
                try:
                    if isinstance(command, _Call):
                        result = command.fn(self.engine)
                    else:
                        self.engine.add_request(
                            command.request_id,
                            command.prompt,
                            command.params,
                            priority=command.priority,
                            lora_request=command.lora_request,
                        )
                    error = None
                except Exception as e:  # InvalidRequestError and friends go back to the caller
                    error = e
            future = command.done if isinstance(command, _Call) else command.accepted
            self._to_loop(_resolve, future, error, result)

    def _to_loop(self, fn: Any, *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass

    # ------------------------------------------------------------------ #
    # back on the event loop
    # ------------------------------------------------------------------ #

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:  # aborted by its caller meanwhile
                continue
            stream._put(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream._put(error)
        self._streams.clear()
        if self.on_dead is not None:
            self.on_dead(error)


def _resolve(future: asyncio.Future[Any], error: BaseException | None, result: Any = None) -> None:
    if future.done():  # the caller was cancelled while waiting
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
