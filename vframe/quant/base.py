"""What a quantizer plugin implements (plugin API 1.2).

A ``quantizer`` registry entry is a ``QuantizationConfig`` subclass. For a run
with ``quantization="name"`` the engine:

1. loads the class and asks ``validate_configuration(dtype=..., device=...)``
   for every reason it cannot run (``ConfigError`` listing them);
2. builds it with ``from_config(hf_quant_config)``: the checkpoint's
   ``quantization_config`` from ``config.json``, or ``None`` for a float
   checkpoint that the method quantizes while loading;
3. hands the instance to the model. Each of the model's linear layers
   (``vframe/layers/linear.py``) asks ``get_quant_method(layer, prefix)`` for a
   ``LinearMethodBase``; ``None`` leaves that layer unquantized;
4. the method's ``create_weights`` registers the layer's parameters, the
   checkpoint loader fills them through each parameter's ``weight_loader``,
   then ``process_weights_after_loading`` runs once per layer (repack, quantize);
5. every forward pass calls ``apply(layer, x, bias)``; or, where the method's
   ``bind(layer, bias)`` returned a function of ``x`` once the weights were
   processed (plugin API 1.12), that function.

A format may also keep the token embedding quantized, and with it the LM head
(``get_embedding_method``, default ``None``: both stay unquantized). Its
``EmbeddingMethodBase`` creates the ``[vocab, hidden]`` weight as a linear
layer of ``hidden`` inputs and ``vocab`` outputs would, looks rows up
(``embedding``) and computes the head's logits (``apply``); a tied head is the
same module (``vframe/layers/embedding.py``).

Parameters a method creates describe themselves with attributes (see
``set_weight_attrs``) so that the layer's loader can place fused (q/k/v,
gate/up), tensor-parallel and packed tensors without knowing the format:

* ``output_dim``: the dimension that runs along the layer's output features.
  Fused shards and column-parallel ranks are cut along it, in proportion to the
  parameter's extent: a parameter holding 8 int4 values per int32 along its
  output dimension has 1/8 of the rows, and its q/k/v offsets shrink by 8 too.
  ``None``: the parameter does not run along the output features; in a fused
  layer it then holds one entry per shard along dimension 0 (e.g. per-tensor
  scales of q, k and v) and shard ``i`` is loaded into entry ``i``.
* ``input_dim``: the dimension that runs along the input features; row-parallel
  ranks are cut along it (proportionally too: group scales, packed inputs).
* ``weight_loader(param, loaded_weight, shard_id=None)``: set it only to load a
  parameter differently; by default the layer's own loader is attached.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from vframe.errors import ConfigError, ModelLoadError
from vframe.quant import onednn_packed
from vframe.quant.native_call import NativeCall, native_call, with_native

__all__ = [
    "BoundApply", "EmbeddingMethodBase", "IntKernelMethod", "LinearMethodBase", "NativeCall", "QuantizationConfig",
    "UnquantizedLinearMethod", "bound_apply", "native_call", "register_weight", "set_weight_attrs", "with_native",
]

# ``apply(layer, x, bias)`` as a function of ``x`` alone, with the layer's tensors looked
# up once: what ``LinearMethodBase.bind`` and ``QuantLinearKernel.bind`` return.
BoundApply = Callable[[torch.Tensor], torch.Tensor]


def bound_apply(impl: Any, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
    """``impl.bind(layer, bias)`` for a linear method or a quant kernel, unless a subclass
    overrides ``apply`` below the class that defines ``bind``: the inherited ``bind`` would
    compute its parent's ``apply`` (a plugin written before plugin API 1.12 that subclasses
    ``UnquantizedLinearMethod`` to change ``apply``), so that ``apply`` stays in use."""
    mro = type(impl).__mro__
    bind_owner = next((c for c in mro if "bind" in c.__dict__), None)
    apply_owner = next((c for c in mro if "apply" in c.__dict__), None)
    if bind_owner is None or apply_owner is None or not issubclass(bind_owner, apply_owner):
        return None
    return impl.bind(layer, bias)


def set_weight_attrs(param: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Attach loading attributes (``output_dim``, ``input_dim``, ``weight_loader``) to ``param``."""
    for key, value in attrs.items():
        if hasattr(param, key):
            raise AttributeError(f"parameter already has attribute {key!r}; refusing to overwrite it")
        setattr(param, key, value)


