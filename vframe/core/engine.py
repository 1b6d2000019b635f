"""``LLMEngine``: input processing, the core step loop and output processing.

One step::

    scheduler.schedule() -> executor.execute_model() -> scheduler.update_from_output()
        -> output_processor.process()  (detokenize, stop strings, RequestOutput)

Every part is looked up by its configured name in the plugin registries; the
engine imports no default implementation directly. Plugin objects get the
engine's ``PluginContext`` when built, lifecycle hooks its ``EngineView``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from vframe.core.config import EngineConfig, gpu_batch_defaults
from vframe.core.generation_defaults import load_generation_defaults
from vframe.core.inputs import PROMPT_KEYS, PromptType
from vframe.core.interfaces import Executor, KVCacheManager, ModelRunner, RunnerInfo, Scheduler
from vframe.core.output_processor import OutputProcessor, ParentRequest
from vframe.core.outputs import RequestError, RequestOutput
from vframe.core.plugin_context import EngineView, PluginContext, next_engine_id
from vframe.core.request import Request, RequestStatus
from vframe.core.sample.request_setup import SamplingSetup
from vframe.core.sampling_params import SamplingParams
from vframe.errors import ConfigError, ExecutorDeadError, InvalidRequestError
from vframe.plugins import get_registry
from vframe.plugins.manager import call_lifecycle, load_plugins

if TYPE_CHECKING:
    from vframe.core.pooling_outputs import PoolingOutput, PoolingRequestOutput
    from vframe.core.pooling_params import PoolingParams
    from vframe.core.worker.pooling_runner import PoolingRunner
    from vframe.engine.arg_utils import EngineArgs
    from vframe.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_DEFAULT_TOKEN_BUDGET = 4096
# What EngineView.model says for model=None (the OpenAI server's model id for it too).
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


def _check_registry_names(config: EngineConfig) -> None:
    """Fail on a misspelled or missing implementation name before the model loads
    (``PluginError`` lists the known names, and a skipped plugin that provides it)."""
    names = {
        "model_runner": config.device.model_runner,
        "executor": config.parallel.executor,
        "scheduler": config.scheduler.scheduler,
        "scheduling_policy": config.scheduler.scheduling_policy,
        "kv_cache_manager": config.scheduler.kv_cache_manager,
        "sampler": config.sampler.sampler,
        "attention_backend": config.attention.attention_backend,
        "quantizer": config.quantization.quantization,
        "quant_kernel": config.quantization.quant_kernel,
        "lora_kernel": config.lora.lora_kernel if config.lora.enable_lora else None,
    }
    for kind, name in names.items():
        if name is not None:
            get_registry(kind).get(name)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        load_plugins(config.plugins.plugins)
        _check_registry_names(config)
        t0 = time.perf_counter()

        executor_cls = get_registry("executor").load(config.parallel.executor)
        self.executor: Executor = executor_cls(config)
        try:
            self.runner_info: RunnerInfo = self.executor.load_model()
        except BaseException:
            self.executor.shutdown()
            raise
        self._apply_gpu_batch_defaults()
        # The rank-0 runner when it lives in this process; None when the ranks are workers.
        self.model_runner: ModelRunner | None = self.executor.driver_runner
        self.runner_type = _resolve_runner(config, self.runner_info)
        self._lora_of_request: dict[str, int] = {}  # in-flight request id -> its adapter
        self.tokenizer = None
        if not config.model.skip_tokenizer_init:
            from vframe.models.loader import load_tokenizer

            self.tokenizer = load_tokenizer(self.runner_info.resolved, config.model.tokenizer)
        self.generation_defaults = load_generation_defaults(
            config.model.generation_config, self.runner_info.resolved.model_dir
        )
        self.get_default_sampling_params()  # a bad generation_config.json fails now, not per request
        self.max_model_len = self._resolve_max_model_len()
        self.vocab_size = self.runner_info.vocab_size
        self.eos_token_ids = self._eos_token_ids()
        self.plugin_context = PluginContext(
            engine_config=config,
            model_config=self.runner_info.hf_config,
            tokenizer=self.tokenizer,
            vocab_size=self.vocab_size,
            eos_token_ids=frozenset(self.eos_token_ids),
            device=self.runner_info.device,
            dtype=self.runner_info.dtype,
        )
        self.executor.set_plugin_context(self.plugin_context)
        self.sampling_setup = SamplingSetup(self.plugin_context)

        num_blocks = self.executor.determine_num_kv_blocks()
        self.executor.collective_rpc("initialize_kv_cache", (num_blocks,))
        num_swap_blocks = 0
        if config.scheduler.preemption_mode == "swap":
            num_swap_blocks = self.executor.determine_num_swap_blocks()
            self.executor.collective_rpc("initialize_swap_space", (num_swap_blocks,))
        cache = config.cache
        kv_cls = get_registry("kv_cache_manager").load(config.scheduler.kv_cache_manager)
        self.kv_cache_manager: KVCacheManager = kv_cls(
            num_blocks,
            cache.block_size,
            cache.enable_prefix_caching,
            hash_algo=cache.prefix_caching_hash_algo,
            num_swap_blocks=num_swap_blocks,
        )
        if config.scheduler.max_num_batched_tokens is None:
            budget = _DEFAULT_TOKEN_BUDGET
            if not config.scheduler.enable_chunked_prefill:
                budget = max(budget, self.max_model_len)
            config.scheduler.max_num_batched_tokens = budget
        elif (
            not config.scheduler.enable_chunked_prefill
            and config.scheduler.max_num_batched_tokens < self.max_model_len
        ):
            raise ConfigError(
                f"max_num_batched_tokens={config.scheduler.max_num_batched_tokens} is smaller than "
                f"max_model_len={self.max_model_len} with chunked prefill off: long prompts could "
                "never run; raise it or enable_chunked_prefill=True"
            )
        sched_cls = get_registry("scheduler").load(config.scheduler.scheduler)
        self.scheduler: Scheduler = sched_cls(config, self.kv_cache_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.pooling_runner: PoolingRunner | None = None
        if self.runner_type == "pooling":
            from vframe.core.worker import pooling_runner

            self.pooling_runner = pooling_runner.PoolingRunner(self)
        self._request_counter = itertools.count()
        self.engine_view = EngineView(
            engine_id=next_engine_id(),
            model=config.model.model or EMBEDDED_MODEL_NAME,
            context=self.plugin_context,
            max_model_len=self.max_model_len,
            block_size=cache.block_size,
            num_kv_blocks=num_blocks,
            # Not self.get_stats: the view must not keep the engine alive (a cycle).
            _stats=functools.partial(_merged_stats, self.scheduler, self.kv_cache_manager),
        )
        self.startup_s = time.perf_counter() - t0
        logger.info(
            "vframe ready in %.1fs: %d KV blocks of %d tokens (%d tokens; at most %.1f requests of "
            "max_model_len=%d at once)%s",
            self.startup_s,
            num_blocks,
            cache.block_size,
            num_blocks * cache.block_size,
            num_blocks * cache.block_size / self.max_model_len,
            self.max_model_len,
            f"; swap space of {num_swap_blocks} blocks" if num_swap_blocks else "",
        )
        call_lifecycle("vframe_engine_started", engine=self, engine_view=self.engine_view)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.from_sources(**kwargs))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> LLMEngine:
        """vLLM's constructor: ``LLMEngine.from_engine_args(EngineArgs(model=...))``."""
        return cls(engine_args.create_engine_config())

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams`` with the model's ``generation_config`` defaults (see
        ``vframe/core/generation_defaults.py``); plain defaults when there are none."""
        try:
            return SamplingParams(**self.generation_defaults)
        except InvalidRequestError as e:
            raise ConfigError(f"generation_config={self.config.model.generation_config!r}: {e}") from None

    def _apply_gpu_batch_defaults(self) -> None:
        """On a GPU, vLLM's ``max_num_seqs`` and ``max_num_batched_tokens`` for its size
        where the user set neither (``gpu_batch_defaults``); before the KV cache and the
        CUDA graphs, which are sized by them. Chunked prefill off keeps its own budget rule."""
        info, scheduler = self.runner_info, self.config.scheduler
        if info.device.type != "cuda" or not info.device_memory:
            return
        tokens, seqs = gpu_batch_defaults(info.device_name, info.device_memory, self.config._usage == "server")
        if "max_num_seqs" not in scheduler.model_fields_set:
            scheduler.max_num_seqs = seqs
        if scheduler.max_num_batched_tokens is None and scheduler.enable_chunked_prefill:
            scheduler.max_num_batched_tokens = tokens
        logger.info(
            "GPU batch limits: max_num_seqs=%d, max_num_batched_tokens=%s (%s, %.0f GiB)",
            scheduler.max_num_seqs, scheduler.max_num_batched_tokens, info.device_name, info.device_memory / 2**30,
        )

    def _resolve_max_model_len(self) -> int:
        model_max = self.runner_info.max_position_embeddings
        requested = self.config.model.max_model_len
        if requested is None:
            return model_max
        if requested > model_max:
            raise ConfigError(
                f"max_model_len={requested} is larger than the model's context "
                f"({model_max} positions); use max_model_len <= {model_max}"
            )
        return requested

    def _eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        cfg_eos = getattr(self.runner_info.hf_config, "eos_token_id", None)
        ids.update(cfg_eos if isinstance(cfg_eos, list) else [cfg_eos] if cfg_eos is not None else [])
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    # ------------------------------------------------------------------ #
    # input processing
    # ------------------------------------------------------------------ #

    def tokenize_prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``(text, token ids)`` of a string, a token-id list or a dict with
        ``prompt`` or ``prompt_token_ids`` (its ``cache_salt`` is read by add_request)."""
        if isinstance(prompt, dict):
            unknown = sorted(set(prompt) - PROMPT_KEYS)
            if unknown:
                raise InvalidRequestError(
                    f"prompt keys {unknown} are not supported: vframe serves text-only models; a prompt "
                    f"dict takes {sorted(PROMPT_KEYS)} (vframe.inputs.TextPrompt / TokensPrompt)"
                )
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            if "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InvalidRequestError(
                    f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}"
                )
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return None, list(prompt)
        if not isinstance(prompt, str):
            raise InvalidRequestError(
                f"prompt must be a string, a list of token ids or a dict, got {type(prompt).__name__}"
            )
        if self.tokenizer is None:
            raise InvalidRequestError(
                "text prompts need a tokenizer (skip_tokenizer_init=True): pass prompt_token_ids"
            )
        return prompt, self.tokenizer(prompt).input_ids

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. Bad input raises
        ``InvalidRequestError`` and leaves the engine untouched. With
        ``lora_request`` the request runs with that adapter, loaded now if it
        is not (an adapter that cannot load is the request's error)."""
        if self.pooling_runner is not None:
            raise InvalidRequestError(
                f"model {self.engine_view.model!r} runs with runner='pooling': it embeds (LLM.embed, LLM.encode, "
                "LLM.score, /v1/embeddings) and does not generate; build the engine with runner='generate' "
                "(a decoder model) to generate"
            )
        request_id = str(next(self._request_counter)) if request_id is None else str(request_id)
        if self.output_processor.is_in_use(request_id):
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        params = (sampling_params or SamplingParams()).clone()
        if params.use_beam_search:
            raise InvalidRequestError(
                "use_beam_search=True is served by LLM.generate (or LLM.beam_search), not by the engine"
            )
        if params.output_kind != "final" and params.detokenize and self.tokenizer is None:
            params.detokenize = False
        text, token_ids = self.tokenize_prompt(prompt)
        if params.truncate_prompt_tokens is not None:
            keep = self.max_model_len if params.truncate_prompt_tokens == -1 else params.truncate_prompt_tokens
            token_ids = token_ids[-keep:]
        cache_salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise InvalidRequestError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        max_tokens = self._validate_prompt(token_ids, params)
        self.sampling_setup.prepare(params)
        self.executor.check_request(params)
        policy_name = self.config.scheduler.scheduling_policy
        if priority != 0 and not get_registry("scheduling_policy").load(policy_name).uses_priority:
            raise InvalidRequestError(
                f"priority={priority} needs scheduling_policy='priority' (the built-in policy "
                f"that reads priority) or a plugin policy with uses_priority=True; the scheduling "
                f"policy {policy_name!r} ignores priority"
            )

        if lora_request is not None:
            self.add_lora(lora_request)

        parent = ParentRequest(request_id, text, token_ids, params)
        children: list[Request] = []
        num_children = params.best_of or params.n  # the n best of best_of are returned
        for index in range(num_children):
            child_id = request_id if num_children == 1 else f"{index}_{request_id}"
            if child_id != request_id and self.output_processor.is_in_use(child_id):
                raise InvalidRequestError(
                    f"request_id {request_id!r} with n={num_children} needs the id {child_id!r} for one "
                    "of its completions, and a request in flight uses it; choose another request_id"
                )
            child_params = params
            if num_children > 1:
                child_params = params.clone()
                child_params.n, child_params.best_of = 1, None
                child_params.seed = params.child_seed(index)
                if num_children > params.n and params.logprobs is None:
                    child_params.logprobs = 0  # the ranking needs each token's logprob
            parent.children[child_id] = index
            children.append(
                Request(
                    child_id, token_ids, child_params, arrival_time, priority, max_tokens, cache_salt, lora_request
                )
            )
        self.output_processor.add_request(parent)
        if lora_request is not None:
            self._lora_of_request[request_id] = lora_request.lora_int_id
        for child in children:
            self.scheduler.add_request(child)
        call_lifecycle(
            "vframe_request_added",
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            engine_view=self.engine_view,
        )
        return request_id

    def encode(
        self, prompts: list[PromptType], pooling_params: list[PoolingParams]
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """Pool each prompt with the pooling runner (``runner="pooling"``), in prompt order."""
        if self.pooling_runner is None:
            raise InvalidRequestError(
                f"model {self.engine_view.model!r} runs with runner='generate', which does not embed; build the "
                "engine with runner='pooling' (or task='embed') to use LLM.embed / LLM.encode / LLM.score"
            )
        return self.pooling_runner.encode(prompts, pooling_params)

    # ------------------------------------------------------------------ #
    # LoRA adapters
    # ------------------------------------------------------------------ #

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter into host memory (or mark it recently used), so that
        requests naming it start without waiting for the disk. Raises
        ``InvalidRequestError`` (``LoRAAdapterError``) for an adapter that cannot
        serve this model, ``ConfigError`` when LoRA is not enabled."""
        from vframe.lora.request import LoRARequest

        if not self.config.lora.enable_lora:
            raise ConfigError("this engine serves no LoRA adapters: start it with enable_lora=True")
        if not isinstance(lora_request, LoRARequest):
            raise InvalidRequestError(
                f"lora_request must be a vframe.lora.request.LoRARequest, got {type(lora_request).__name__}"
            )
        self.executor.collective_rpc("add_lora", (lora_request,))

    def remove_lora(self, lora_int_id: int) -> bool:
        """Forget an adapter; ``False`` if it was not loaded or requests in
        flight still use it."""
        if lora_int_id in self._lora_of_request.values():
            return False
        return self.executor.collective_rpc("remove_lora", (lora_int_id,))[0]

    def list_loras(self) -> list[LoRARequest]:
        """The adapters added so far and not removed."""
        return self.executor.collective_rpc("list_loras")[0] if self.config.lora.enable_lora else []

    def _validate_prompt(self, token_ids: list[int], params: SamplingParams) -> int:
        """Checks the prompt and returns the request's resolved ``max_tokens``."""
        if not token_ids:
            raise InvalidRequestError("the decoder prompt cannot be empty: give at least one token")
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]} is out of vocabulary: prompt token ids out of range [0, {self.vocab_size}): "
                f"{bad[:5]}"
            )
        room = self.max_model_len - len(token_ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt ({len(token_ids)} tokens) is too long: max_model_len is "
                f"{self.max_model_len}, which leaves no room to generate"
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        needed = len(token_ids) + max_tokens
        if not self.kv_cache_manager.can_ever_fit(needed):
            capacity = self.kv_cache_manager.num_blocks * self.kv_cache_manager.block_size
            raise InvalidRequestError(
                f"the request needs up to {needed} tokens of KV cache but the cache holds "
                f"{capacity}; lower max_tokens or raise kv_cache_memory_bytes"
            )
        return max_tokens

    # ------------------------------------------------------------------ #
    # the step loop
    # ------------------------------------------------------------------ #

    def step(self) -> list[RequestOutput]:
        """One engine step. A step that raises fails the requests that ran in it
        (``finish_reason="error"``), and only those: nothing they computed becomes
        a prefix-cache hit, and every other request goes on in the next step."""
        t0 = time.perf_counter()
        sched_out = self.scheduler.schedule()
        if sched_out.is_empty and self.scheduler.has_unfinished_requests():
            raise RuntimeError(
                f"the scheduler made no progress with {self.scheduler.get_num_unfinished_requests()} "
                "unfinished requests"
            )
        prompt_logprobs = None
        try:
            runner_out = self.executor.execute_model(sched_out)
        except ExecutorDeadError:
            raise  # no rank can run another step: the caller (LLM, the server) fails everything
        except Exception as e:  # noqa: BLE001 - one bad step must not take the engine down
            logger.exception(
                "a step of %d requests failed; failing those requests", len(sched_out.num_scheduled_tokens)
            )
            error = RequestError(f"the engine step running this request failed: {type(e).__name__}: {e}")
            core_outputs = self.scheduler.fail_requests(dict.fromkeys(sched_out.num_scheduled_tokens, error))
        else:
            core_outputs = self.scheduler.update_from_output(sched_out, runner_out)
            prompt_logprobs = runner_out.prompt_logprobs
        outputs, stopped = self.output_processor.process(core_outputs, prompt_logprobs)
        if stopped:
            self.scheduler.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        for out in outputs:
            if out.finished:
                self._report_finished(out)
        call_lifecycle(
            "vframe_engine_step",
            engine=self,
            num_scheduled_tokens=sched_out.total_num_scheduled_tokens,
            elapsed_s=time.perf_counter() - t0,
            engine_view=self.engine_view,
        )
        return outputs

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests by id; unknown, finished and repeated ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(dict.fromkeys(request_ids))
        child_ids = [
            child
            for rid in ids
            if (parent := self.output_processor.parents.get(rid)) is not None
            for child in parent.children
        ]
        self.scheduler.abort_requests(child_ids)
        outputs = self.output_processor.abort(ids)
        for out in outputs:
            self._report_finished(out)
        return outputs

    def _report_finished(self, out: RequestOutput) -> None:
        self._lora_of_request.pop(out.request_id, None)
        reason = ",".join(sorted({c.finish_reason or "abort" for c in out.outputs}))
        call_lifecycle(
            "vframe_request_finished",
            request_id=out.request_id,
            finish_reason=reason,
            num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=sum(len(c.token_ids) for c in out.outputs),
            engine_view=self.engine_view,
        )

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self.output_processor.parents)

    def get_stats(self) -> dict[str, float]:
        return _merged_stats(self.scheduler, self.kv_cache_manager)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def shutdown(self) -> None:
        call_lifecycle("vframe_engine_shutdown", engine=self, engine_view=self.engine_view)
        self.executor.shutdown()


def _resolve_runner(config: EngineConfig, info: RunnerInfo) -> str:
    from vframe.core.worker.pooling_runner import resolve_runner

    architectures = getattr(info.hf_config, "architectures", None) or ["the model"]
    return resolve_runner(config.model.runner, config.model.task, info, architectures[0])


def _merged_stats(scheduler: Scheduler, kv_cache_manager: KVCacheManager) -> dict[str, float]:
    """The scheduler's counters and the KV cache manager's (the scheduler's win a clash)."""
    return {**kv_cache_manager.get_stats(), **scheduler.get_stats()}
