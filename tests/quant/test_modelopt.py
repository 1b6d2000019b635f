"""NVIDIA ModelOpt checkpoints (quant_method: modelopt): the tensors export_hf_checkpoint
writes, read back exactly. The checkpoints ModelOpt itself makes from SmolLM2 are
tests/quant_real's (`make test-quant`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from vframe import LLM
from vframe.errors import ConfigError
from vframe.layers.linear import MergedColumnParallelLinear, QKVParallelLinear
from vframe.plugins import get_registry
from vframe.quant.compressed_tensors import NaiveMethod
from vframe.quant.modelopt import (
    ModelOptBlockFp8Method, ModelOptChannelFp8Method, ModelOptConfig, ModelOptFp4Config, ModelOptFp4Method,
    ModelOptMxFp8Config,
)
from vframe.testing.models import assert_matches_transformers
from vframe.testing.quant import check_quant_method
from fp8_blocks import fp8_block_quantize
from packers import (
    CTQuantized, NVFP4Quantized, cast_to_fp4, ct_fp8_quantize, load_tensors, mxfp8_quantize, pack_fp4_to_uint8,
    random_weight, write_quantized_llama,
)


def quant_config(algo: str, exclude: list[str] | None = None, **more: Any) -> dict[str, Any]:
    """config.json's quantization_config as ModelOpt 0.47 writes it (beside hf_quant_config.json)."""
    return {"quant_method": "modelopt", "quant_algo": algo, "ignore": ["lm_head"] if exclude is None else exclude,
            "producer": {"name": "modelopt", "version": "0.47.0"}, **more}


def fp8_tensor(w: torch.Tensor, generator: torch.Generator | None = None) -> CTQuantized:
    """FP8: one e4m3 weight and float32 scalar scales a module (``weight_scale``, ``input_scale``)."""
    packed = ct_fp8_quantize(w, strategy="tensor", static_input=True)
    packed.tensors = {"weight": packed.tensors["weight"],
                      "weight_scale": packed.tensors["weight_scale"].float().reshape(()),
                      "input_scale": packed.tensors["input_scale"].reshape(())}
    return packed


def fp8_channel(w: torch.Tensor, generator: torch.Generator | None = None) -> CTQuantized:
    """FP8_PER_CHANNEL_PER_TOKEN: a float32 scale per output row, stored [out]."""
    packed = ct_fp8_quantize(w, strategy="channel")
    packed.tensors = {"weight": packed.tensors["weight"], "weight_scale": packed.tensors["weight_scale"].float()[:, 0]}
    return packed


@dataclass
class Blocks:
    tensors: dict[str, torch.Tensor]
    dequantized: torch.Tensor  # [out, in] float32

    def weight(self) -> torch.Tensor:  # [out, in] float64: what the checkpoint means
        return self.dequantized.double()


def fp8_blocks(w: torch.Tensor, generator: torch.Generator | None = None) -> Blocks:
    """FP8_PB_WO: 128 x 128 block scales, stored [out blocks, 1, in blocks, 1]."""
    q, scales, dequantized = fp8_block_quantize(w, (128, 128))
    return Blocks({"weight": q, "weight_scale": scales.reshape(scales.shape[0], 1, scales.shape[1], 1)}, dequantized)


def nvfp4(w: torch.Tensor, generator: torch.Generator | None = None, *, power_of_two: bool = True) -> NVFP4Quantized:
    """NVFP4 as ModelOpt computes it: ``weight_scale_2 = max |w| / (448 * 6)`` (rounded up to a
    power of two unless ``power_of_two`` is false: then vframe's inverted global scale is exact),
    each group of 16's scale ``max |w_g| / 6 / weight_scale_2`` in e4m3, codes ``e2m1(w / (scale *
    weight_scale_2))``; ``input_scale`` as a W4A4 export has it."""
    w = w.float()
    scale_2 = w.abs().amax().clamp(min=1e-30) / (448 * 6)
    if power_of_two:
        scale_2 = 2.0 ** torch.ceil(torch.log2(scale_2))
    group_max = w.view(w.shape[0], -1, 16).abs().amax(dim=-1)  # [out, in / 16]
    scales = (group_max / 6 / scale_2).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.where(scales.float() == 0, torch.tensor(0.125).to(torch.float8_e4m3fn), scales)
    values = cast_to_fp4(w / (scales.float() * scale_2).repeat_interleave(16, dim=1))
    tensors = {"weight": pack_fp4_to_uint8(values), "weight_scale": scales, "weight_scale_2": scale_2.reshape(()),
               "input_scale": torch.tensor(0.01)}
    return NVFP4Quantized(tensors, values, scales.float(), (1 / scale_2).reshape(1))