def register_weight(layer: nn.Module, name: str, tensor: torch.Tensor, attrs: dict[str, Any]) -> None:
    """Register ``tensor`` on ``layer`` as the frozen parameter ``name`` carrying the
    loading attributes ``attrs`` (see ``set_weight_attrs``): what every
    ``create_weights`` does once per checkpoint tensor."""
    param = nn.Parameter(tensor, requires_grad=False)
    set_weight_attrs(param, attrs)
    layer.register_parameter(name, param)


class LinearMethodBase(ABC):
    """How one linear layer stores and multiplies its weight.

    One instance per layer (``get_quant_method`` makes it), so a method may keep
    per-layer state, though parameters belong on the layer."""

    @abstractmethod
    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        """Register the layer's weight parameters (``layer.register_parameter``).

        ``output_partition_sizes``: this rank's output features of each fused
        shard (``[q, k, v]``, ``[gate, up]`` or one entry); their sum is the
        layer's output features on this rank. ``input_size`` / ``output_size``
        are the whole layer's, before tensor parallelism. ``params_dtype`` is
        the model's dtype, which is also the dtype of ``apply``'s input.
        Create tensors with ``torch.empty``: the loader fills every one."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Called once after every checkpoint tensor is loaded: quantize, repack
        for a kernel, replace parameters. Default: nothing."""

    @abstractmethod
    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,  # [T, input_size_per_partition], params_dtype
        bias: torch.Tensor | None = None,  # [output_size_per_partition]
    ) -> torch.Tensor:  # [T, sum(output_partition_sizes)], params_dtype
        """``x @ W.T + bias`` with this method's weight."""

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        """``apply(layer, x, bias)`` as a function of ``x`` alone (plugin API 1.12), asked
        for once after ``process_weights_after_loading``; the layer calls it instead of
        ``apply`` from then on. Look the layer's tensors and the kernel's operator up here,
        not on every call: a decode step of a small model calls a few hundred linears, and
        a chain of attribute and buffer lookups costs microseconds each time. It must
        return what ``apply`` returns, bit for bit, for every ``x``; the layer's tensors do
        not change after it is bound. Default ``None``: the layer calls ``apply``.

        The function may also say which single operator call computes it
        (``with_native(product, NativeCall(...))``, plugin API 1.13,
        ``vframe/quant/native_call.py``): a decode plan then calls that operator from C++."""
        return None

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:  # [out_per_partition, in_per_partition]
        """The float weight ``apply`` multiplies by, after loading. The
        conformance kit (``vframe.testing.quant``) checks ``apply`` against
        ``F.linear(x, dequantize_weight(layer), bias)``; implement it there."""
        raise NotImplementedError(f"{type(self).__name__} does not implement dequantize_weight")


class EmbeddingMethodBase(LinearMethodBase):
    """How a token embedding ``[vocab, hidden]`` stores its weight, looks rows up
    and, as the LM head, multiplies by it. ``create_weights`` sees a linear layer
    of ``hidden`` inputs and ``[vocab]`` outputs; ``apply`` is the head's
    ``x @ W.T`` ([T, hidden] -> [T, vocab])."""

    @abstractmethod
    def embedding(
        self,
        layer: nn.Module,
        input_ids: torch.Tensor,  # [T] int64
    ) -> torch.Tensor:  # [T, hidden], params_dtype
        """Rows ``input_ids`` of the weight ``dequantize_weight`` returns."""


