"""The default model runner: loads a registered model, owns the KV cache, runs steps.

One step is one forward pass over every scheduled token flattened to ``[T, E]``;
the output head runs only on the rows that are sampled (``logits_indices``).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import time

from typing import TYPE_CHECKING

import torch

from vframe.core.config import EngineConfig
from vframe.core.interfaces import AttentionBackend, ModelRunner, Sampler
from vframe.core.kv_cache_spec import (
    KVCacheSpec,
    bytes_per_block,
    full_attention_specs,
    kv_cache_dtype_option,
    kv_cache_torch_dtype,
    refuse_fp8_kv_cache,
)
from vframe.core.outputs import ModelRunnerOutput, RequestError, SamplerOutput, SchedulerOutput
from vframe.core.plugin_context import PluginContext, takes_context
from vframe.core.sample.batch_processors import BatchLogitsProcessors
from vframe.core.sample.metadata import SamplingMetadata
from vframe.core.sample.prompt_logprobs import compute_prompt_logprobs
from vframe.core.worker.input_batch import InputBatch
from vframe.core.worker.kv_token_check import KVTokenCheck
from vframe.errors import ConfigError, PluginError
from vframe.layers.parallel import broadcast_from_first, get_tp_size
from vframe.plugins import get_registry
from vframe.utils.cpu_memory import tune_allocator

if TYPE_CHECKING:
    from vframe.core.worker.cuda_graphs import DecodeGraphs
    from vframe.lora.manager import LoRAManager
    from vframe.lora.request import LoRARequest

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEFAULT_CPU_KV_BYTES = 2 << 30
# attention_backend=auto: per device type, the first of these that is registered and
# accepts the configuration (names missing from the registry are passed over).
AUTO_ATTENTION_BACKENDS: dict[str, list[str]] = {
    "cuda": ["flash_attn", "triton", "torch"],
    # cpu_paged needs its C++ operators, built once per machine; without a compiler it
    # refuses and torch serves.
    "cpu": ["cpu_paged", "torch"],
}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device='cuda' but no CUDA GPU is visible; use device='cpu'")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU runs bfloat16 matmuls natively (AVX-512 or AMX, as oneDNN
    sees it). Without, oneDNN falls back to a reference path: on an AVX2-only AMD
    EPYC (Zen 3) a [64, 576] x [576, 1536] bfloat16 matmul took 93 ms against
    1.4 ms in float32."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN
        return False


def resolve_dtype(name: str, model_dtype: torch.dtype | None, device: torch.device) -> torch.dtype:
    """``name`` as a dtype; ``auto``: the checkpoint's float32 or bfloat16, else
    bfloat16 (GGUF, float16, unknown), except on a CPU without native bfloat16,
    where it is float32."""
    if name != "auto":
        dtype = _DTYPES[name]
        if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_fast_bf16():
            logger.warning(
                "dtype='bfloat16' on a CPU without native bfloat16 (no AVX-512 or AMX): matrix products "
                "run tens of times slower than in float32; dtype='auto' or 'float32' is faster here"
            )
    elif model_dtype in (torch.float32, torch.bfloat16):
        dtype = model_dtype
    else:
        dtype = torch.bfloat16  # GGUF, float16 and unknown: bf16 runs fast on GPUs and AVX-512/AMX CPUs
    if name == "auto" and device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_fast_bf16():
        dtype = torch.float32
    if device.type == "cpu" and dtype == torch.float16:
        raise ConfigError("dtype='float16' is not supported on CPU; use 'bfloat16' or 'float32'")
    return dtype


def default_dtype_name(device: str) -> str:
    """What benchmarks run in unless told: bfloat16 where it is fast (GPUs, AVX-512/AMX
    CPUs), else float32."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "bfloat16" if cpu_has_fast_bf16() else "float32"
    return "bfloat16"