def dequantized_nvfp4(packed: NVFP4Quantized) -> torch.Tensor:  # [out, in] float64, ModelOpt's definition
    scale_2 = packed.tensors["weight_scale_2"].double()
    return packed.values.double() * (packed.scales.double() * scale_2).repeat_interleave(16, dim=1)


CONFORMANCE = {"FP8": fp8_tensor, "FP8_PER_CHANNEL_PER_TOKEN": fp8_channel, "FP8_PB_WO": fp8_blocks,
               "MXFP8": lambda w, generator=None: mxfp8_quantize(w), "NVFP4": nvfp4, "W4A16_NVFP4": nvfp4}


def _tensors(algo: str):
    make = CONFORMANCE[algo]
    drop = ("input_scale",) if algo == "W4A16_NVFP4" else ()
    return lambda w: {k: v for k, v in make(w).tensors.items() if k not in drop}


@pytest.mark.parametrize("algo", CONFORMANCE)
def test_conforms_on_every_layer_kind(algo: str) -> None:
    # fused q/k/v and gate/up shards each with their own scales, tensor-parallel ranks 1 and 2 (FP8_PB_WO:
    # one rank; two would cut the kit's projections of 32 to 256 rows inside its 128-row blocks, refused)
    check_quant_method("modelopt", hf_quant_config=quant_config(algo), checkpoint_tensors=_tensors(algo),
                       quick=algo == "FP8_PB_WO")


@pytest.mark.parametrize("algo", CONFORMANCE)
def test_bfloat16_activations_conform(algo: str) -> None:
    check_quant_method("modelopt", hf_quant_config=quant_config(algo), checkpoint_tensors=_tensors(algo),
                       dtype=torch.bfloat16, quick=True)


def test_modelopt_is_a_builtin_quantizer_with_vllm_s_names_for_two_algorithms() -> None:
    registry = get_registry("quantizer")
    assert registry.load("modelopt") is ModelOptConfig
    assert (registry.load("modelopt_fp4"), registry.load("modelopt_mxfp8")) == (ModelOptFp4Config, ModelOptMxFp8Config)
    assert ModelOptFp4Config.from_config(quant_config("NVFP4")).algo == "NVFP4"
    assert ModelOptMxFp8Config.from_config(quant_config("MXFP8")).algo == "MXFP8"
    with pytest.raises(ConfigError) as info:
        ModelOptFp4Config.from_config(quant_config("FP8"))
    assert str(info.value) == ("quantization='modelopt_fp4' reads ModelOpt NVFP4 / W4A16_NVFP4 checkpoints; this one "
                               "is quant_algo 'FP8': use quantization='modelopt', or leave quantization unset")


def test_fp8_weight_is_the_e4m3_values_times_each_module_s_scale() -> None:
    config = ModelOptConfig.from_config(quant_config("FP8"))
    layer = QKVParallelLinear(64, 16, 2, 1, bias=False, quant_config=config, prefix="l.qkv_proj")
    shards = {s: fp8_tensor(random_weight(n, 64, i) * 10**i)
              for i, (s, n) in enumerate((("q", 32), ("k", 16), ("v", 16)))}
    for shard_id, packed in shards.items():
        assert packed.tensors["weight_scale"].shape == ()  # ModelOpt's scalars
        load_tensors(layer, packed.tensors, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    assert isinstance(layer.quant_method, NaiveMethod) and layer.quant_method.kernel.name == "fp8_cpu"
    assert layer.input_scale is None  # static activation scales: read, not used
    expected = torch.cat([shards[s].weight() for s in "qkv"])
    assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), expected)