class IntKernelMethod(LinearMethodBase):
    """An integer format whose layers run on a quant kernel (``vframe.quant.kernels``,
    plugin API 1.8): after loading, ``int_weight`` turns the checkpoint tensors into
    an ``IntWeight``, the chosen kernel keeps what it needs, and the checkpoint
    parameters named in ``checkpoint_params`` are dropped (the kernel's buffers are
    the layer's weight from then on). ``apply`` and ``dequantize_weight`` are the kernel's."""

    checkpoint_params: tuple[str, ...] = ()
    activations: str = "float"  # vframe.quant.kernels.WEIGHT_ONLY; INT8_PER_TOKEN for W8A8

    def __init__(self, kernel_name: str | None = None) -> None:
        self.kernel_name = kernel_name  # the quant_kernel setting; None: by priority
        self.kernel: Any = None

    @abstractmethod
    def int_weight(self, layer: nn.Module) -> Any:  # vframe.quant.kernels.IntWeight
        """The loaded layer's weight as an ``IntWeight`` ([out, in] integers, this rank's)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        from vframe.quant.kernels import attach_kernel

        self.kernel = attach_kernel(layer, self.int_weight(layer), self.activations, self.kernel_name)
        for name in self.checkpoint_params:
            if name in layer._parameters:
                delattr(layer, name)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return self.kernel.apply(layer, x, bias)

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        return None if self.kernel is None else bound_apply(self.kernel, layer, bias)

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        # Before processing, the checkpoint tensors' weight; after, the kernel's.
        if self.kernel is None:
            return self.int_weight(layer).dequantize()
        return self.kernel.dequantize_weight(layer)


class UnquantizedLinearMethod(LinearMethodBase):
    """The default: one ``[out, in]`` weight in the model's dtype, ``F.linear``."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        weight = torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=params_dtype)
        register_weight(layer, "weight", weight, {"output_dim": 0, "input_dim": 1})  # [out, in]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        # float32 / bfloat16 on the CPU, packed once: bfloat16 as pairs for vframe's own GEMM
        # where it runs (AVX512-BF16), else oneDNN's layout
        from vframe.layers import cpu_ops  # (vframe.layers imports this module)

        if not onednn_packed.should_pack(layer):
            return
        if cpu_ops.bf16_pairable(layer.weight):
            layer.weight = nn.Parameter(cpu_ops.bf16_pairs(layer.weight.detach()), requires_grad=False)
        else:
            onednn_packed.pack(layer)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        weight = layer.weight
        if weight.is_mkldnn:
            return onednn_packed.packed_linear(x, weight, bias)
        if weight.dim() == 4:  # bf16_pairs
            return _pairs_linear(x, weight, bias)
        return F.linear(x, weight, bias)

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply:
        weight = layer.weight
        if weight.is_mkldnn:
            return onednn_packed.bound_linear(weight, bias)
        if weight.dim() == 4:
            from vframe.layers import cpu_ops

            return with_native(functools.partial(_pairs_linear, weight=weight, bias=bias),
                               NativeCall(cpu_ops.operator("bf16_gemm"), (weight,), bias))
        return with_native(functools.partial(F.linear, weight=weight, bias=bias),
                           NativeCall(torch.ops.aten.linear.default, (weight, bias)))

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:
        if layer.weight.dim() == 4:
            from vframe.layers import cpu_ops

            return cpu_ops.bf16_unpairs(layer.weight)
        return onednn_packed.plain(layer.weight)


