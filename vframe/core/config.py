"""Engine configuration: one pydantic ``EngineConfig`` with sections.

Settings are named as vLLM names them, so ``LLM(max_num_seqs=8, block_size=16)``
means the same on both. A flat setting name maps to exactly one section field
(``FLAT_FIELDS``). Sources, highest precedence first:

1. keyword arguments (``LLM(...)``) and CLI flags
2. ``VFRAME_<FIELD>`` environment variables (``VFRAME_MAX_NUM_SEQS=8``)
3. a YAML or TOML file (``config_file=`` / ``--config``), flat or by section
4. the defaults below

A setting given as ``None`` is not set: the next source, or the default, decides
(``LLM(**vars(args))`` over argparse flags left out works as in vLLM).
Invalid values fail at construction with the field, the value and what is allowed.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from vframe.errors import ConfigError

_STRICT = ConfigDict(extra="forbid", validate_assignment=True)
# vLLM's dtype names (and torch's, without the "torch." prefix) -> vframe's.
_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


class ModelSection(BaseModel):
    model_config = _STRICT | ConfigDict(protected_namespaces=())

    model: str | None = Field(None, description="GGUF file or Hugging Face directory; None = embedded SmolLM2")
    tokenizer: str | None = Field(None, description="tokenizer directory; defaults to the model's")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto",
        description="weights and activations; auto = the model's (bfloat16 for GGUF), but float32 on a CPU "
        "without native bfloat16 (no AVX-512 or AMX); vLLM's aliases half (float16) and float (float32) and "
        "torch dtypes are accepted",
    )
    max_model_len: int | None = Field(None, ge=1, description="context length; defaults to the model's")
    seed: int = Field(
        0, description="seed of the engine's random generator (unseeded sampling), Python's random and numpy"
    )
    skip_tokenizer_init: bool = Field(False, description="no tokenizer: prompts must be token ids")
    max_logprobs: int = Field(
        20, ge=-1, description="largest logprobs / prompt_logprobs a request may ask for; -1 = the vocabulary size"
    )
    trust_remote_code: bool = Field(
        False, description="accepted for vLLM compatibility; vframe never runs code shipped with a model"
    )
    tokenizer_mode: str = Field(
        "auto", description="auto, slow or hf (all load the same fast tokenizer, which tokenizes as the slow one)"
    )
    generation_config: str = Field(
        "auto",
        description="where default sampling parameters (LLM.generate without any, server fields left out) "
        "come from: auto = the model's generation_config.json, vllm = SamplingParams(), or a directory "
        "holding a generation_config.json",
    )
    revision: str | None = Field(None, description="vLLM's Hub revision; only None (vframe reads local files)")
    code_revision: str | None = Field(None, description="vLLM's Hub revision; only None (vframe reads local files)")
    tokenizer_revision: str | None = Field(
        None, description="vLLM's Hub revision; only None (vframe reads local files)"
    )
    config_format: str = Field("auto", description="auto or hf (config.json); vLLM's mistral format is refused")
    load_format: str = Field(
        "auto", description="auto, safetensors or gguf: what the model path must hold (auto = either)"
    )
    hf_overrides: dict[str, Any] | None = Field(
        None,
        description="fields replacing those of the model's config.json (a dict merges into an object "
        "field such as rope_scaling), checked as the file's",
    )
    enable_prompt_embeds: bool = Field(False, description="only False (prompts are text or token ids)")
    allowed_local_media_path: str = Field(
        "", description="accepted, no effect: vframe serves text-only models and reads no media"
    )
    mm_processor_kwargs: dict[str, Any] | None = Field(
        None, description="only None or {}: vframe serves text-only models"
    )
    runner: Literal["auto", "generate", "pooling"] = Field(
        "auto",
        description="generate (text) or pooling (embeddings: LLM.embed / encode / score, /v1/embeddings); "
        "auto = pooling for an encoder-only model (BERT), else generate",
    )
    task: str | None = Field(
        None, description="vLLM's older spelling of runner: generate, or embed / embedding / encode (= pooling)"
    )
    pooler_config: dict[str, Any] | None = Field(
        None,
        description="the pooling runner's pooler: {'pooling_type': MEAN | CLS | LAST, 'normalize': bool}; "
        "default: the checkpoint's sentence-transformers config, else the model's (LAST, normalized, for decoders)",
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, v: Any) -> Any:
        if isinstance(v, str) or type(v).__name__ == "dtype":  # a torch.dtype, without importing torch
            name = str(v).removeprefix("torch.")
            return _DTYPE_ALIASES.get(name, name)
        return v

    @field_validator("seed", mode="before")
    @classmethod
    def _none_seed_is_zero(cls, v: Any) -> Any:
        return 0 if v is None else v  # vLLM v1 reads seed=None as 0

    @field_validator("pooler_config", mode="before")
    @classmethod
    def _pooler_config_json(cls, v: Any) -> Any:
        if not isinstance(v, str):
            return v
        try:  # --pooler-config '{"pooling_type": "MEAN"}'
            return json.loads(v)
        except ValueError as e:
            raise ValueError(f"pooler_config={v!r} is not a JSON object ({e})") from None

    @field_validator("tokenizer_mode")
    @classmethod
    def _tokenizer_mode(cls, v: str) -> str:
        if v not in ("auto", "slow", "hf"):
            raise ValueError(
                f"tokenizer_mode={v!r} is not supported: vframe loads Hugging Face tokenizers only; "
                "use 'auto', 'slow' or 'hf'"
            )
        return v

    @field_validator("revision", "code_revision", "tokenizer_revision")
    @classmethod
    def _no_revision(cls, v: str | None, info: ValidationInfo) -> str | None:
        if v is not None:
            raise ValueError(
                f"{info.field_name}={v!r} is not supported: vframe reads local files only and never "
                "downloads from the Hugging Face Hub; check out that revision locally and pass its directory"
            )
        return v

    @field_validator("config_format")
    @classmethod
    def _config_format(cls, v: str) -> str:
        if v not in ("auto", "hf"):
            raise ValueError(f"config_format={v!r} is not supported: vframe reads config.json; use 'auto' or 'hf'")
        return v

    @field_validator("load_format")
    @classmethod
    def _load_format(cls, v: str) -> str:
        if v not in ("auto", "safetensors", "gguf"):
            raise ValueError(
                f"load_format={v!r} is not supported: vframe reads safetensors and GGUF files; "
                "use 'auto', 'safetensors' or 'gguf'"
            )
        return v

    @field_validator("mm_processor_kwargs")
    @classmethod
    def _no_mm_processor(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v:
            raise ValueError(
                f"mm_processor_kwargs={v!r} is not supported: vframe serves text-only models, which have "
                "no multimodal processor"
            )
        return v

    @field_validator("enable_prompt_embeds")
    @classmethod
    def _no_prompt_embeds(cls, v: bool) -> bool:
        if v:
            raise ValueError("enable_prompt_embeds=True is not supported: prompts are text or token ids")
        return v


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
"""vLLM's ``kv_cache_dtype`` values vframe serves (``vframe.core.kv_cache_spec.kv_cache_torch_dtype``)."""


