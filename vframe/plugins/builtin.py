"""vframe's own implementations, registered through the same hooks as any plugin.

Targets are strings so that importing vframe imports none of these modules.
"""

from __future__ import annotations

from vframe.plugins.hookspecs import RegisterFn, hookimpl
from vframe.version import PLUGIN_API_VERSION

VFRAME_PLUGIN_API = PLUGIN_API_VERSION


@hookimpl
def vframe_register_models(register: RegisterFn) -> None:
    register("LlamaForCausalLM", "vframe.models.llama:LlamaForCausalLM")
    register("MistralForCausalLM", "vframe.models.llama:LlamaForCausalLM")
    register("MixtralForCausalLM", "vframe.models.mixtral:MixtralForCausalLM")
    register("DeepseekV2ForCausalLM", "vframe.models.deepseek:DeepseekV2ForCausalLM")
    register("DeepseekV3ForCausalLM", "vframe.models.deepseek:DeepseekV3ForCausalLM")
    register("Qwen2ForCausalLM", "vframe.models.qwen:Qwen2ForCausalLM")
    register("Qwen3ForCausalLM", "vframe.models.qwen:Qwen3ForCausalLM")
    register("BertModel", "vframe.models.bert:BertModel")


@hookimpl
def vframe_register_attention_backends(register: RegisterFn) -> None:
    register("torch", "vframe.backends.torch_attn:TorchAttentionBackend")
    register("triton", "vframe.backends.triton.backend:TritonAttentionBackend")
    register("flash_attn", "vframe.backends.flash_attn.backend:FlashAttentionBackend")
    register("flex", "vframe.backends.flex.backend:FlexAttentionBackend")
    register("cpu_paged", "vframe.backends.cpu_paged.backend:CpuPagedAttentionBackend")


@hookimpl
def vframe_register_schedulers(register: RegisterFn) -> None:
    register("default", "vframe.core.sched.scheduler:DefaultScheduler")


@hookimpl
def vframe_register_scheduling_policies(register: RegisterFn) -> None:
    register("fcfs", "vframe.core.sched.policies:FirstComeFirstServed")
    register("priority", "vframe.core.sched.policies:PriorityPolicy")


@hookimpl
def vframe_register_kv_cache_managers(register: RegisterFn) -> None:
    register("default", "vframe.core.sched.kv_cache_manager:PagedKVCacheManager")


@hookimpl
def vframe_register_samplers(register: RegisterFn) -> None:
    register("default", "vframe.core.sample.sampler:DefaultSampler")


@hookimpl
def vframe_register_model_runners(register: RegisterFn) -> None:
    register("default", "vframe.core.worker.model_runner:TorchModelRunner")


@hookimpl
def vframe_register_structured_output_backends(register: RegisterFn) -> None:
    register("guidance", "vframe.structured.guidance:GuidanceBackend")


@hookimpl
def vframe_register_quantizers(register: RegisterFn) -> None:
    register("gptq", "vframe.quant.gptq:GPTQConfig")
    register("awq", "vframe.quant.awq:AWQConfig")
    register("fp8", "vframe.quant.fp8:Fp8Config")
    register("compressed-tensors", "vframe.quant.compressed_tensors:CompressedTensorsConfig")
    register("modelopt", "vframe.quant.modelopt:ModelOptConfig")
    register("modelopt_fp4", "vframe.quant.modelopt:ModelOptFp4Config")  # vLLM's names for two of its algorithms
    register("modelopt_mxfp8", "vframe.quant.modelopt:ModelOptMxFp8Config")
    register("gguf", "vframe.quant.gguf:GGUFConfig")
    register("bitsandbytes", "vframe.quant.bitsandbytes:BitsAndBytesConfig")


@hookimpl
def vframe_register_quant_kernels(register: RegisterFn) -> None:
    register("int4_pairs", "vframe.quant.kernels.builtin:Int4PairsKernel")
    register("int8_pairs", "vframe.quant.kernels.builtin:Int8PairsKernel")
    register("int6_pairs", "vframe.quant.kernels.builtin:Int6PairsKernel")
    register("fp4_pairs", "vframe.quant.kernels.builtin:Fp4PairsKernel")
    register("lut4_pairs", "vframe.quant.kernels.builtin:Lut4PairsKernel")
    register("fp8_pairs", "vframe.quant.kernels.builtin:Fp8PairsKernel")
    register("int4_cpu", "vframe.quant.kernels.builtin:TorchInt4CpuKernel")
    register("woq_cpu", "vframe.quant.kernels.builtin:WoqCpuKernel")
    register("woq_cpu_a8", "vframe.quant.kernels.builtin:WoqCpuA8Kernel")
    register("fp8_cpu", "vframe.quant.kernels.builtin:Fp8CpuKernel")
    register("fp4_cpu", "vframe.quant.kernels.builtin:Fp4CpuKernel")
    register("lut4_cpu", "vframe.quant.kernels.builtin:Lut4CpuKernel")
    register("int8_dynamic", "vframe.quant.kernels.builtin:Int8DynamicKernel")
    register("triton", "vframe.quant.kernels.gpu:TritonKernel")
    register("reference", "vframe.quant.kernels.builtin:ReferenceKernel")


@hookimpl
def vframe_register_lora_kernels(register: RegisterFn) -> None:
    register("torch", "vframe.lora.ops:add_lora")


@hookimpl
def vframe_register_tool_parsers(register: RegisterFn) -> None:
    register("hermes", "vframe.entrypoints.openai.tool_parsers:HermesToolParser")
    register("llama3_json", "vframe.entrypoints.openai.tool_parsers:Llama3JsonToolParser")


@hookimpl
def vframe_register_executors(register: RegisterFn) -> None:
    register("uni", "vframe.executor.uniproc:UniProcExecutor")
    register("mp", "vframe.executor.multiproc:MultiprocExecutor")
    register("ray", "vframe.executor.ray_executor:RayExecutor")