def _pairs_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``F.linear`` on a weight held as ``cpu_ops.bf16_pairs``: ``bf16_gemm`` for bfloat16
    rows it takes, else the plain weight."""
    from vframe.layers import cpu_ops

    rows = x.reshape(-1, x.shape[-1])
    if cpu_ops.bf16_gemm_takes(rows):
        out = cpu_ops.bf16_gemm(rows, weight).reshape(*x.shape[:-1], weight.shape[0] * 16)
        return out if bias is None else out + bias
    return F.linear(x, cpu_ops.bf16_unpairs(weight), bias)


class QuantizationConfig(ABC):
    """A quantization format: what a ``quantizer`` registry entry names.

    The two tolerances are the method's promise to the conformance kit
    (``vframe.testing.quant.check_quant_method``), for float32 activations:

    * ``reference_tolerance``: largest ``|apply(x) - F.linear(x, W_deq, bias)|``
      relative to the largest ``|F.linear(...)|``, where ``W_deq`` is
      ``dequantize_weight(layer)``. Only the kernel's rounding: 1e-5 is float32.
    * ``weight_tolerance``: largest ``|W_deq - W|`` relative to the largest
      ``|W|`` of the same output row, for the float weight ``W`` it came from
      (the quantization error). Symmetric int8 round-to-nearest: 1/254.

    The kit reads them off the config ``from_config`` returned: class attributes,
    which a config may set on the instance for its checkpoint's scheme (plugin API
    1.11; compressed-tensors does for NVFP4).
    """

    reference_tolerance: float = 1e-5
    weight_tolerance: float = 0.0
    # The quant_kernel setting (a registry name; None: by priority), set by the engine
    # after from_config; formats whose layers run on quant kernels pass it to them.
    quant_kernel: str | None = None
    # Whether the checkpoint declares calibrated FP8 KV-cache scales (compressed-tensors'
    # kv_cache_scheme; plugin API 1.19): with kv_cache_dtype="fp8..." the engine then refuses
    # a checkpoint that lacks any layer's k_scale / v_scale tensors rather than run it at 1.0.
    calibrated_kv_cache: bool = False

    @classmethod
    @abstractmethod
    def get_name(cls) -> str:
        """The format's name, as checkpoints spell ``quantization_config.quant_method`` (e.g. ``"gptq"``)."""

    @classmethod
    @abstractmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        """Activation dtypes ``apply`` accepts (the model's ``dtype``)."""

    @classmethod
    def get_min_capability(cls) -> int | None:
        """Lowest CUDA compute capability times ten (80: Ampere) the kernels need;
        ``None`` (default): any device, CPU included."""
        return None

    @classmethod
    def validate_configuration(cls, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        """Every reason this format cannot run with activation ``dtype`` on
        ``device``; empty when it can. Override to add reasons, keeping these."""
        reasons = []
        supported = cls.get_supported_dtypes()
        if dtype not in supported:
            names = ", ".join(_dtype_name(d) for d in supported)
            reasons.append(f"dtype={_dtype_name(dtype)!r} is not supported (supported: {names})")
        capability = cls.get_min_capability()
        if capability is not None:
            if device.type != "cuda":
                reasons.append(
                    f"needs a CUDA GPU of compute capability >= {capability / 10:.1f}; the device is {device.type}"
                )
            else:
                major, minor = torch.cuda.get_device_capability(device)
                if major * 10 + minor < capability:
                    reasons.append(
                        f"needs compute capability >= {capability / 10:.1f}; the GPU has {major}.{minor}"
                    )
        return reasons

    @classmethod
    @abstractmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> QuantizationConfig:
        """Build from the checkpoint's ``quantization_config``, or ``None`` when the
        checkpoint is float and this format quantizes on load. Raise
        ``vframe.errors.ConfigError`` for a config it cannot use."""

    @abstractmethod
    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        """The method for ``layer`` (a ``vframe.layers.linear.LinearBase``; its sizes
        and ``tp_rank`` / ``tp_size`` are set), named ``prefix`` in the model
        (``"model.layers.0.self_attn.qkv_proj"``); ``None`` leaves it unquantized."""

    def get_embedding_method(self, prefix: str) -> EmbeddingMethodBase | None:
        """The method for the model's token embedding named ``prefix``
        (``"model.embed_tokens"``), which the model then builds as a
        ``vframe.layers.embedding.VocabEmbedding``; with one, the LM head is
        quantized too: tied, through the same method and tensor; untied, as a
        linear layer (``get_quant_method``). Default ``None``: embedding and
        head stay unquantized."""
        return None

    def checkpoint_tensor_name(self, name: str) -> str:
        """The name a checkpoint tensor loads under (plugin API 1.21), for formats whose tensor
        names are not parameter names: bitsandbytes' ``q_proj.weight.absmax`` loads into the
        parameter ``weight_absmax`` its method registered (``q_proj.weight_absmax``). Called
        for every tensor before the model maps names to parameters. Default: ``name``."""
        return name

    def quantizes_lm_head(self) -> bool:
        """Whether the checkpoint holds the LM head quantized beside an unquantized
        token embedding (compressed-tensors with ``lm_head`` targeted and not
        ignored, GPTQ's ``lm_head: true``). When ``True`` and the model's config does
        not tie the head to the embedding, the model builds the head as a linear
        layer named ``"lm_head"`` and ``get_quant_method(layer, "lm_head")`` gives
        its method. Default ``False``: the head stays unquantized, as checkpoints of
        the usual formats keep it (plugin API 1.18)."""
        return False


T = TypeVar("T")

# vframe's fused linear layers and the checkpoint modules each holds
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def checkpoint_modules(prefix: str) -> list[str]:
    """The checkpoint's module names behind vframe's layer ``prefix``:
    ``"model.layers.0.self_attn.qkv_proj"`` -> its ``q_proj``, ``k_proj`` and ``v_proj``;
    an unfused layer is its own name. For formats that set or match per module."""
    parent, _, leaf = prefix.rpartition(".")
    if leaf not in FUSED_MODULES:
        return [prefix]
    return [f"{parent}.{module}" if parent else module for module in FUSED_MODULES[leaf]]


def setting_of_layer(prefix: str, setting_of: Callable[[str], T], source: str) -> T:
    """``setting_of`` each checkpoint module behind vframe's layer ``prefix``
    (``checkpoint_modules``), which must agree: one layer is quantized one way.
    Raises ``ConfigError`` naming the modules, what each got and ``source`` (the
    config field that set them) when they do not."""
    names = checkpoint_modules(prefix)
    found = {name: setting_of(name) for name in names}
    if len(set(found.values())) > 1:
        raise ConfigError(
            f"{prefix}: vframe fuses {', '.join(names)} into one layer, but {source} quantizes them differently "
            f"({found}); the fused modules must be quantized alike"
        )
    return found[names[0]]


def listed_as_float(prefix: str, entries: list[str], source: str) -> bool:
    """Whether a skip list (AWQ's ``modules_to_not_convert``, FP8's ``ignored_layers``) keeps
    vframe's layer ``prefix`` float, as the tools test it: a module is listed when an entry is
    part of its name. vframe's own name (a fused ``qkv_proj``, as vLLM writes it) or every
    checkpoint module behind it; some but not all of those is refused naming ``source``."""
    def listed(name: str) -> bool:
        return any(entry in name for entry in entries)

    return listed(prefix) or setting_of_layer(prefix, listed, source)


def fused_shard_index(shard_ids: list | tuple, shard_id: Any, where: str, kind: str) -> int:
    """Which fused shard of a layer (``shard_ids``: its ``shard_ids``; ``where``: its name)
    ``shard_id`` names, 0 for an unfused layer: for methods that keep each shard's checkpoint
    tensors apart until all are in (GGUF blocks, bitsandbytes' 4-bit sets; ``kind`` names the
    format in the message for a fused checkpoint tensor, which they cannot split)."""
    if not shard_ids:
        if shard_id is not None:
            raise ValueError(f"{where} has no fused shards; got shard id {shard_id!r}")
        return 0
    if shard_id is None:
        raise ModelLoadError(f"is a fused {kind} tensor; {where} loads its shards {list(shard_ids)} one tensor each")
    return shard_ids.index(shard_id)


def load_rank_part(loader: Callable[..., None], into: torch.Tensor, loaded: torch.Tensor, shard_id: Any) -> None:
    """Have a layer's own ``weight_loader`` place this tensor-parallel rank's part of the whole
    checkpoint tensor ``loaded`` ([rows, columns] of one module, or of modules fused on disk) into
    ``into`` ([the layer's rows on this rank, this rank's columns]), as it places a float weight:
    rows along dim 0 (a fused shard at its offset, KV heads as the ranks share them), columns along
    dim 1. For methods that hold a checkpoint's tensors in another form (codes one a byte, block
    scales, GGUF blocks) or quantize them while loading (bitsandbytes in flight)."""
    param = nn.Parameter(into, requires_grad=False)  # into's storage: the loader writes there
    set_weight_attrs(param, {"output_dim": 0, "input_dim": 1})
    loader(param, loaded, shard_id)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
