"""NVIDIA ModelOpt checkpoints (``quant_method: modelopt``), as
``modelopt.torch.export.export_hf_checkpoint`` writes them after ``mtq.quantize``.

The format names one algorithm for every quantized linear layer; ``exclude_modules``
(``ignore`` in the ``config.json`` copy) lists the modules left float, as fnmatch
patterns. Older exports keep it in ``hf_quant_config.json`` only, under
``quantization``; the config loader reads that file then, as vLLM does
(``vframe.models.config``). Per layer of ``in`` inputs and ``out`` outputs::

    FP8                        weight        e4m3 [out, in]
                               weight_scale  float32 []       one per module (so per q, k, v shard)
                               input_scale   float32 []       static activations: read, not used
                               W[o, i] = weight[o, i] * weight_scale
    FP8_PER_CHANNEL_PER_TOKEN  weight e4m3 [out, in], weight_scale float32 [out]; activations
                               dynamic per token (run in the model's dtype)
    FP8_PB_WO                  weight e4m3 [out, in], weight_scale float32
                               [ceil(out / 128), 1, ceil(in / 128), 1]: 128 x 128 blocks, weight-only
    MXFP8                      weight e4m3 [out, in], weight_scale uint8 [out, in / 32]: e8m0,
                               W[o, i] = weight[o, i] * 2 ** (scale[o, i // 32] - 127); activations
                               MXFP8 too (run in the model's dtype)
    NVFP4, W4A16_NVFP4         weight          uint8 [out, in / 2]   two e2m1 codes a byte, the first input low
                               weight_scale    e4m3  [out, in / 16]  one per group of 16 inputs
                               weight_scale_2  float32 []            one per module
                               input_scale     float32 []            NVFP4 (W4A4) only: read, not used
                               W[o, i] = e2m1(weight[o, i]) * weight_scale[o, i // 16] * weight_scale_2

``kv_cache_quant_algo: FP8`` adds each attention layer's calibrated KV-cache scales
(``self_attn.k_proj.k_scale``, ``self_attn.v_proj.v_scale``), which the loader hands to
the layer's attention (docs/quantization.md, "FP8 KV cache").

``quantization="modelopt"`` (or no setting) reads every algorithm below; vLLM's names
``"modelopt_fp4"`` and ``"modelopt_mxfp8"`` read NVFP4 and MXFP8 ones only. The layers
reuse compressed-tensors' and FP8's methods, which hold the same tensors
under other names: activations stay in the model's dtype, as they do for those formats'
static and FP4 activation schemes. Every other algorithm is refused naming it.
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Any

import torch
from torch import nn

from vframe.errors import ConfigError
from vframe.layers.linear import LinearBase
from vframe.quant.base import LinearMethodBase, QuantizationConfig, register_weight, setting_of_layer
from vframe.quant.compressed_tensors import (
    MXFP8_FORMAT, MXFP8_GROUP, CompressedTensorsConfig, Fp4Method, Mxfp8Method, NaiveMethod, Scheme,
)
from vframe.quant.fp8 import BlockFp8Method, Fp8Config, over_shard_rows
from vframe.quant.kernels import NVFP4

logger = logging.getLogger(__name__)

FP8_BLOCK = (128, 128)  # FP8_PB_WO's blocks (ModelOpt's FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG)
NVFP4_GROUP = 16
# quant_algo -> how vframe serves it (a compressed-tensors scheme, or "block")
SERVED = {
    "FP8": Scheme("modelopt", "float-quantized", "float", 8, True, "tensor", None, "fp8-static"),
    "FP8_PER_CHANNEL_PER_TOKEN": Scheme("modelopt", "float-quantized", "float", 8, True, "channel", None,
                                        "fp8-dynamic"),
    "FP8_PB_WO": "block",
    "MXFP8": Scheme("modelopt", MXFP8_FORMAT, "float", 8, True, "group", MXFP8_GROUP, "mxfp8"),
    "NVFP4": Scheme("modelopt", "nvfp4-pack-quantized", "float", 4, True, "tensor_group", NVFP4_GROUP, NVFP4),
    "W4A16_NVFP4": Scheme("modelopt", "nvfp4-pack-quantized", "float", 4, True, "tensor_group", NVFP4_GROUP, None),
}


class ModelOptConfig(QuantizationConfig):
    algos: tuple[str, ...] | None = None  # the quant_algo values this name reads (None: every one served)

    def __init__(self, algo: str, exclude_modules: list[str], kv_cache_algo: str | None = None) -> None:
        self.algo = algo
        self.exclude_modules = exclude_modules
        self.kv_cache_algo = kv_cache_algo
        self.calibrated_kv_cache = kv_cache_algo is not None
        # the same bounds as the formats' other readers
        if algo.endswith("NVFP4"):
            self.weight_tolerance = CompressedTensorsConfig.fp4_weight_tolerances["nvfp4-pack-quantized"]
        else:
            self.weight_tolerance = Fp8Config.weight_tolerance

    def __repr__(self) -> str:
        return (f"ModelOptConfig(algo={self.algo!r}, exclude_modules={self.exclude_modules}, "
                f"kv_cache_algo={self.kv_cache_algo!r})")

    @classmethod
    def get_name(cls) -> str:
        return "modelopt"

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> ModelOptConfig:
        if hf_quant_config is None:
            raise ConfigError(
                "quantization='modelopt' reads a checkpoint exported by NVIDIA ModelOpt (config.json "
                "quantization_config or hf_quant_config.json); this checkpoint is float. Quantize it with "
                "modelopt.torch.quantization and export it with modelopt.torch.export.export_hf_checkpoint first"
            )
        q = hf_quant_config
        if q.get("quant_method") != "modelopt":
            raise ConfigError(
                "quantization='modelopt' reads a ModelOpt checkpoint; this one is quantized as "
                f"{q.get('quant_method')!r}"
            )
        # hf_quant_config.json nests the fields under "quantization"; config.json holds them flat
        fields = q["quantization"] if isinstance(q.get("quantization"), dict) else q
        algo = str(fields.get("quant_algo") or "").upper()
        if algo not in SERVED:
            raise ConfigError(
                f"quantization_config.quant_algo={fields.get('quant_algo')!r} is not supported; vframe serves "
                + ", ".join(SERVED) + " (weights; activations stay in the model's dtype)"
            )
        if cls.algos is not None and algo not in cls.algos:
            raise ConfigError(
                f"quantization={cls.get_name()!r} reads ModelOpt {' / '.join(cls.algos)} checkpoints; this one is "
                f"quant_algo {algo!r}: use quantization='modelopt', or leave quantization unset"
            )
        group = fields.get("group_size")
        if algo.endswith("NVFP4") and group not in (None, NVFP4_GROUP):
            raise ConfigError(f"quantization_config.group_size={group!r}: NVFP4 scales groups of {NVFP4_GROUP}")
        if algo == "MXFP8" and group not in (None, MXFP8_GROUP):
            raise ConfigError(f"quantization_config.group_size={group!r}: MXFP8 scales groups of {MXFP8_GROUP}")
        exclude = fields.get("exclude_modules")
        if exclude is None:
            exclude = q.get("ignore") or []
        if algo in ("NVFP4", "MXFP8"):
            logger.warning(
                "ModelOpt %s checkpoint: vframe multiplies its weights by activations in the model's dtype; the "
                "checkpoint's activation quantization is not applied", algo
            )
        return cls(algo, list(exclude), _kv_cache_algo(fields, q))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        if setting_of_layer(prefix, self._excluded, "quantization_config.exclude_modules"):
            return None
        served = SERVED[self.algo]
        if served == "block":
            return ModelOptBlockFp8Method(FP8_BLOCK, "weight_scale", self.quant_kernel)
        if served.format == "nvfp4-pack-quantized":
            return ModelOptFp4Method(served, self.quant_kernel)
        if served.format == MXFP8_FORMAT:
            return Mxfp8Method(self.quant_kernel)
        if served.strategy == "channel":
            return ModelOptChannelFp8Method(served, self.quant_kernel)
        return NaiveMethod(served, self.quant_kernel)

    def quantizes_lm_head(self) -> bool:
        # ModelOpt lists a head it left float in exclude_modules (lm_head is in its default
        # exclusions); a head it quantized is a layer like the others.
        return not self._excluded("lm_head")

    def _excluded(self, name: str) -> bool:
        """Whether checkpoint module ``name`` stays float: an entry names it or a module above
        it, or matches it as an fnmatch pattern (``*mlp.gate*``), as ModelOpt and vLLM test it."""
        return any(
            name == entry or name.startswith(entry + ".") or fnmatch.fnmatchcase(name, entry)
            for entry in self.exclude_modules
        )


class ModelOptFp4Config(ModelOptConfig):
    """vLLM's name for ModelOpt's NVFP4 checkpoints (``quantization="modelopt_fp4"``): the same
    reader, refusing another algorithm (``"modelopt"``, or no setting, reads them all)."""

    algos = ("NVFP4", "W4A16_NVFP4")

    @classmethod
    def get_name(cls) -> str:
        return "modelopt_fp4"


class ModelOptMxFp8Config(ModelOptConfig):
    """vLLM's name for ModelOpt's MXFP8 checkpoints (``quantization="modelopt_mxfp8"``)."""

    algos = ("MXFP8",)

    @classmethod
    def get_name(cls) -> str:
        return "modelopt_mxfp8"


def _kv_cache_algo(fields: dict[str, Any], q: dict[str, Any]) -> str | None:
    """``"FP8"`` when the checkpoint declares calibrated FP8 KV-cache scales, ``None`` when
    it has none; anything else is refused. ModelOpt writes ``kv_cache_quant_algo``
    (hf_quant_config.json), or a compressed-tensors style ``kv_cache_scheme`` (config.json)."""
    algo = fields.get("kv_cache_quant_algo")
    scheme = q.get("kv_cache_scheme")
    if algo is None and isinstance(scheme, dict):
        algo = "FP8" if (scheme.get("type"), scheme.get("num_bits")) == ("float", 8) else repr(scheme)
    if algo is None:
        return None
    if str(algo).upper() != "FP8":
        raise ConfigError(
            f"quantization_config.kv_cache_quant_algo={algo!r} is not supported; vframe applies ModelOpt's FP8 "
            "KV-cache scales (kv_cache_quant_algo 'FP8') with kv_cache_dtype='fp8'"
        )
    return "FP8"


class ModelOptChannelFp8Method(NaiveMethod):
    """FP8_PER_CHANNEL_PER_TOKEN: e4m3 weights with a float32 scale per output row, stored
    as ``[out]`` (compressed-tensors stores ``[out, 1]``)."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype)
        register_weight(layer, "weight_scale", torch.empty(sum(output_partition_sizes), dtype=torch.float32),
                        {"output_dim": 0})  # [out]