def test_channel_and_block_fp8_read_their_scale_shapes() -> None:
    channel = ModelOptConfig.from_config(quant_config("FP8_PER_CHANNEL_PER_TOKEN"))
    blocks = ModelOptConfig.from_config(quant_config("fp8_pb_wo"))  # as ModelOpt writes it: lower case
    for config, make, method in ((channel, fp8_channel, ModelOptChannelFp8Method),
                                 (blocks, fp8_blocks, ModelOptBlockFp8Method)):
        # SmolLM2's MLP: gate and up 1536 rows (12 blocks), 576 inputs (4.5 blocks of 128)
        layer = MergedColumnParallelLinear(576, [1536, 1536], bias=False, quant_config=config, prefix="l.gate_up_proj")
        packed = [make(random_weight(1536, 576, seed)) for seed in (0, 1)]
        for shard_id, p in enumerate(packed):
            load_tensors(layer, p.tensors, shard_id)
        layer.quant_method.process_weights_after_loading(layer)
        assert isinstance(layer.quant_method, method) and layer.quant_method.kernel.name == "fp8_cpu"
        expected = torch.cat([p.weight() for p in packed])
        assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), expected)
    assert tuple(packed[0].tensors["weight_scale"].shape) == (12, 1, 5, 1)


def test_nvfp4_weight_is_the_e2m1_values_times_each_group_scale_times_its_module_s_scale_2() -> None:
    config = ModelOptConfig.from_config(quant_config("W4A16_NVFP4", group_size=16))
    layer = QKVParallelLinear(64, 16, 2, 1, bias=False, quant_config=config, prefix="l.qkv_proj")
    shards = {s: nvfp4(random_weight(n, 64, i) * 10**i) for i, (s, n) in enumerate((("q", 32), ("k", 16), ("v", 16)))}
    assert len({float(p.tensors["weight_scale_2"]) for p in shards.values()}) == 3
    for shard_id, packed in shards.items():
        load_tensors(layer, {k: v for k, v in packed.tensors.items() if k != "input_scale"}, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    assert isinstance(layer.quant_method, ModelOptFp4Method) and layer.quant_method.kernel.name == "fp4_cpu"
    expected = torch.cat([dequantized_nvfp4(shards[s]) for s in "qkv"])
    assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), expected)
    held = {name: t.nbytes for name, t in layer.named_buffers()} | {n: p.nbytes for n, p in layer.named_parameters()}
    assert sum(held.values()) == 64 * 64 // 2 + 64 * 64 // 16 + 64 * 4, held  # codes, e4m3 bytes, a scale a row


