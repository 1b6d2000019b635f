"""Every hook a vframe plugin can implement, in one place.

Two families:

* **Registration hooks** (``vframe_register_*``) run once when plugins load, and
  again whenever a plugin is added or removed at run time. Each receives a
  ``register`` callback; call it once per implementation the plugin provides::

      @vframe.hookimpl
      def vframe_register_schedulers(register):
          register("lottery", "my_pkg.sched:LotteryScheduler")

  The target is a lazy ``"module:Class"`` string, imported only when
  configuration names the entry. (An already-imported class is accepted too,
  which is handy for throwaway plugins in tests.) A name that another plugin
  already registered is refused unless the call passes ``override=True``.

* **Lifecycle hooks** are notifications for cross-cutting work (metrics,
  tracing, profiling). They return nothing and cannot change what the engine
  does. Each receives ``engine_view`` (``vframe.core.plugin_context.EngineView``,
  plugin API 1.2), the stable read-only view of the engine that raised it;
  ``engine`` is the ``LLMEngine`` itself, whose attributes are not a stable API. An exception raised by one is logged, that implementation is disabled
  and the engine goes on. ``wrapper=True`` / ``hookwrapper=True`` are not
  supported: the engine calls each implementation directly so that one
  plugin's failure never reaches another.

A hook implementation may accept any subset of the arguments listed here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import pluggy

if TYPE_CHECKING:
    from vframe.core.engine import LLMEngine
    from vframe.core.plugin_context import EngineView
    from vframe.core.sampling_params import SamplingParams

hookspec = pluggy.HookspecMarker("vframe")
hookimpl = pluggy.HookimplMarker("vframe")


class RegisterFn(Protocol):
    """The callback a registration hook receives.

    ``name``: what configuration uses to select the entry (``scheduler="lottery"``);
    for models, the Hugging Face architecture name (``"LlamaForCausalLM"``).
    ``target``: ``"package.module:ClassName"``, imported on first use, or a class.
    ``override``: replace an entry of the same name registered by another plugin
    (the built-ins included); without it such a registration is an error.
    """

    def __call__(self, name: str, target: str | type, *, override: bool = False) -> None: ...


# --------------------------------------------------------------------------- #
# Registration hooks
# --------------------------------------------------------------------------- #


@hookspec
def vframe_register_models(register: RegisterFn) -> None:
    """Register model classes by the architecture name found in a Hugging Face
    ``config.json`` (``"architectures": ["LlamaForCausalLM"]``) or GGUF metadata.

    The class is a ``torch.nn.Module`` with the methods of
    ``vframe.core.interfaces.ModelArchitecture``."""


@hookspec
def vframe_register_attention_backends(register: RegisterFn) -> None:
    """Register ``vframe.core.interfaces.AttentionBackend`` subclasses,
    selected by the ``attention_backend`` setting."""


@hookspec
def vframe_register_schedulers(register: RegisterFn) -> None:
    """Register ``vframe.core.interfaces.Scheduler`` subclasses, selected by
    the ``scheduler`` setting."""


@hookspec
def vframe_register_scheduling_policies(register: RegisterFn) -> None:
    """Register ``vframe.core.interfaces.SchedulingPolicy`` subclasses, selected
    by the ``scheduling_policy`` setting (built-ins: ``fcfs``, ``priority``).
    Plugin API 1.2."""


@hookspec
def vframe_register_kv_cache_managers(register: RegisterFn) -> None:
    """Register ``vframe.core.interfaces.KVCacheManager`` subclasses, selected
    by the ``kv_cache_manager`` setting."""


@hookspec
def vframe_register_samplers(register: RegisterFn) -> None:
    """Register ``vframe.core.interfaces.Sampler`` subclasses, selected by the
    ``sampler`` setting."""


@hookspec
def vframe_register_model_runners(register: RegisterFn) -> None:
    """Register ``vframe.core.interfaces.ModelRunner`` subclasses, selected by
    the ``model_runner`` setting."""


@hookspec
def vframe_register_quantizers(register: RegisterFn) -> None:
    """Register quantization methods, selected by the ``quantization`` setting."""


@hookspec
def vframe_register_logits_processors(register: RegisterFn) -> None:
    """Register ``vframe.core.interfaces.LogitsProcessor`` subclasses that
    requests can ask for by name (``SamplingParams(logits_processors=["name"])``)."""


@hookspec
def vframe_register_structured_output_backends(register: RegisterFn) -> None:
    """Register ``vframe.core.sample.structured.StructuredOutputBackend`` subclasses
    (grammar libraries), selected per request by ``StructuredOutputsParams.backend``
    (default ``"guidance"``)."""


@hookspec
def vframe_register_lora_kernels(register: RegisterFn) -> None:
    """Register LoRA kernels: functions typed against ``vframe.lora.ops.LoRAKernel``
    (``"my_pkg.kernels:sgmv_add_lora"``), checked with
    ``vframe.testing.check_lora_kernel`` (built-in: ``torch``, ``vframe.lora.ops:add_lora``)."""


@hookspec
def vframe_register_tool_parsers(register: RegisterFn) -> None:
    """Register ``vframe.entrypoints.openai.tool_parsers.ToolParser`` subclasses, which
    read the tool calls a model wrote in its reply; selected by ``vframe serve
    --tool-call-parser NAME`` (built-in: ``hermes``, ``llama3_json``). Since plugin API 1.5."""


@hookspec
def vframe_register_executors(register: RegisterFn) -> None:
    """Register ``vframe.core.interfaces.Executor`` subclasses, which run the model
    runner of every tensor-parallel rank; selected by ``distributed_executor_backend``
    (built-in: ``uni``, ``mp``, ``ray``). Since plugin API 1.7."""


# --------------------------------------------------------------------------- #
# Lifecycle hooks
# --------------------------------------------------------------------------- #


@hookspec
def vframe_engine_started(engine: LLMEngine, engine_view: EngineView) -> None:
    """Called once, after the engine has loaded the model and allocated the
    KV cache, before the first request is accepted."""


@hookspec
def vframe_request_added(
    request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, engine_view: EngineView
) -> None:
    """Called when a request enters the engine, after validation and
    tokenization, before it is scheduled. Treat the arguments as read-only."""


@hookspec
def vframe_request_finished(
    request_id: str,
    finish_reason: str,
    num_prompt_tokens: int,
    num_output_tokens: int,
    engine_view: EngineView,
) -> None:
    """Called once per request when it stops: ``finish_reason`` is ``"stop"``,
    ``"length"``, ``"abort"`` or ``"error"``; for a request with ``n > 1`` completions, their
    distinct reasons sorted and joined by commas (``"length,stop"``).
    ``num_output_tokens`` counts the tokens of all its completions."""


@hookspec
def vframe_engine_step(
    engine: LLMEngine, num_scheduled_tokens: int, elapsed_s: float, engine_view: EngineView
) -> None:
    """Called after every engine step. ``num_scheduled_tokens``: tokens the
    step ran over all requests (prefill chunks plus decodes); ``elapsed_s``:
    wall time of the step, from scheduling to processed outputs."""


@hookspec
def vframe_engine_shutdown(engine: LLMEngine, engine_view: EngineView) -> None:
    """Called once when the engine shuts down; release files and connections here."""


@hookspec
def vframe_register_quant_kernels(register: RegisterFn) -> None:
    """Register ``vframe.quant.kernels.QuantLinearKernel`` subclasses: the matmuls
    of the integer quantization formats (GPTQ, AWQ, compressed-tensors int4 / int8), of
    FP8 (1.10) and NVFP4 (1.11) weights, chosen per layer by ``priority`` and
    ``can_implement``, or named by the ``quant_kernel`` setting (built-in: ``int4_cpu``,
    ``triton``, ``woq_cpu``, ``woq_cpu_a8``, ``fp8_cpu``, ``fp4_cpu``, ``int8_dynamic``, ``int4_pairs``,
    ``int8_pairs``, ``fp4_pairs``, ``reference``);
    ``check_available`` (1.17) says what ``vframe plugins`` shows. Checked with
    ``vframe.testing.check_quant_kernel``. Since plugin API 1.8."""


# hook name -> registry kind it fills
REGISTRATION_HOOKS: dict[str, str] = {
    "vframe_register_models": "model",
    "vframe_register_attention_backends": "attention_backend",
    "vframe_register_schedulers": "scheduler",
    "vframe_register_scheduling_policies": "scheduling_policy",
    "vframe_register_kv_cache_managers": "kv_cache_manager",
    "vframe_register_samplers": "sampler",
    "vframe_register_model_runners": "model_runner",
    "vframe_register_quantizers": "quantizer",
    "vframe_register_logits_processors": "logits_processor",
    "vframe_register_structured_output_backends": "structured_output",
    "vframe_register_lora_kernels": "lora_kernel",
    "vframe_register_tool_parsers": "tool_parser",
    "vframe_register_executors": "executor",
    "vframe_register_quant_kernels": "quant_kernel",
}

LIFECYCLE_HOOKS: tuple[str, ...] = (
    "vframe_engine_started",
    "vframe_request_added",
    "vframe_request_finished",
    "vframe_engine_step",
    "vframe_engine_shutdown",
)