class CacheSection(BaseModel):
    model_config = _STRICT

    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV cache block (a power of two)")
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="KV cache budget in bytes")
    gpu_memory_utilization: float = Field(
        0.9, gt=0.0, le=1.0, description="on CUDA: fraction of free GPU memory for the KV cache"
    )
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prompt prefixes")
    kv_cache_dtype: str = Field(
        "auto",
        description="auto (the model's dtype), fp8 (= fp8_e4m3), fp8_e4m3 or fp8_e5m2: K/V stored as float8, "
        "with the checkpoint's calibrated k_scale / v_scale (else 1.0), on the torch, triton (NVIDIA GPUs) and "
        "cpu_paged attention backends",
    )
    calculate_kv_scales: bool = Field(
        False,
        description="with a float8 KV cache: each layer's k_scale / v_scale computed at start-up from one batch of "
        "random tokens (max |K| / 200, max |V| / 100, as vLLM's option of that name), in place of the checkpoint's",
    )
    cpu_offload_gb: float = Field(0.0, ge=0.0, description="only 0: weights stay on the device")
    prefix_caching_hash_algo: Literal["builtin", "sha256"] = Field(
        "builtin", description="block hash: Python's builtin (fast) or sha256 (collision-resistant)"
    )
    swap_space: float = Field(4.0, ge=0.0, description="GiB of CPU swap space for swap preemption")
    num_gpu_blocks_override: int | None = Field(None, ge=1, description="exact number of KV blocks")
    debug_verify_kv_tokens: bool = Field(
        False,
        description="debug: remember the token id written to every KV slot and check each step that "
        "every slot a request reads holds that request's token (catches prefix-cache poisoning; slow)",
    )

    @field_validator("block_size")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"block_size must be a power of two, got {v}")
        return v

    @field_validator("kv_cache_dtype")
    @classmethod
    def _kv_cache_dtype(cls, v: str) -> str:
        if v not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype={v!r} is not supported; use one of "
                + ", ".join(map(repr, KV_CACHE_DTYPES))
                + " ('auto' caches the model's dtype, the fp8 ones float8 K/V)"
            )
        return v

    @model_validator(mode="after")
    def _calculated_scales_need_float8(self) -> CacheSection:
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise ValueError(
                "calculate_kv_scales=True computes the scales of a float8 KV cache; set kv_cache_dtype='fp8' (or "
                "'fp8_e5m2'), or leave calculate_kv_scales off"
            )
        return self

    @field_validator("cpu_offload_gb")
    @classmethod
    def _no_offload(cls, v: float) -> float:
        if v != 0:
            raise ValueError(f"cpu_offload_gb={v:g} is not supported: weights stay on the device; use 0")
        return v


