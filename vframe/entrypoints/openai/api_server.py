"""The OpenAI-compatible HTTP server: a FastAPI app on uvicorn around an ``AsyncLLMEngine``.

``build_app`` wires routes, errors, API-key checking and metrics around an
engine; ``run_server`` is ``vframe serve``: load the engine, bind, serve until
SIGTERM or SIGINT, then drain in-flight requests (up to ``--shutdown-timeout``),
abort the rest and exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from vframe.core.async_engine import AsyncLLMEngine
from vframe.core.config import EngineConfig
from vframe.core.engine import EMBEDDED_MODEL_NAME, LLMEngine
from vframe.core.worker.model_runner import default_dtype_name, resolve_device
from vframe.entrypoints.openai.chat import create_chat_completion
from vframe.entrypoints.openai.completions import create_completion
from vframe.entrypoints.openai.responses import ResponsesRequest, create_response
from vframe.entrypoints.openai.embeddings import EmbeddingRequest, EmbeddingResponse, create_embedding
from vframe.entrypoints.openai.args import LoRAModule, ServerPolicy
from vframe.entrypoints.openai.errors import APIError, error_response, install_error_handlers
from vframe.entrypoints.openai.guards import (
    OPEN_PATHS,
    APIKeyMiddleware,
    BodyLimitMiddleware,
    HostCheckMiddleware,
    is_loopback,
)
from vframe.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from vframe.entrypoints.openai.models import ServingModels, runtime_lora_updating_allowed
from vframe.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    LoadLoRAAdapterRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    UnloadLoRAAdapterRequest,
)
from vframe.entrypoints.openai.serving import ServingContext
from vframe.entrypoints.openai.tools import tool_dicts
from vframe.errors import ConfigError
from vframe.lora.request import LoRARequest
from vframe.version import __version__

logger = logging.getLogger("vframe.serve")

_ENDPOINTS = frozenset(
    {
        "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/models", "/tokenize",
        "/detokenize",
        "/v1/load_lora_adapter", "/v1/unload_lora_adapter", *OPEN_PATHS,
    }
)
# After --shutdown-timeout every response is ending (its request aborted); uvicorn
# cancels whatever is still open this much later.
_RESPONSE_GRACE_S = 5.0
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)
}


def build_app(
    engine: AsyncLLMEngine,
    served_model_name: str | list[str],
    api_key: str | None = None,
    policy: ServerPolicy | None = None,
    lora_requests: list[LoRARequest] | None = None,
) -> FastAPI:
    """The app; its lifespan starts the engine thread and shuts it down.
    ``policy`` (default: ``ServerPolicy(api_key=api_key)``) sets what clients may send;
    ``lora_requests`` are adapters the engine has already added, served under their names."""
    policy = policy or ServerPolicy(api_key=api_key)
    if policy.chat_template is not None:
        engine.tokenizer.chat_template = policy.chat_template  # before PromptBuilder copies the tokenizer
    metrics = ServerMetrics(lambda: engine.stats)
    models = ServingModels(
        engine, served_model_name, str(engine.config.model.model or EMBEDDED_MODEL_NAME), engine.max_model_len,
        lora_requests,
    )
    ctx = ServingContext(
        engine, models, metrics, policy.trust_request_chat_template, policy.enable_prompt_tokens_details,
        policy.tool_calling,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        in_flight = engine.num_in_flight
        if in_flight:
            logger.warning("aborting %d requests still in flight", in_flight)
        ctx.prompts.shutdown()
        await engine.shutdown()

    app = FastAPI(
        title="vframe",
        version=__version__,
        description="OpenAI-compatible API of the vframe inference engine (see docs/serving.md).",
        lifespan=lifespan,
    )
    app.state.ctx = ctx
    install_error_handlers(app)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERRORS)
    async def completions(request: CompletionRequest, raw_request: Request) -> Response:
        """Complete prompts (texts or token ids); ``stream: true`` answers with server-sent events."""
        return await create_completion(ctx, request, raw_request)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERRORS)
    async def chat_completions(request: ChatCompletionRequest, raw_request: Request) -> Response:
        """Answer a conversation, formatted with the model's chat template."""
        return await create_chat_completion(ctx, request, raw_request)

    @app.post("/v1/responses", responses=_ERRORS)
    async def responses(request: ResponsesRequest, raw_request: Request) -> Response:
        """OpenAI's Responses API, text only: ``input`` and ``instructions`` rendered with the chat template."""
        return await create_response(ctx, request, raw_request)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=_ERRORS)
    async def embeddings(request: EmbeddingRequest) -> EmbeddingResponse:
        """Embed texts or token ids (a pooling model: ``--runner pooling``); ``encoding_format`` float or base64."""
        return await create_embedding(ctx, request)

    @app.get("/v1/models", response_model=ModelList, responses=_ERRORS)
    async def list_models() -> ModelList:
        """The base model, then each LoRA adapter with its base model as ``parent``."""
        return ModelList(data=models.cards())

    @app.get("/v1/models/{model:path}", response_model=ModelCard, responses=_ERRORS)
    async def retrieve_model(model: str) -> ModelCard:
        return models.card(model)

    if runtime_lora_updating_allowed():  # vLLM's rule: otherwise the routes do not exist (404)

        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
        async def load_lora_adapter(request: LoadLoRAAdapterRequest) -> PlainTextResponse:
            """Load a PEFT adapter and serve it as ``model: lora_name``."""
            return PlainTextResponse(await models.load(request.lora_name, request.lora_path))

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses=_ERRORS)
        async def unload_lora_adapter(request: UnloadLoRAAdapterRequest) -> PlainTextResponse:
            """Stop serving an adapter; refused while requests in flight use it."""
            return PlainTextResponse(await models.unload(request.lora_name))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=_ERRORS)
    async def tokenize(request: TokenizeRequest) -> TokenizeResponse:
        """Token ids of a ``prompt``, or of ``messages`` rendered with the chat template."""
        ctx.check_model(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise APIError.bad_request("give exactly one of prompt and messages", param="prompt")
        if request.prompt is not None:
            if request.tools:
                raise APIError.bad_request("tools go with messages (the chat template renders them)", param="tools")
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            [prompt] = await ctx.prompts.texts([request.prompt], add_special_tokens=add_special)
            ids = prompt.token_ids
        else:
            assert request.messages is not None
            tools = tool_dicts(request.tools) if request.tools else None
            prompt = await ctx.prompts.chat(
                request.messages, request.add_generation_prompt, request.continue_final_message,
                request.chat_template_kwargs, request.chat_template, tools,
            )
            ids = prompt.token_ids
            if request.add_special_tokens:
                [prompt] = await ctx.prompts.texts([prompt.text or ""], add_special_tokens=True, field="messages")
                ids = prompt.token_ids
        strs = await ctx.prompts.token_strs(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=ctx.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=_ERRORS)
    async def detokenize(request: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(request.model)
        bad = [t for t in request.tokens if t >= engine.vocab_size]
        if bad:
            raise APIError.bad_request(f"token ids out of range [0, {engine.vocab_size}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=await ctx.prompts.decode(request.tokens))

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 while the engine thread runs; 503 once it has failed or stopped."""
        if not engine.is_running:
            reason = engine.dead_error or "shutting down"
            return error_response(503, f"the engine is not running: {reason}")
        return JSONResponse({})

    # vLLM's /ping (SageMaker's health check), GET and POST: the same answer as /health.
    app.add_api_route("/ping", health, methods=["GET", "POST"], responses={503: {"model": ErrorResponse}})

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition (see docs/serving.md for every series)."""
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    # Added innermost first: a request meets the metrics, then the Host check,
    # the API key and the body limit.
    app.add_middleware(BodyLimitMiddleware, max_bytes=policy.max_request_body_bytes)
    if policy.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=policy.api_key)
    if policy.check_host:
        app.add_middleware(HostCheckMiddleware, allowed_hosts=policy.allowed_hosts)
    app.add_middleware(HTTPMetricsMiddleware, metrics=metrics)  # outermost: counts 401s too
    return app


class HTTPMetricsMiddleware:
    """Counts every HTTP request by endpoint and status code when its response ends."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app = app
        self.counter = metrics.http_requests

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception before the response started

        async def send_and_record(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.counter.labels(_endpoint(scope["path"]), str(status)).inc()


def _endpoint(path: str) -> str:
    if path in _ENDPOINTS:
        return path
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return "other"


# --------------------------------------------------------------------------- #
# vframe serve
# --------------------------------------------------------------------------- #


SERVER_CPU_TOKEN_BUDGET = 2048  # a serving step's token budget on the CPU in float32, unless set
SERVER_CPU_TOKEN_BUDGET_BF16 = 1024  # the same, in bfloat16 on a CPU that multiplies it natively


def apply_server_defaults(config: EngineConfig) -> EngineConfig:
    """What ``vframe serve`` changes in an engine configuration left at its defaults: on
    the CPU, a smaller step budget than the engine's 4096 tokens (vLLM's CPU server makes
    the same choice). Clients that arrive together are then prefilled in smaller chunks
    with the running requests' decode tokens riding along, rather than in long steps that
    stall every stream. The budget trades the new requests' TTFT against the running ones'
    TPOT. float32: ``SERVER_CPU_TOKEN_BUDGET`` (concurrency 16, SmolLM2, 2 threads, AVX2 EPYC:
    TTFT p50 10.2 s -> 4.8 s, TPOT p50 170 -> 146 ms, output 68 -> 82 tok/s against 4096;
    1024 cut TTFT further but lost throughput). bfloat16 on a CPU with native bfloat16
    (``dtype`` bfloat16, or auto there), where a step costs a third as much:
    ``SERVER_CPU_TOKEN_BUDGET_BF16`` (Zen 4, three runs against 2048: TTFT p50 1.2-1.5 s
    against 1.7-2.4, TPOT p50 51-60 against 45-50 ms, output within the runs' noise,
    215-248 against 227-252 tok/s). On a GPU the engine takes vLLM's server defaults
    (``vframe.core.config.gpu_batch_defaults``) once it knows the GPU."""
    config._usage = "server"
    scheduler = config.scheduler
    if (
        scheduler.max_num_batched_tokens is None
        and scheduler.enable_chunked_prefill
        and resolve_device(config.device.device).type == "cpu"
    ):
        dtype = config.model.dtype if config.model.dtype != "auto" else default_dtype_name("cpu")
        bf16 = dtype == "bfloat16"
        scheduler.max_num_batched_tokens = SERVER_CPU_TOKEN_BUDGET_BF16 if bf16 else SERVER_CPU_TOKEN_BUDGET
    return config


def run_server(args: argparse.Namespace, engine_kwargs: dict[str, Any]) -> int:
    """``vframe serve``: returns the process exit status."""
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.model_tag is not None:
        if engine_kwargs.get("model") not in (None, args.model_tag):
            raise ConfigError(
                f"the model is given twice: {args.model_tag!r} and --model {engine_kwargs['model']!r}; give one"
            )
        engine_kwargs["model"] = args.model_tag
    policy = ServerPolicy.from_args(args, loopback=is_loopback(args.host))
    config = apply_server_defaults(EngineConfig.from_sources(config_file=args.config_file, **engine_kwargs))
    if config.model.skip_tokenizer_init:
        raise ConfigError("vframe serve needs the tokenizer (texts, chat templates): drop skip_tokenizer_init")
    served_names = args.served_model_name or [config.model.model or EMBEDDED_MODEL_NAME]
    lora_requests = _lora_requests(args.lora_modules or [], config.lora.enable_lora, served_names[0])
    sock = _bind(args.host, args.port)  # before loading: a taken port fails at once
    host, port = sock.getsockname()[:2]

    def add_loras(llm_engine: LLMEngine) -> None:  # on the engine thread, before any request
        for lora in lora_requests:
            llm_engine.add_lora(lora)

    engine = AsyncLLMEngine.from_config(config, setup=add_loras)
    app = build_app(engine, served_names, policy=policy, lora_requests=lora_requests)
    server = _Server(
        uvicorn.Config(
            app,
            log_level=args.log_level,
            access_log=not args.no_access_log,
            # A backstop only: _Server aborts what still generates at shutdown_timeout,
            # which ends every response; uvicorn cancels whatever is left after this.
            timeout_graceful_shutdown=args.shutdown_timeout + _RESPONSE_GRACE_S,
            timeout_keep_alive=5,
        ),
        engine,
        args.shutdown_timeout,
    )
    # uvicorn handles SIGTERM/SIGINT itself (stop accepting, drain, lifespan shutdown)
    # and then raises the signal again under the handler it found. A no-op handler
    # makes that second delivery harmless, so a graceful shutdown exits with status 0.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)

    def on_engine_dead(error: BaseException) -> None:
        # A server whose engine is gone can only answer 503: exit non-zero so that
        # a supervisor restarts it.
        logger.error("the engine failed (%r); shutting the server down", error)
        server.should_exit = True

    engine.on_dead = on_engine_dead
    url_host = f"[{host}]" if ":" in host else host
    logger.info(
        "serving %s on http://%s:%d/v1 (API key %s)", " / ".join(map(repr, served_names)), url_host, port,
        "required" if policy.api_key else "off",
    )
    server.run(sockets=[sock])
    return 0 if server.started and engine.dead_error is None else 1


def _lora_requests(modules: list[LoRAModule], enable_lora: bool, served_name: str) -> list[LoRARequest]:
    """``--lora-modules`` as requests with ids 1, 2, ..."""
    if modules and not enable_lora:
        raise ConfigError("--lora-modules needs --enable-lora (the engine serves no LoRA adapters without it)")
    names = [m.name for m in modules]
    if clash := sorted({n for n in names if names.count(n) > 1 or n == served_name}):
        raise ConfigError(
            f"--lora-modules: the names {clash} are given twice or are the base model's name; "
            "give each adapter its own name"
        )
    return [LoRARequest(m.name, i, m.path, m.base_model_name) for i, m in enumerate(modules, start=1)]


class _Server(uvicorn.Server):
    """uvicorn's server, which on SIGTERM stops accepting and waits for open
    responses; after ``shutdown_timeout`` seconds vframe aborts the requests
    still generating, so that their clients get what was generated so far with
    ``finish_reason: "abort"`` rather than a cut connection."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        n = self.engine.num_in_flight
        if n:
            logger.info("draining %d request(s) in flight, for up to %.0f s", n, self.shutdown_timeout)
        timer = asyncio.get_running_loop().call_later(self.shutdown_timeout, self._abort_in_flight)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _abort_in_flight(self) -> None:
        n = self.engine.abort_all(f"the server shut down (--shutdown-timeout {self.shutdown_timeout:g} s)")
        if n:
            logger.warning("aborted %d request(s) still in flight after %.0f s", n, self.shutdown_timeout)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --host or --port") from e
    sock.set_inheritable(True)
    return sock