def seed_everything(seed: int) -> None:
    """Seed torch (unseeded sampling draws from it), Python's ``random`` and numpy, as vLLM does."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def check_load_format(load_format: str, source: object, is_gguf: bool) -> None:
    """vLLM's ``load_format``: ``safetensors`` or ``gguf`` must match what the model path holds."""
    found = "gguf" if is_gguf else "safetensors"
    if load_format not in ("auto", found):
        raise ConfigError(f"load_format={load_format!r} but {source} holds {found} weights; use load_format='auto'")


class TorchModelRunner(ModelRunner):
    def __init__(self, config: EngineConfig, sampler: Sampler | None = None) -> None:
        super().__init__(config)
        self.device = resolve_device(config.device.device)
        if config.device.num_threads and self.device.type == "cpu":
            torch.set_num_threads(config.device.num_threads)
        seed_everything(config.model.seed)
        self.block_size = config.cache.block_size
        # Built by set_plugin_context (it may need the tokenizer) unless given; the
        # class is looked up now so that an unknown name fails before the model loads.
        self.sampler: Sampler | None = sampler
        self._sampler_cls = get_registry("sampler").load(config.sampler.sampler) if sampler is None else None
        # Engine-wide batch logits processors are built here, in the process that samples.
        batch_processors = BatchLogitsProcessors(config, self.device) if config.sampler.logits_processors else None
        self.input_batch = InputBatch(self.block_size, self.device, batch_processors)
        self.kv_caches: list[torch.Tensor] = []
        self._kv_cache_specs: list[KVCacheSpec] | None = None
        self.lora_manager: LoRAManager | None = None  # built by load_model with enable_lora
        self.swap_caches: list[torch.Tensor] = []
        self._profiler: torch.profiler.profile | None = None
        # Debug mode (cache.debug_verify_kv_tokens): the token id behind every KV slot.
        self.kv_token_check: KVTokenCheck | None = None
        self.decode_graphs: DecodeGraphs | None = None  # CUDA graphs of decode steps, once captured

    def set_plugin_context(self, context: PluginContext) -> None:
        if self._sampler_cls is not None:
            cls, self._sampler_cls = self._sampler_cls, None
            self.sampler = cls(context=context) if takes_context(cls) else cls()

    # ------------------------------------------------------------------ #

    def load_model(self) -> None:
        from vframe.models.loader import architecture, load_hf_config, load_model, resolve_model
        from vframe.quant.selection import build_quant_config

        quantization = self.config.quantization.quantization
        if quantization is not None:
            get_registry("quantizer").get(quantization)  # an unknown name fails before the checkpoint is read
        quant_kernel = self.config.quantization.quant_kernel
        if quant_kernel is not None:
            get_registry("quant_kernel").get(quant_kernel)
        # quantization="gguf" reads a GGUF's blocks: no dense conversion is written.
        self.resolved = resolve_model(self.config.model.model, convert_weights=quantization != "gguf")
        check_load_format(self.config.model.load_format, self.resolved.source, self.resolved.gguf_file is not None)
        hf_overrides = self.config.model.hf_overrides
        self.hf_config = load_hf_config(self.resolved, hf_overrides)
        arch = architecture(self.resolved, hf_overrides)
        model_cls = get_registry("model").load(arch)
        tp_size = get_tp_size()
        if tp_size > 1 and not getattr(model_cls, "supports_tensor_parallel", False):
            raise ConfigError(
                f"{arch} ({model_cls.__module__}.{model_cls.__qualname__}) does not split over "
                f"tensor-parallel ranks (it does not declare supports_tensor_parallel); use "
                f"tensor_parallel_size=1 (got {tp_size})"
            )
        # A converted GGUF's config names float32, the dtype of its dequantized copy.
        checkpoint_dtype = None if self.resolved.gguf_file else _checkpoint_dtype(self.hf_config)
        self.dtype = resolve_dtype(self.config.model.dtype, checkpoint_dtype, self.device)
        self.attn_backend = self._select_attention_backend()
        self.quant_config = build_quant_config(
            quantization, self.hf_config, dtype=self.dtype, device=self.device, quant_kernel=quant_kernel
        )
        self.model = load_model(
            self.resolved, model_cls, self.attn_backend, self.dtype, self.device, quant_config=self.quant_config,
            hf_overrides=hf_overrides,
        )
        self.model.eval()
        self._check_kv_cache_scales()
        if self.config.lora.enable_lora:
            self.lora_manager = self._build_lora_manager()
        # One builder per runner: it may keep buffers across steps.
        self.attn_metadata_builder = self.attn_backend.get_metadata_builder_cls()(self.config, self.device)

    def _check_kv_cache_scales(self) -> None:
        """Calibrated FP8 KV-cache scales the checkpoint gave the attention impls (plugin API
        1.19): applied by a float8 cache on a backend that says it applies them, refused on any
        other; unused (and said so) with ``kv_cache_dtype="auto"``."""
        from vframe.core.interfaces import MLAAttentionImpl

        impls = self._attention_impls()
        kv_cache_dtype = self.config.cache.kv_cache_dtype
        if self.config.cache.calculate_kv_scales:  # computed at start-up (initialize_kv_cache), per layer
            refused = sorted({type(impl).__qualname__ for impl in impls if not type(impl).supports_kv_cache_scales})
            if refused:
                raise ConfigError(
                    f"calculate_kv_scales=True sets each layer's k_scale / v_scale, and attention backend "
                    f"{self.attn_backend.name!r} ({', '.join(refused)}) does not apply them to its "
                    f"kv_cache_dtype={kv_cache_dtype!r} cache; use a backend that applies them (torch, cpu_paged, "
                    "triton), or leave calculate_kv_scales off"
                )
            if getattr(self.quant_config, "calibrated_kv_cache", False):
                logger.info("calculate_kv_scales=True: the checkpoint's calibrated FP8 KV-cache scales are replaced "
                            "by scales computed at start-up")
            return
        if kv_cache_dtype != "auto" and getattr(self.quant_config, "calibrated_kv_cache", False):
            # the loader sets a scale on the impl (an instance attribute) only from a checkpoint tensor
            needed = [("k_scale",) if isinstance(impl, MLAAttentionImpl) else ("k_scale", "v_scale") for impl in impls]
            missing = [i for i, (impl, names) in enumerate(zip(impls, needed))
                       if not all(n in vars(impl) or n.replace("_scale", "_head_scales") in vars(impl) for n in names)]
            if missing:
                raise ConfigError(
                    f"quantization_config.kv_cache_scheme says the checkpoint carries calibrated FP8 KV-cache "
                    f"scales, and it has none for {len(missing)} of its {len(impls)} attention layers (the first: "
                    f"layer {missing[0]}); a float8 cache would run them at scale 1.0. Use kv_cache_dtype='auto', "
                    "or a checkpoint with every layer's k_scale / v_scale"
                )
        def per_head(impl: object) -> bool:  # MLA impls have no per-head scales
            return getattr(impl, "has_kv_head_scales", False)

        scaled = [impl for impl in impls if (impl.k_scale, impl.v_scale) != (1.0, 1.0) or per_head(impl)]
        if not scaled:
            return
        if kv_cache_dtype == "auto":
            logger.info("the checkpoint's calibrated FP8 KV-cache scales (%d layers) go unused: the KV cache holds "
                        "%s (kv_cache_dtype='auto'); kv_cache_dtype='fp8' applies them", len(scaled), self.dtype)
            return
        for impl in scaled:  # one latent cache: k_scale is its scale, a different v_scale has nowhere to go
            if isinstance(impl, MLAAttentionImpl) and impl.v_scale not in (1.0, impl.k_scale):
                raise ConfigError(
                    f"the checkpoint gives a multi-head latent attention layer v_scale={impl.v_scale:g} beside "
                    f"k_scale={impl.k_scale:g}; its float8 cache holds one latent, scaled by k_scale (as vLLM's), so "
                    "a different v_scale cannot be applied; use kv_cache_dtype='auto' (the scales then go unused)"
                )
        headed = [impl for impl in scaled if per_head(impl)]
        checks = (  # (the impls, the class attribute that says it applies their scales, what they carry, what it lacks)
            (headed, "supports_per_head_kv_scales",
             f"calibrated FP8 KV-cache scales per KV head (kv_cache_scheme strategy 'attn_head'; {len(headed)} layers)",
             "per-head scales"),
            (scaled, "supports_kv_cache_scales", f"calibrated FP8 KV-cache scales (k_scale / v_scale, e.g. "
             f"{scaled[0].k_scale:g} / {scaled[0].v_scale:g})", "them"),
        )
        for group, flag, carried, what in checks:
            if refused := sorted({type(impl).__qualname__ for impl in group if not getattr(type(impl), flag)}):
                raise ConfigError(
                    f"the checkpoint carries {carried} and attention backend {self.attn_backend.name!r} "
                    f"({', '.join(refused)}) does not apply {what} to its kv_cache_dtype={kv_cache_dtype!r} cache; use "
                    "kv_cache_dtype='auto' (the scales then go unused), or a backend that applies them (torch, "
                    "cpu_paged, triton)"
                )

    def _build_lora_manager(self) -> LoRAManager:
        from vframe.lora.manager import LoRAManager

        lora = self.config.lora
        return LoRAManager(
            self.model,
            max_loras=lora.max_loras,
            max_lora_rank=lora.max_lora_rank,
            max_cpu_loras=lora.max_cpu_loras or lora.max_loras,
            dtype=self.dtype,
            device=self.device,
            kernel=get_registry("lora_kernel").load(lora.lora_kernel),
        )

    def add_lora(self, lora_request: LoRARequest) -> None:
        if self.lora_manager is None:
            raise ConfigError("this engine serves no LoRA adapters: start it with enable_lora=True")
        self.lora_manager.add_adapter(lora_request)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self.lora_manager is not None and self.lora_manager.remove_adapter(lora_int_id)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora_manager is None else self.lora_manager.list_adapters()

    def _select_attention_backend(self) -> type[AttentionBackend]:
        """The configured backend, or with ``attention_backend`` unset (``auto``) the
        first of ``AUTO_ATTENTION_BACKENDS[device]`` that is registered and gives no
        reason to refuse; raise ``ConfigError`` with every reason otherwise."""
        registry = get_registry("attention_backend")
        name = self.config.attention.attention_backend
        if name is not None:
            backend: type[AttentionBackend] = registry.load(name)
            if reasons := self._attention_refusals(backend):
                raise ConfigError(
                    f"attention_backend={name!r} cannot serve this configuration: " + "; ".join(reasons)
                    + " (attention_backend='auto' takes the first usable backend; `vframe plugins` lists them)"
                )
            return backend
        refusals = []
        candidates = [n for n in AUTO_ATTENTION_BACKENDS.get(self.device.type, ["torch"]) if n in registry.names()]
        for candidate in candidates:
            try:
                backend = registry.load(candidate)
            except PluginError as e:  # a broken plugin's backend: pass over it, as `vframe plugins` does
                refusals.append(f"{candidate}: {e}")
                continue
            if not (reasons := self._attention_refusals(backend)):
                logger.info("attention_backend=auto: %s on %s", candidate, self.device.type)
                return backend
            refusals.append(f"{candidate}: " + "; ".join(reasons))
        raise ConfigError(
            f"attention_backend='auto' found no usable backend on {self.device.type} among "
            f"{', '.join(candidates) or '(none registered)'}: " + " | ".join(refusals)
        )

    def _attention_refusals(self, backend: type[AttentionBackend]) -> list[str]:
        options = kv_cache_dtype_option(kv_cache_dtype := self.config.cache.kv_cache_dtype)
        # A backend written before kv_cache_dtype existed cannot be asked: it stores no fp8.
        if options and "kv_cache_dtype" not in inspect.signature(backend.validate_configuration).parameters:
            return backend.check_available() + refuse_fp8_kv_cache(backend.name, kv_cache_dtype)
        return backend.check_available() + backend.validate_configuration(
            head_size=self.head_size,
            dtype=self.dtype,
            device=self.device.type,
            block_size=self.block_size,
            use_mla=self.use_mla,
            **options,
        )

    @property
    def use_mla(self) -> bool:
        """Whether the model caches a multi-head latent (DeepSeek-V2/V3 MLA): its
        config sets ``kv_lora_rank``."""
        return bool(getattr(self.hf_config, "kv_lora_rank", None))

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_size(self) -> int:
        """The size backends are asked to serve: an attention head's, or with MLA
        the cached latent's (``kv_lora_rank + qk_rope_head_dim``)."""
        cfg = self.hf_config
        if self.use_mla:
            return cfg.kv_lora_rank + cfg.qk_rope_head_dim
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    @property
    def kv_cache_dtype(self) -> torch.dtype:
        """What the KV cache holds: the model's dtype, or float8 with ``kv_cache_dtype="fp8..."``
        (the model still computes in its dtype)."""
        return kv_cache_torch_dtype(self.config.cache.kv_cache_dtype, self.dtype)

    @property
    def max_position_embeddings(self) -> int:
        return self.hf_config.max_position_embeddings

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    # ------------------------------------------------------------------ #

    def kv_cache_specs(self) -> list[KVCacheSpec]:
        """What each layer caches per token: the model's ``get_kv_cache_specs``,
        or for a model without one (plugin API < 1.3) full attention over the
        config's kv-heads and head size in every layer."""
        if self._kv_cache_specs is None:
            declared = getattr(self.model, "get_kv_cache_specs", None)
            if declared is not None:
                self._kv_cache_specs = list(declared(self.block_size, self.kv_cache_dtype))
            else:
                self._kv_cache_specs = full_attention_specs(
                    self.num_layers, self.num_kv_heads, self.head_size, self.block_size, self.kv_cache_dtype,
                    getattr(self.hf_config, "sliding_window", None),
                )
        return self._kv_cache_specs

    def _kv_shapes(self, num_blocks: int) -> list[tuple[int, ...]]:
        return [self.attn_backend.get_kv_cache_shape_for_spec(spec, num_blocks) for spec in self.kv_cache_specs()]

    def bytes_per_block(self) -> int:
        """Bytes one block id costs over every layer, from the layers' specs."""
        return bytes_per_block(self.kv_cache_specs())

    def determine_num_kv_blocks(self) -> int:
        cache = self.config.cache
        if not getattr(self.model, "uses_kv_cache", True):
            return 1  # an encoder-only model (BERT) caches nothing; one block keeps the engine's invariants
        if cache.num_gpu_blocks_override:
            return cache.num_gpu_blocks_override
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = int(free * cache.gpu_memory_utilization)
            else:
                budget = min(_DEFAULT_CPU_KV_BYTES, _available_memory() // 4)
        num_blocks = budget // self.bytes_per_block()
        if num_blocks < 1:
            raise ConfigError(
                f"kv_cache_memory_bytes={budget} holds no KV block "
                f"(one block of {self.block_size} tokens needs {self.bytes_per_block()} bytes)"
            )
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        # Attention masks unwritten slots, but a NaN there would still leak through
        # 0 * NaN: the cache must start finite. On CPU, buffers this large come
        # from fresh, kernel-zeroed mmap pages, so `empty` is zero without paying
        # to write gigabytes at start-up; elsewhere zero it explicitly.
        self.decode_graphs = None  # graphs of an earlier cache would write into it
        if self.device.type == "cpu":
            tune_allocator()  # from here on, a forward's blocks reuse pages (vframe/utils/cpu_memory.py)
        graph_sizes = self._decode_graph_sizes()
        # With CUDA graphs, one block more than the scheduler knows: the padding rows'
        # scratch block (vframe/core/worker/cuda_graphs.py).
        cache_blocks = num_blocks + 1 if graph_sizes else num_blocks
        self.kv_caches = []
        for spec, shape in zip(self.kv_cache_specs(), self._kv_shapes(cache_blocks), strict=True):
            alloc = torch.empty if self.device.type == "cpu" and _is_large(shape, spec.dtype) else torch.zeros
            self.kv_caches.append(alloc(shape, dtype=spec.dtype, device=self.device))
        if self.config.cache.debug_verify_kv_tokens:
            self.kv_token_check = KVTokenCheck(num_blocks * self.block_size)
        if self.config.cache.calculate_kv_scales:  # before graphs are captured: they read the scales
            self._calculate_kv_scales(num_blocks)
        if graph_sizes:
            self._capture_decode_graphs(graph_sizes, scratch_block=num_blocks)

    def _attention_impls(self) -> list:
        """Every attention impl of the model (``AttentionImpl`` / ``MLAAttentionImpl``), in module order."""
        from vframe.models.loader.weights import attention_impls

        return [impl for module in self.model.modules() for impl in attention_impls(module)]

    def _calculate_kv_scales(self, num_blocks: int) -> None:
        """``cache.calculate_kv_scales``: each layer's k_scale / v_scale from one forward of random
        tokens (``vframe/core/worker/kv_scales.py``); the model bound again, so that what it
        built from the old scales (cpu_paged's decode plan) takes the new ones."""
        from vframe.core.worker.kv_scales import calculate_kv_scales
        from vframe.layers.binding import bind_model

        impls = self._attention_impls()
        if self.lora_manager is not None:
            self.lora_manager.prepare_step([])  # the base model's scales
        start = time.perf_counter()
        tokens = calculate_kv_scales(
            self.model, impls, self.kv_caches, self.attn_metadata_builder, block_size=self.block_size,
            num_blocks=num_blocks, vocab_size=self.vocab_size,
            max_len=self.config.model.max_model_len or self.max_position_embeddings, device=self.device,
        )  # fmt: skip
        bind_model(self.model)
        scales = [(impl.k_scale, impl.v_scale) for impl in impls]
        logger.info(
            "calculate_kv_scales: k_scale / v_scale of %d layers from %d random tokens in %.2f s (layer 0: %.4g / "
            "%.4g)", len(impls), tokens, time.perf_counter() - start, *scales[0],
        )

    def _decode_graph_sizes(self) -> list[int]:
        """The batch sizes of decode steps to capture in CUDA graphs; empty where this
        runner runs every step eagerly (the reason logged)."""
        from vframe.core.worker.cuda_graphs import capture_sizes

        reason = None
        if self.device.type != "cuda":
            return []
        if self.config.device.enforce_eager:
            reason = "enforce_eager=True"
        elif not getattr(self.model, "supports_cuda_graphs", False):
            reason = f"the model class {type(self.model).__qualname__} does not declare supports_cuda_graphs"
        elif not getattr(self.attn_backend, "supports_cuda_graphs", False):
            reason = f"the {self.attn_backend.name} attention backend does not declare supports_cuda_graphs"
        elif self.lora_manager is not None:
            reason = "LoRA adapters are enabled"
        elif get_tp_size() > 1:
            reason = "the model is split over tensor-parallel ranks"
        if reason is not None:
            logger.info("decode steps run without CUDA graphs: %s", reason)
            return []
        options = self.config.device.cuda_graph_options()
        return capture_sizes(
            self.config.scheduler.max_num_seqs, options.get("cudagraph_capture_sizes"),
            options.get("max_cudagraph_capture_size"),
        )

    def _capture_decode_graphs(self, sizes: list[int], scratch_block: int) -> None:
        from vframe.core.worker.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(
            self.model, self.attn_metadata_builder, self.kv_caches, sizes=sizes,
            max_model_len=self.config.model.max_model_len or self.max_position_embeddings,
            block_size=self.block_size, scratch_block=scratch_block, device=self.device,
        )  # fmt: skip
        try:
            seconds = graphs.capture()
        except Exception as e:  # noqa: BLE001 - a model or kernel that cannot be captured runs eagerly
            logger.warning("capturing CUDA graphs failed, decode steps run eagerly: %s: %s", type(e).__name__, e)
            return
        self.decode_graphs = graphs
        logger.info(
            "captured CUDA graphs of decode steps for %d batch sizes (%d to %d) in %.1f s",
            len(sizes), sizes[0], sizes[-1], seconds,
        )

    # ------------------------------------------------------------------ #

    def determine_num_swap_blocks(self) -> int:
        num_blocks = int(self.config.cache.swap_space * (1 << 30)) // self.bytes_per_block()
        if num_blocks < 1:
            raise ConfigError(
                f"swap_space={self.config.cache.swap_space} GiB holds no KV block "
                f"(one needs {self.bytes_per_block()} bytes); raise it for preemption_mode='swap'"
            )
        return num_blocks

    def initialize_swap_space(self, num_blocks: int) -> None:
        # The swap space lives in host memory whatever the device (pinned on CUDA).
        pin = self.device.type == "cuda"
        self.swap_caches = [
            torch.empty(shape, dtype=spec.dtype, pin_memory=pin)
            for spec, shape in zip(self.kv_cache_specs(), self._kv_shapes(num_blocks), strict=True)
        ]

    def _swap(self, pairs: list[tuple[int, int]], src: list[torch.Tensor], dst: list[torch.Tensor]) -> None:
        if not pairs:
            return
        src_to_dst = torch.tensor(pairs, dtype=torch.long)  # [N, 2]
        for s, d in zip(src, dst):
            self.attn_backend.swap_blocks(s, d, src_to_dst)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        # Out first: a block freed by a swap-out may be a swap-in's destination.
        self._swap(scheduler_output.blocks_to_swap_out, self.kv_caches, self.swap_caches)
        self._swap(scheduler_output.blocks_to_swap_in, self.swap_caches, self.kv_caches)
        if self.kv_token_check is not None:
            self.kv_token_check.swap(scheduler_output.blocks_to_swap_out, self.block_size, out=True)
            self.kv_token_check.swap(scheduler_output.blocks_to_swap_in, self.block_size, out=False)
        batch = self.input_batch
        failed = batch.update(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0 or len(failed) == len(
            scheduler_output.num_scheduled_tokens
        ):
            return ModelRunnerOutput(req_ids=[], sampled_token_ids={}, failed=failed)
        inputs = batch.prepare(scheduler_output)
        if self.kv_token_check is not None:
            self.kv_token_check.verify_and_record(inputs, batch)
        if self.lora_manager is not None:
            self.lora_manager.prepare_step(batch.lora_segments(inputs))
        hidden = None  # [T, E]
        if self.decode_graphs is not None:  # a step of decodes replays a captured graph
            hidden = self.decode_graphs.run(inputs.input_ids, inputs.positions, inputs.common)
        if hidden is None:
            attn_metadata = self.attn_metadata_builder.build(inputs.common)
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, attn_metadata)
        prompt_logprobs = {}
        if prompt_rows := batch.prompt_logprobs_rows(inputs):  # only requests that ask
            prompt_logprobs = compute_prompt_logprobs(self.model.compute_logits, hidden, prompt_rows)
        output = ModelRunnerOutput(
            req_ids=inputs.req_ids, sampled_token_ids={}, prompt_logprobs=prompt_logprobs, failed=failed
        )
        if not inputs.sampled_req_ids:
            return output

        logits = self.model.compute_logits(hidden[inputs.logits_indices])  # [B, V]
        sampling_metadata = batch.sampling_metadata(inputs.sampled_req_ids, logits.shape[-1])
        assert self.sampler is not None, "the engine calls set_plugin_context before the first step"
        sampler_output = self.sampler(logits, sampling_metadata)
        # Every rank samples from the same gathered logits; rank 0's draw is the one
        # every rank records, whatever each one's random state.
        broadcast_from_first(sampler_output.sampled_token_ids, get_tp_size())
        sampled = sampler_output.sampled_token_ids.tolist()
        self._collect_row_failures(inputs.sampled_req_ids, sampler_output, sampling_metadata, output)
        halted = output.failed.keys() | output.stopped
        going_on = [(r, t) for r, t in zip(inputs.sampled_req_ids, sampled) if r not in halted]
        if going_on:
            req_ids, tokens = map(list, zip(*going_on))
            refused = batch.record_sampled(req_ids, tokens)
            output.failed.update(refused)
            output.sampled_token_ids = {r: t for r, t in going_on if r not in refused}
        if sampler_output.logprobs is not None:
            ids = sampler_output.logprob_token_ids.tolist()
            lps = sampler_output.logprobs.tolist()
            ranks = sampler_output.sampled_ranks.tolist()
            for i, req_id in enumerate(inputs.sampled_req_ids):
                k = batch.requests[req_id].sampling_params.logprobs
                if k is not None and req_id in output.sampled_token_ids:
                    output.logprobs[req_id] = (ids[i][: k + 1], lps[i][: k + 1], ranks[i])
        return output

    def _collect_row_failures(
        self,
        req_ids: list[str],
        sampler_output: SamplerOutput,
        md: SamplingMetadata,
        output: ModelRunnerOutput,
    ) -> None:
        """Turn the sampler's failed rows and rows without an allowed token into
        per-request outcomes. A row with nothing allowed whose grammar does allow
        a stop token is complete: min_tokens or a ban kept it from ending, and
        the grammar wins, so it stops. Any other such row is a request whose
        constraints exclude every token: it fails, as the client's error."""
        for row, error in sampler_output.failed_rows.items():
            output.failed[req_ids[row]] = error
        for row in sampler_output.no_valid_token_rows:
            req_id = req_ids[row]
            if req_id in output.failed:
                continue
            params = self.input_batch.requests[req_id].sampling_params
            if md.token_bitmask is not None and _allows_any(md.token_bitmask[row], params.all_stop_token_ids):
                output.stopped.add(req_id)
                continue
            output.failed[req_id] = RequestError(
                "no token is allowed at this position: the request's allowed_token_ids, bad_words, "
                "logit_bias, min_tokens, logits processors and structured output exclude every token",
                caused_by_request=True,
            )

    # ------------------------------------------------------------------ #

    def profile(self, is_start: bool) -> None:
        # VLLM_TORCH_PROFILER_DIR too, so that vLLM's profiling scripts run unchanged.
        trace_dir = (
            self.config.observability.torch_profiler_dir
            or os.environ.get("VFRAME_TORCH_PROFILER_DIR")
            or os.environ.get("VLLM_TORCH_PROFILER_DIR")
        )
        if not trace_dir:
            raise ConfigError(
                "profiling needs a trace directory: set torch_profiler_dir or VFRAME_TORCH_PROFILER_DIR"
            )
        if is_start:
            if self._profiler is not None:
                raise RuntimeError("the profiler is already running; call stop_profile() first")
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities, record_shapes=True)
            self._profiler.start()
            return
        if self._profiler is None:
            raise RuntimeError("the profiler is not running; call start_profile() first")
        self._profiler.stop()
        os.makedirs(trace_dir, exist_ok=True)
        path = os.path.join(trace_dir, f"vframe_trace_{os.getpid()}_{int(time.time() * 1000)}.json")
        self._profiler.export_chrome_trace(path)
        self._profiler = None
        logger.info("wrote torch profiler trace to %s", path)


def _allows_any(bitmask_row: torch.Tensor, token_ids: set[int]) -> bool:
    """Whether any of ``token_ids`` has its bit set in one grammar bitmask row ``[W]``."""
    words = bitmask_row.tolist()
    return any(t // 32 < len(words) and (words[t // 32] >> (t % 32)) & 1 for t in token_ids)


def _checkpoint_dtype(hf_config) -> torch.dtype | None:
    # transformers >= 5 calls it `dtype`, older releases `torch_dtype`.
    for name in ("dtype", "torch_dtype"):
        value = hf_config.__dict__.get(name)
        if isinstance(value, str):
            value = _DTYPES.get(value)
        if isinstance(value, torch.dtype):
            return value
    return None


def _is_large(shape: tuple[int, ...], dtype: torch.dtype) -> bool:
    """Above glibc's largest mmap threshold (32 MiB), an allocation is always a fresh mmap."""
    return math.prod(shape) * torch.tensor([], dtype=dtype).element_size() > 64 << 20


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