class SchedulerSection(BaseModel):
    model_config = _STRICT

    scheduler: str = Field("default", description="scheduler registry name")
    kv_cache_manager: str = Field("default", description="KV cache manager registry name")
    max_num_seqs: int = Field(
        256, ge=1, description="most requests running in one step (on a GPU left unset: vLLM's, 1024 on "
        "70 GiB and more except A100s, else 256)"
    )
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="token budget of one step (default 4096; for `vframe serve` on the CPU 2048 in "
        "float32, 1024 in bfloat16 on a CPU with native bfloat16; on a GPU vLLM's: 16384 offline and 8192 for "
        "the server on 70 GiB and more except A100s, else 8192 and 2048; at least max_model_len without chunking)"
    )
    enable_chunked_prefill: bool = Field(True, description="split long prompts across steps")
    long_prefill_token_threshold: int = Field(
        0, ge=0, description="most tokens one prompt may take in a step (0 = no cap)"
    )
    preemption_mode: Literal["recompute", "swap"] = Field(
        "recompute", description="what happens to a request preempted when blocks run out"
    )
    scheduling_policy: str = Field(
        "fcfs",
        description="scheduling policy registry name: fcfs, priority (lower value first, "
        "ties by arrival), or a plugin's",
    )


class ParallelSection(BaseModel):
    model_config = _STRICT

    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks per model: heads, MLP columns and vocabulary split over that many workers"
    )
    pipeline_parallel_size: int = Field(1, ge=1, description="pipeline stages (only 1; docs/distributed.md)")
    distributed_executor_backend: str | None = Field(
        None,
        description="executor registry name: uni (in-process, one rank), mp (a process per rank on this "
        "machine), ray (Ray actors, across machines), or a plugin's; None = uni at one rank, else mp",
    )
    disable_custom_all_reduce: bool = Field(
        False, description="accepted, no effect: all-reduce is torch.distributed's (gloo, NCCL)"
    )

    @property
    def executor(self) -> str:
        """The executor registry name in effect."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"


class DeviceSection(BaseModel):
    model_config = _STRICT

    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when visible, else cpu")
    model_runner: str = Field("default", description="model runner registry name")
    num_threads: int | None = Field(None, ge=1, description="torch intra-op threads on CPU")
    enforce_eager: bool = Field(
        False,
        description="run every step eagerly; off: on CUDA, decode steps replay CUDA graphs captured at start-up "
        "(models and attention backends that declare supports_cuda_graphs), and the flex attention backend "
        "runs flex_attention compiled by torch.compile",
    )
    compilation_config: int | dict[str, Any] | None = Field(
        None,
        description="vLLM's compilation settings that vframe has: level / mode 0 (vframe compiles no model "
        "with torch.compile), cudagraph_mode NONE or FULL_DECODE_ONLY (what vframe captures), "
        "cudagraph_capture_sizes (decode batch sizes to capture), max_cudagraph_capture_size",
    )

    @field_validator("compilation_config")
    @classmethod
    def _known_compilation(cls, v: int | dict[str, Any] | None) -> int | dict[str, Any] | None:
        # vLLM's level / mode 0 means "no torch.compile": the only one vframe has.
        if isinstance(v, int) or v is None:
            if v:
                raise ValueError(
                    f"compilation_config={v!r} is not supported: vframe compiles no model with torch.compile; "
                    "use None, {}, 0 or {'level': 0}"
                )
            return v
        unknown = set(v) - set(_COMPILATION_KEYS)
        if unknown:
            raise ValueError(
                f"compilation_config keys {sorted(unknown)} are not supported; vframe knows "
                + ", ".join(_COMPILATION_KEYS)
            )
        if v.get("level") or v.get("mode"):
            raise ValueError(
                f"compilation_config={v!r} is not supported: vframe compiles no model with torch.compile; "
                "use level / mode 0"
            )
        mode = v.get("cudagraph_mode")
        if mode is not None and str(mode).upper() not in ("NONE", "FULL_DECODE_ONLY"):
            raise ValueError(
                f"compilation_config cudagraph_mode={mode!r} is not supported: vframe captures whole decode "
                "steps (FULL_DECODE_ONLY) or nothing (NONE)"
            )
        sizes = v.get("cudagraph_capture_sizes")
        if sizes is not None and (
            not isinstance(sizes, list | tuple) or not all(isinstance(n, int) and n >= 1 for n in sizes)
        ):
            raise ValueError(f"compilation_config cudagraph_capture_sizes={sizes!r}: use a list of positive ints")
        top = v.get("max_cudagraph_capture_size")
        if top is not None and (not isinstance(top, int) or top < 0):
            raise ValueError(f"compilation_config max_cudagraph_capture_size={top!r}: use an int >= 0")
        return v

    def cuda_graph_options(self) -> dict[str, Any]:
        """``compilation_config``'s CUDA graph settings: ``cudagraph_capture_sizes`` and
        ``max_cudagraph_capture_size`` where given; ``cudagraph_mode`` NONE or
        ``max_cudagraph_capture_size`` 0 as ``cudagraph_capture_sizes=[]`` (capture nothing)."""
        v = self.compilation_config if isinstance(self.compilation_config, dict) else {}
        options = {k: v[k] for k in ("cudagraph_capture_sizes", "max_cudagraph_capture_size") if v.get(k) is not None}
        if str(v.get("cudagraph_mode", "")).upper() == "NONE" or options.get("max_cudagraph_capture_size") == 0:
            options["cudagraph_capture_sizes"] = []
        return options


def gpu_batch_defaults(device_name: str, device_memory: int, server: bool) -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)`` on a GPU where the user set neither, as
    vLLM chooses them: 160 GiB and more (B200): 16384 and 1024; 70 GiB and more, A100s
    excepted (H100, H200): 16384 offline, 8192 for the server, and 1024; smaller GPUs:
    8192 offline, 2048 for the server, and 256 (an A100 is slower with the larger budget)."""
    gib = 1 << 30
    if device_memory >= 160 * gib:
        return 16384, 1024
    if device_memory >= 70 * gib and "a100" not in device_name.lower():
        return (8192 if server else 16384), 1024
    return (2048 if server else 8192), 256