class ModelOptBlockFp8Method(BlockFp8Method):
    """FP8_PB_WO: 128 x 128 block scales, stored as ``[out blocks, 1, in blocks, 1]``."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       input_size: int, output_size: int, params_dtype: torch.dtype) -> None:
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                               params_dtype)
        param = getattr(layer, self.scale_name)
        load_blocks = param.weight_loader

        def load(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
            if loaded_weight.dim() == 4:  # [out blocks, 1, in blocks, 1]
                loaded_weight = loaded_weight.reshape(loaded_weight.shape[0], loaded_weight.shape[2])
            load_blocks(param, loaded_weight, shard_id)

        param.weight_loader = load


class ModelOptFp4Method(Fp4Method):
    """NVFP4 / W4A16_NVFP4: compressed-tensors' NVFP4 tensors under ModelOpt's names, the
    global scale a multiplier (``weight_scale_2``) rather than a divisor."""

    packed_name, global_scale_name, input_scale_name = "weight", "weight_scale_2", "input_scale"
    checkpoint_params = (packed_name, "weight_scale", global_scale_name, input_scale_name)

    def global_scale(self, layer: nn.Module) -> torch.Tensor:
        # The kernels divide by a global scale: ModelOpt's multiplier inverted (in float64, then
        # rounded once), which moves a weight by at most a float32 rounding.
        return (1.0 / over_shard_rows(layer, layer.weight_scale_2).double()).float()