def test_an_nvfp4_scale_2_that_is_no_power_of_two_moves_a_weight_by_a_float32_rounding() -> None:
    # vframe's FP4 kernels divide by a global scale: 1 / weight_scale_2, rounded once to float32
    config = ModelOptConfig.from_config(quant_config("NVFP4"))
    layer = QKVParallelLinear(64, 16, 2, 1, bias=False, quant_config=config, prefix="l.qkv_proj")
    shards = {s: nvfp4(random_weight(n, 64, i) * 3**i, power_of_two=False)
              for i, (s, n) in enumerate((("q", 32), ("k", 16), ("v", 16)))}
    for shard_id, packed in shards.items():
        load_tensors(layer, packed.tensors, shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    expected = torch.cat([dequantized_nvfp4(shards[s]) for s in "qkv"])
    got = layer.quant_method.dequantize_weight(layer).double()
    assert not torch.equal(got, expected)
    assert torch.allclose(got, expected, rtol=2**-22, atol=0)


@pytest.mark.parametrize(
    ("q", "message"),
    [
        (quant_config("INT4_AWQ"), "quantization_config.quant_algo='INT4_AWQ' is not supported; vframe serves FP8, "
         "FP8_PER_CHANNEL_PER_TOKEN, FP8_PB_WO, MXFP8, NVFP4, W4A16_NVFP4 (weights; activations stay in the model's "
         "dtype)"),
        (quant_config("MXFP8", group_size=16), "quantization_config.group_size=16: MXFP8 scales groups of 32"),
        (quant_config("NVFP4", group_size=32), "quantization_config.group_size=32: NVFP4 scales groups of 16"),
        (quant_config("FP8", kv_cache_quant_algo="NVFP4"), "quantization_config.kv_cache_quant_algo='NVFP4' is not "
         "supported; vframe applies ModelOpt's FP8 KV-cache scales (kv_cache_quant_algo 'FP8') with "
         "kv_cache_dtype='fp8'"),
        ({"quant_method": "gptq", "bits": 4}, "quantization='modelopt' reads a ModelOpt checkpoint; this one is "
         "quantized as 'gptq'"),
    ],
    ids=["algo", "mxfp8-group", "group", "kv", "method"],
)
def test_what_it_cannot_serve_is_refused_naming_it(q: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        ModelOptConfig.from_config(q)
    assert str(info.value) == message


def test_both_layouts_of_the_config_and_the_kv_cache_declaration() -> None:
    # hf_quant_config.json nests the fields under "quantization" and names the KV cache's algorithm;
    # config.json holds them flat with a compressed-tensors style kv_cache_scheme
    nested = ModelOptConfig.from_config({"quant_method": "modelopt", "producer": {"name": "modelopt"}, "quantization": {
        "quant_algo": "FP8", "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head", "model.layers.0.mlp*"]}})
    flat = ModelOptConfig.from_config(quant_config("FP8", exclude=["lm_head", "model.layers.0.mlp*"],
                                                   kv_cache_scheme={"dynamic": False, "num_bits": 8, "type": "float"}))
    for config in (nested, flat):
        assert (config.algo, config.kv_cache_algo, config.calibrated_kv_cache) == ("FP8", "FP8", True)
        assert config.exclude_modules == ["lm_head", "model.layers.0.mlp*"]
    assert ModelOptConfig.from_config(quant_config("FP8")).calibrated_kv_cache is False


def test_exclude_modules_are_names_subtrees_and_patterns() -> None:
    config = ModelOptConfig.from_config(quant_config("FP8", exclude=["lm_head", "model.layers.1", "*.mlp.down_proj"]))

    def quantized(prefix: str) -> bool:
        layer = QKVParallelLinear(64, 16, 2, 1, bias=False, prefix=prefix)
        return config.get_quant_method(layer, prefix) is not None

    assert quantized("model.layers.0.self_attn.qkv_proj")
    assert not quantized("model.layers.1.self_attn.qkv_proj")  # a module above it
    assert not quantized("model.layers.0.mlp.down_proj")  # fnmatch
    assert not quantized("lm_head") and not config.quantizes_lm_head()
    partly = ModelOptConfig.from_config(quant_config("FP8", exclude=["*.k_proj"]))
    with pytest.raises(ConfigError, match="vframe fuses .* into one layer, but quantization_config.exclude_modules"):
        partly.get_quant_method(QKVParallelLinear(64, 16, 2, 1, bias=False), "model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize(("algo", "quantization"), [("FP8", None), ("MXFP8", "modelopt_mxfp8"),
                                                    ("NVFP4", "modelopt_fp4")])
def test_a_llama_generates_what_transformers_does_with_the_dequantized_weights(
    tmp_path: Path, algo: str, quantization: str | None
) -> None:
    hf_model = write_quantized_llama(tmp_path, quant_config(algo), CONFORMANCE[algo], intermediate_size=128)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2,
              quantization=quantization)  # None: config.json's quant_method, "modelopt"
    assert llm.llm_engine.model_runner.quant_config.get_name() == (quantization or "modelopt")
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 40)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=12)


def test_an_export_that_describes_itself_in_hf_quant_config_json_only(tmp_path: Path) -> None:
    """Older ModelOpt exports leave config.json without quantization_config: vframe reads
    hf_quant_config.json then, as vLLM does."""
    hf_model = write_quantized_llama(tmp_path, quant_config("FP8"), fp8_tensor)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "hf_quant_config.json").write_text(json.dumps({
        "producer": {"name": "modelopt", "version": "0.19.0"},
        "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None, "exclude_modules": ["lm_head"]},
    }))
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    assert repr(llm.llm_engine.model_runner.quant_config) == (
        "ModelOptConfig(algo='FP8', exclude_modules=['lm_head'], kv_cache_algo=None)")
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=8)


def test_a_float_checkpoint_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="quantization='modelopt' reads a checkpoint exported by NVIDIA ModelOpt"):
        ModelOptConfig.from_config(None)