_COMPILATION_KEYS = ("level", "mode", "cudagraph_mode", "cudagraph_capture_sizes", "max_cudagraph_capture_size")


class AttentionSection(BaseModel):
    model_config = _STRICT

    attention_backend: str | None = Field(
        None,
        description="backend registry name, or `auto` (same as None): the first usable of "
        "flash_attn, triton, torch on cuda; torch on cpu",
    )

    @field_validator("attention_backend")
    @classmethod
    def _auto_is_none(cls, v: str | None) -> str | None:
        return None if v == "auto" else v


class SamplerSection(BaseModel):
    model_config = _STRICT

    sampler: str = Field("default", description="sampler registry name")
    logits_processors: list[Any] = Field(
        default_factory=list,
        description="vLLM v1 batch-level logits processors, engine-wide: LogitsProcessor subclasses or "
        "'module:Class' / 'module.Class' names (comma-separated on the command line); each is built once "
        "in the process that samples as cls(vllm_config=the EngineConfig, device, is_pin_memory)",
    )

    @field_validator("logits_processors", mode="before")
    @classmethod
    def _importable_processors(cls, v: Any) -> Any:
        if isinstance(v, str):  # a flag or VFRAME_LOGITS_PROCESSORS: comma-separated names
            v = [name.strip() for name in v.split(",") if name.strip()]
        if isinstance(v, (list, tuple)) and v:
            from vframe.core.sample.batch_processors import load_processor_class

            for spec in v:
                load_processor_class(spec)  # a bad name or class fails here, not in the runner
        return list(v) if isinstance(v, tuple) else v


class QuantizationSection(BaseModel):
    model_config = _STRICT

    quantization: str | None = Field(
        None,
        description="quantizer registry name, or `auto` (same as None): the checkpoint's "
        "quantization_config.quant_method if it has one, else unquantized",
    )

    quant_kernel: str | None = Field(
        None,
        description="quant_kernel registry name that runs every integer-quantized layer (GPTQ, AWQ, "
        "compressed-tensors int4/int8); None: per layer, the highest-priority kernel that can",
    )

    @field_validator("quantization")
    @classmethod
    def _auto_is_none(cls, v: str | None) -> str | None:
        return None if v == "auto" else v


class LoRASection(BaseModel):
    model_config = _STRICT

    enable_lora: bool = Field(False, description="serve PEFT LoRA adapters (requests name one with lora_request)")
    max_loras: int = Field(1, ge=1, description="adapters resident at once, i.e. in one step's batch")
    max_lora_rank: int = Field(16, ge=1, description="largest adapter rank accepted")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="adapters kept loaded in host memory (LRU); None: max_loras"
    )
    lora_kernel: str = Field("torch", description="lora_kernel registry name of the batched LoRA kernel")


class ObservabilitySection(BaseModel):
    model_config = _STRICT

    disable_log_stats: bool = Field(
        False, description="accepted, no effect: the engine logs no periodic statistics (see /metrics)"
    )
    torch_profiler_dir: str | None = Field(
        None, description="where LLM.stop_profile() writes traces (or VFRAME_TORCH_PROFILER_DIR)"
    )


class PluginSection(BaseModel):
    model_config = _STRICT

    plugins: list[str] | None = Field(None, description="allow-list of entry-point plugins; None = all")


_SECTIONS: dict[str, type[BaseModel]] = {
    "model": ModelSection,
    "cache": CacheSection,
    "scheduler": SchedulerSection,
    "parallel": ParallelSection,
    "device": DeviceSection,
    "attention": AttentionSection,
    "sampler": SamplerSection,
    "quantization": QuantizationSection,
    "lora": LoRASection,
    "observability": ObservabilitySection,
    "plugins": PluginSection,
}

# flat vLLM-style name -> section that owns it
FLAT_FIELDS: dict[str, str] = {
    name: section for section, cls in _SECTIONS.items() for name in cls.model_fields
}


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: ModelSection = ModelSection()
    cache: CacheSection = CacheSection()
    scheduler: SchedulerSection = SchedulerSection()
    parallel: ParallelSection = ParallelSection()
    device: DeviceSection = DeviceSection()
    attention: AttentionSection = AttentionSection()
    sampler: SamplerSection = SamplerSection()
    quantization: QuantizationSection = QuantizationSection()
    lora: LoRASection = LoRASection()
    observability: ObservabilitySection = ObservabilitySection()
    plugins: PluginSection = PluginSection()
    # Who runs the engine, for the defaults that differ (gpu_batch_defaults): "offline"
    # (LLM, the engine classes) or "server", which `vframe serve` sets.
    _usage: Literal["offline", "server"] = PrivateAttr("offline")

    @model_validator(mode="after")
    def _cross_checks(self) -> EngineConfig:
        if self.parallel.pipeline_parallel_size > 1:
            raise ValueError(
                f"pipeline_parallel_size={self.parallel.pipeline_parallel_size}: pipeline parallelism is not "
                "built yet (docs/distributed.md); use tensor_parallel_size to split the model instead"
            )
        lora = self.lora
        if lora.max_cpu_loras is not None and lora.max_cpu_loras < lora.max_loras:
            raise ValueError(f"max_cpu_loras={lora.max_cpu_loras} must be at least max_loras={lora.max_loras}")
        return self

    # ------------------------------------------------------------------ #

    @classmethod
    def from_sources(
        cls,
        config_file: str | os.PathLike | None = None,
        env: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> EngineConfig:
        """Merge file < environment < keyword arguments and validate."""
        merged: dict[str, dict[str, Any]] = {}
        if config_file is not None:
            _merge(merged, _read_file(Path(config_file)), source=str(config_file))
        _merge(merged, _from_env(os.environ if env is None else env), source="environment")
        _merge(merged, {k: v for k, v in kwargs.items()}, source="arguments")
        try:
            return cls(**{s: _SECTIONS[s](**fields) for s, fields in merged.items()})
        except ValidationError as e:
            raise ConfigError(_format_validation_error(e)) from None
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat name."""
        return {name: getattr(getattr(self, sec), name) for name, sec in FLAT_FIELDS.items()}


def _merge(into: dict[str, dict[str, Any]], values: dict[str, Any], source: str) -> None:
    for key, value in values.items():
        if key in _SECTIONS and isinstance(value, dict):
            _merge(into, value, source)
            continue
        section = FLAT_FIELDS.get(key)
        if section is None:
            raise ConfigError(
                f"unknown setting {key!r} (from {source}); known settings: "
                + ", ".join(sorted(FLAT_FIELDS))
            )
        if value is None:
            continue  # None means the default, as vLLM's EngineArgs (and argparse flags left out) use it
        into.setdefault(section, {})[key] = value


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    if path.suffix == ".toml":
        data = tomllib.loads(text)
    elif path.suffix in (".yaml", ".yml"):
        import yaml

        data = yaml.safe_load(text) or {}
    elif path.suffix == ".json":
        data = json.loads(text)
    else:
        raise ConfigError(f"config file {str(path)!r}: use a .yaml, .yml, .toml or .json file")
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping of settings")
    return data


def _from_env(env: dict[str, str] | os._Environ) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in FLAT_FIELDS:
        raw = env.get(f"VFRAME_{name.upper()}")
        if raw is None:
            continue
        if name == "plugins":
            out[name] = [p.strip() for p in raw.split(",") if p.strip()]
        else:
            out[name] = raw  # pydantic coerces "8" -> 8, "true" -> True
    return out


def _format_validation_error(e: ValidationError) -> str:
    lines = []
    for err in e.errors():
        field = ".".join(str(p) for p in err["loc"][-1:]) or "config"
        value = err.get("input")
        msg = err["msg"]
        ctx = err.get("ctx") or {}
        if err["type"] == "value_error":  # a validator's own message names the field and the value
            lines.append(str(ctx.get("error", msg)))
            continue
        if "expected" in ctx:
            msg = f"expected {ctx['expected']}"
        lines.append(f"invalid value for {field!r}: {value!r} ({msg})")
    return "; ".join(lines)
