"""compressed-tensors checkpoints: the tensors llm-compressor saves, read back exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vframe import LLM
from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, ReplicatedLinear
from vframe.plugins import get_registry
from vframe.quant.compressed_tensors import CompressedTensorsConfig, Fp4Method, Mxfp8Method, NaiveMethod, PackedMethod
from vframe.testing.models import assert_matches_transformers
from vframe.testing.quant import check_quant_method
from fp8_blocks import fp8_block_quantize
from defaults import BF16_INT4
from packers import (
    cast_to_fp4, ct_fp8_quantize, ct_int_quantize, ct_mxfp4_quantize, ct_nvfp4_quantize, load_tensors, mxfp8_quantize,
    pack_fp4_to_uint8, random_weight,
    PROJECTIONS, assert_head_quantized, generates_like_transformers, pack_to_int32, write_quantized_llama,
)


def weights(num_bits: int = 4, type: str = "int", strategy: str = "group", group_size: int | None = 128,
            symmetric: bool = True) -> dict[str, Any]:
    return {"num_bits": num_bits, "type": type, "strategy": strategy, "group_size": group_size,
            "symmetric": symmetric, "dynamic": False, "actorder": None}


INT8_TOKEN = {"num_bits": 8, "type": "int", "strategy": "token", "symmetric": True, "dynamic": True}
FP8_TOKEN = {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True, "dynamic": True}
FP8_STATIC = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
NVFP4_WEIGHTS = {**weights(4, "float", "tensor_group", 16), "scale_dtype": "torch.float8_e4m3fn"}
MXFP4_WEIGHTS = {**weights(4, "float", "group", 32), "scale_dtype": "torch.uint8"}
MXFP8_WEIGHTS = {**weights(8, "float", "group", 32), "scale_dtype": "torch.uint8"}
NVFP4_INPUTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
                "dynamic": "local", "observer": "static_minmax"}  # the NVFP4 (W4A4) preset's activations
FP8_GROUP = {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 128, "symmetric": True,
             "dynamic": True}  # FP8_BLOCK's activations

# what llm-compressor writes for kv_cache_scheme (its FP8 KV cache: static per-tensor scales)
FP8_KV_SCHEME = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True,
                 "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
                 "observer_kwargs": {}}



def fp8_block_weights(block: list[int]) -> dict[str, Any]:
    return {**weights(8, "float", "block", None), "block_structure": block}


def fp8_block_tensors(block: tuple[int, int]):
    def tensors(w: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales, _ = fp8_block_quantize(w, block)
        return {"weight": q, "weight_scale": scales}

    return tensors


def quant_config(fmt: str, w: dict, activations: dict | None = None, ignore: list[str] | None = None,
                 targets: list[str] | None = None, **more: Any) -> dict[str, Any]:
    """A config.json quantization_config as llm-compressor writes it."""
    group = {"targets": targets or ["Linear"], "weights": w, "input_activations": activations,
             "output_activations": None, "format": fmt}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"] if ignore is None else ignore,
            "kv_cache_scheme": None, "sparsity_config": {}, **more}


def test_signed_values_are_stored_plus_the_offset_lowest_bits_first() -> None:
    # -8, -7, 0, 1, 2, 3, 4, 7 stored as 0, 1, 8, 9, 10, 11, 12, 15: value j of a word in bits 4j .. 4j+3
    words = pack_to_int32(torch.tensor([[-8, -7, 0, 1, 2, 3, 4, 7]]), 4)
    assert words.tolist() == [[to_signed(0xFCBA9810)]]
    assert pack_to_int32(torch.tensor([[-128, 0, 1, 127]]), 8).tolist() == [[to_signed(0xFF818000)]]


def to_signed(word: int) -> int:
    return word - 2**32 if word >= 2**31 else word


@pytest.mark.parametrize(
    ("bits", "strategy", "group_size", "symmetric"),
    [(4, "group", 32, True), (4, "group", 48, False), (8, "group", 40, False), (8, "channel", None, True),
     (4, "channel", None, False)],
)
def test_packed_weight_is_the_unpacked_integers_times_the_scales(
    bits: int, strategy: str, group_size: int | None, symmetric: bool
) -> None:
    in_features, out_features = 200, 72  # groups of 48 / 40: partial or whole last group
    w = random_weight(out_features, in_features, seed=bits)
    packed = ct_int_quantize(w, bits=bits, strategy=strategy, group_size=group_size, symmetric=symmetric)
    config = CompressedTensorsConfig.from_config(
        quant_config("pack-quantized", weights(bits, "int", strategy, group_size, symmetric))
    )
    layer = ReplicatedLinear(in_features, out_features, bias=False, quant_config=config, prefix="x.down_proj")
    load_tensors(layer, packed.tensors)
    assert isinstance(layer.quant_method, PackedMethod)
    assert tuple(layer.weight_packed.shape) == (out_features, in_features * bits // 32)
    if not symmetric:
        assert int(packed.zeros[0].min()) == -(2 ** (bits - 1))  # the lowest zero point is exercised
    layer.quant_method.process_weights_after_loading(layer)
    w_deq = layer.quant_method.dequantize_weight(layer)
    assert torch.equal(w_deq.double(), packed.weight())  # exact: a bf16 scale times a small integer
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(3))
    reference = x.double() @ packed.weight().T
    assert float((layer(x).double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


@pytest.mark.parametrize(("strategy", "group_size", "symmetric"), [("group", 64, False), ("channel", None, True)])
def test_bfloat16_on_cpu_takes_the_4_bit_kernel(strategy: str, group_size: int | None, symmetric: bool) -> None:
    in_features, out_features = 256, 48
    packed = ct_int_quantize(random_weight(out_features, in_features, 7), bits=4, strategy=strategy,
                             group_size=group_size, symmetric=symmetric)
    config = CompressedTensorsConfig.from_config(
        quant_config("pack-quantized", weights(4, "int", strategy, group_size, symmetric))
    )
    layer = ReplicatedLinear(in_features, out_features, bias=False, quant_config=config, params_dtype=torch.bfloat16)
    load_tensors(layer, packed.tensors)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()

    out = layer(x)

    assert layer.quant_method.kernel.name == BF16_INT4 and out.dtype == torch.bfloat16
    reference = x.double() @ packed.weight().T
    # bfloat16 scales, zeros and output: a few 2**-8
    assert float((out.double() - reference).abs().max()) <= 2**-6 * float(reference.abs().max())


@pytest.mark.parametrize(("fmt", "strategy"), [("float-quantized", "tensor"), ("float-quantized", "channel")])
def test_fp8_weight_is_the_e4m3_values_times_the_scales(fmt: str, strategy: str) -> None:
    config = CompressedTensorsConfig.from_config(quant_config(fmt, weights(8, "float", strategy, None), FP8_STATIC))
    layer = QKVParallelLinear(64, 16, 2, 1, bias=False, quant_config=config, prefix="l.qkv_proj")
    shards = {s: ct_fp8_quantize(random_weight(n, 64, i), strategy=strategy, static_input=True)
              for i, (s, n) in enumerate((("q", 32), ("k", 16), ("v", 16)))}
    for shard_id, packed in shards.items():
        load_tensors(layer, packed.tensors, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    assert isinstance(layer.quant_method, NaiveMethod) and layer.weight.dtype == torch.float8_e4m3fn
    expected = torch.cat([shards[s].weight() for s in "qkv"])
    assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), expected)


def test_fp8_block_weight_keeps_each_shard_s_partial_blocks() -> None:
    # FP8_BLOCK on SmolLM2's MLP: gate and up 1536 rows (12 blocks), 576 inputs (4.5 blocks of 128)
    config = CompressedTensorsConfig.from_config(
        quant_config("float-quantized", fp8_block_weights([128, 128]), FP8_GROUP)
    )
    layer = MergedColumnParallelLinear(576, [1536, 1536], bias=False, quant_config=config, prefix="l.gate_up_proj")
    packed = [fp8_block_quantize(random_weight(1536, 576, seed), (128, 128)) for seed in (0, 1)]
    for shard_id, (q, scales, _) in enumerate(packed):
        load_tensors(layer, {"weight": q, "weight_scale": scales}, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    assert layer.weight.dtype == torch.float8_e4m3fn and tuple(layer.weight_scale.shape) == (24, 5)
    assert torch.equal(layer.quant_method.dequantize_weight(layer), torch.cat([p[2] for p in packed]))


def test_fp4_codes_are_packed_two_a_byte_first_value_low_sign_in_bit_3() -> None:
    values = torch.tensor([[0.5, -6.0, 0.0, -0.0, 1.5, 3.0, -0.5, 4.0]])
    # codes 1, 15, 0, 8, 3, 5, 9, 6 -> bytes 0xF1, 0x80, 0x53, 0x69
    assert pack_fp4_to_uint8(values).tolist() == [[0xF1, 0x80, 0x53, 0x69]]
    assert cast_to_fp4(torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 2.6, 5.0, 5.1, 100.0, -0.74])).tolist() == [
        0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 3.0, 4.0, 6.0, 6.0, -0.5]


def test_nvfp4_weight_is_the_e2m1_values_times_each_group_scale_over_its_shard_s_global_scale() -> None:
    config = CompressedTensorsConfig.from_config(quant_config("nvfp4-pack-quantized", NVFP4_WEIGHTS))
    layer = QKVParallelLinear(64, 16, 2, 1, bias=False, quant_config=config, prefix="l.qkv_proj")
    # each shard its own global scale (their largest |w| differ by 10x)
    shards = {s: ct_nvfp4_quantize(random_weight(n, 64, i) * 10**i)
              for i, (s, n) in enumerate((("q", 32), ("k", 16), ("v", 16)))}
    assert len({float(p.global_scale) for p in shards.values()}) == 3
    for shard_id, packed in shards.items():
        load_tensors(layer, packed.tensors, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    assert isinstance(layer.quant_method, Fp4Method) and layer.quant_method.kernel.name == "fp4_cpu"
    expected = torch.cat([shards[s].weight() for s in "qkv"])
    assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), expected)
    # what the layer holds: the packed codes, the e4m3 scale bytes and a float32 global scale per row
    held = {name: t.nbytes for name, t in layer.named_buffers()} | {n: p.nbytes for n, p in layer.named_parameters()}
    assert sum(held.values()) == 64 * 64 // 2 + 64 * 64 // 16 + 64 * 4, held
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(layer(x).double(), x.double() @ expected.T, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_mxfp4_weight_is_the_e2m1_values_times_each_group_s_power_of_two() -> None:
    config = CompressedTensorsConfig.from_config(quant_config("mxfp4-pack-quantized", MXFP4_WEIGHTS))
    layer = MergedColumnParallelLinear(64, [32, 48], bias=False, quant_config=config, prefix="l.gate_up_proj")
    shards = [ct_mxfp4_quantize(random_weight(n, 64, i) * 64.0**i) for i, n in enumerate((32, 48))]  # 2^-4 .. 2^3
    shards[0].tensors["weight_scale"][0, 0] = 0  # 2 ** -127, a subnormal
    shards[0].scales[0, 0] = 2.0**-127
    for shard_id, packed in enumerate(shards):
        load_tensors(layer, packed.tensors, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    assert layer.quant_method.kernel.name == "fp4_cpu"
    expected = torch.cat([p.weight() for p in shards])
    assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), expected)
    held = {name: t.nbytes for name, t in layer.named_buffers()} | {n: p.nbytes for n, p in layer.named_parameters()}
    assert sum(held.values()) == 80 * 64 // 2 + 80 * 64 // 32 + 80 * 4, held  # codes, e8m0 bytes, ones per row
    assert shards[1].tensors["weight_scale"].dtype == torch.uint8 and int(shards[1].tensors["weight_scale"].max()) > 127


def test_mxfp8_weight_is_the_e4m3_values_times_each_group_s_power_of_two() -> None:
    config = CompressedTensorsConfig.from_config(quant_config("mxfp8-quantized", MXFP8_WEIGHTS))
    layer = MergedColumnParallelLinear(64, [32, 48], bias=False, quant_config=config, prefix="l.gate_up_proj")
    # the second shard's scales near e8m0's bottom (2 ** -110 or so)
    shards = [mxfp8_quantize(random_weight(n, 64, i) * factor)
              for i, (n, factor) in enumerate(((32, 0.5), (48, 2.0**-100)))]
    shards[1].tensors["weight_scale"][0, 0] = 0  # 2 ** -127, a subnormal
    shards[1].scales[0, 0] = 2.0**-127
    for shard_id, packed in enumerate(shards):
        load_tensors(layer, packed.tensors, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    assert isinstance(layer.quant_method, Mxfp8Method) and layer.quant_method.kernel.name == "fp8_cpu"
    expected = torch.cat([p.weight() for p in shards])
    assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), expected)
    tensors = [*layer.buffers(), *layer.parameters()]
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}  # each storage once
    assert sum(held.values()) == 80 * 64 + 80 * 64 // 32 * 4, held  # the e4m3 bytes once, a float32 scale a group
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(layer(x).double(), x.double() @ expected.T, rtol=0, atol=1e-5 * float(expected.abs().max()))


def test_an_mxfp8_scale_byte_of_255_is_refused() -> None:
    config = CompressedTensorsConfig.from_config(quant_config("mxfp8-quantized", MXFP8_WEIGHTS))
    layer = ReplicatedLinear(64, 32, bias=False, quant_config=config, prefix="model.layers.0.mlp.down_proj")
    packed = mxfp8_quantize(random_weight(32, 64, 0))
    packed.tensors["weight_scale"][3, 1] = 0xFF
    load_tensors(layer, packed.tensors)
    with pytest.raises(ModelLoadError, match="model.layers.0.mlp.down_proj: a scale byte is 0xFF, e8m0's NaN"):
        layer.quant_method.process_weights_after_loading(layer)


def test_an_nvfp4_w4a4_checkpoint_runs_weight_only_and_says_so(caplog) -> None:
    with caplog.at_level("WARNING", logger="vframe.quant.compressed_tensors"):
        config = CompressedTensorsConfig.from_config(quant_config("nvfp4-pack-quantized", NVFP4_WEIGHTS, NVFP4_INPUTS))
    assert "activations in the model's dtype" in caplog.text
    layer = ReplicatedLinear(64, 32, bias=False, quant_config=config, prefix="o_proj")
    packed = ct_nvfp4_quantize(random_weight(32, 64, 0), input_global_scale=True)
    load_tensors(layer, packed.tensors)
    layer.quant_method.process_weights_after_loading(layer)

    assert not hasattr(layer, "input_global_scale") and not hasattr(layer, "weight_packed")
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(2))
    assert torch.allclose(layer(x).double(), x.double() @ packed.weight().T, rtol=0, atol=1e-5)


def test_w8a8_quantizes_each_token_to_int8() -> None:
    config = CompressedTensorsConfig.from_config(
        quant_config("int-quantized", weights(8, "int", "channel", None), INT8_TOKEN)
    )
    layer = ReplicatedLinear(64, 32, bias=False, quant_config=config, prefix="o_proj")
    packed = ct_int_quantize(random_weight(32, 64, 0), bits=8, strategy="channel", packed=False)
    load_tensors(layer, packed.tensors)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.tensor([[1.0, -0.5] * 32, [127.0] + [1.0] * 63])  # token 1's step is 1: its ones stay exact

    out = layer(x)

    assert layer.quant_method.kernel.name == "int8_dynamic"
    x_scale = x.abs().amax(dim=1, keepdim=True) / 127
    x_int = torch.round(x / x_scale).double()
    expected = (x_int @ packed.q.double().T) * x_scale.double() * packed.scales.double().T
    assert torch.allclose(out.double(), expected, rtol=1e-6, atol=0)


CONFORMANCE = {
    "W4A16 group": (quant_config("pack-quantized", weights(4, "int", "group", 64)),
                    lambda w: ct_int_quantize(w, bits=4, strategy="group", group_size=64).tensors),
    "W4A16 asymmetric": (quant_config("pack-quantized", weights(4, "int", "group", 32, symmetric=False)),
                         lambda w: ct_int_quantize(w, bits=4, strategy="group", group_size=32,
                                                   symmetric=False).tensors),
    "W8A16 channel": (quant_config("pack-quantized", weights(8, "int", "channel", None)),
                      lambda w: ct_int_quantize(w, bits=8, strategy="channel").tensors),
    "W8A8 int8": (quant_config("int-quantized", weights(8, "int", "channel", None), INT8_TOKEN),
                  lambda w: ct_int_quantize(w, bits=8, strategy="channel", packed=False).tensors),
    "W8A16 naive int8": (quant_config("naive-quantized", weights(8, "int", "channel", None)),
                         lambda w: ct_int_quantize(w, bits=8, strategy="channel", packed=False).tensors),
    "FP8 tensor": (quant_config("float-quantized", weights(8, "float", "tensor", None), FP8_STATIC),
                   lambda w: ct_fp8_quantize(w, strategy="tensor", static_input=True).tensors),
    "FP8 channel": (quant_config("float-quantized", weights(8, "float", "channel", None), FP8_TOKEN),
                    lambda w: ct_fp8_quantize(w, strategy="channel").tensors),
    "FP8 block": (quant_config("float-quantized", fp8_block_weights([32, 64]), FP8_GROUP),
                  fp8_block_tensors((32, 64))),
    "NVFP4A16": (quant_config("nvfp4-pack-quantized", NVFP4_WEIGHTS), lambda w: ct_nvfp4_quantize(w).tensors),
    "MXFP4A16": (quant_config("mxfp4-pack-quantized", MXFP4_WEIGHTS), lambda w: ct_mxfp4_quantize(w).tensors),
    "MXFP8A16": (quant_config("mxfp8-quantized", MXFP8_WEIGHTS), lambda w: mxfp8_quantize(w).tensors),
}


@pytest.mark.parametrize("scheme", CONFORMANCE)
def test_conforms_on_every_layer_kind(scheme: str) -> None:
    config, tensors = CONFORMANCE[scheme]
    check_quant_method("compressed-tensors", hf_quant_config=config, checkpoint_tensors=tensors)


@pytest.mark.parametrize("scheme", ["W4A16 group", "W8A8 int8", "FP8 channel", "FP8 block", "NVFP4A16", "MXFP4A16",
                                    "MXFP8A16"])  # W4A16: int4 kernel
def test_bfloat16_activations_conform(scheme: str) -> None:
    config, tensors = CONFORMANCE[scheme]
    check_quant_method("compressed-tensors", hf_quant_config=config, checkpoint_tensors=tensors,
                       dtype=torch.bfloat16, quick=True)


def test_compressed_tensors_is_a_builtin_quantizer() -> None:
    assert get_registry("quantizer").load("compressed-tensors") is CompressedTensorsConfig


def test_layers_map_to_schemes_by_targets_and_ignore() -> None:
    q = quant_config("pack-quantized", weights(4, "int", "group", 32), ignore=["lm_head", "re:.*mlp\\.down_proj$"])
    q["config_groups"]["group_1"] = {"targets": ["re:.*self_attn\\..*"], "weights": weights(8, "int", "channel", None),
                                     "format": "pack-quantized"}
    config = CompressedTensorsConfig.from_config(q)
    layer = ReplicatedLinear(64, 64)

    def bits(prefix: str) -> int | None:
        method = config.get_quant_method(layer, prefix)
        return None if method is None else method.scheme.num_bits

    assert bits("model.layers.0.self_attn.qkv_proj") == 8  # regex before the class "Linear"
    assert bits("model.layers.0.mlp.gate_up_proj") == 4
    assert bits("model.layers.0.mlp.down_proj") is None
    assert bits("lm_head") is None
    assert not config.quantizes_lm_head()
    # without lm_head in ignore the class "Linear" takes it, as llm-compressor quantizes an nn.Linear head
    unignored = quant_config("pack-quantized", weights(4), ignore=[])
    assert CompressedTensorsConfig.from_config(unignored).quantizes_lm_head()
    named = quant_config("pack-quantized", weights(4), targets=["re:.*mlp\\..*", "lm_head"], ignore=[])
    assert CompressedTensorsConfig.from_config(named).quantizes_lm_head()
    assert not CompressedTensorsConfig.from_config({**named, "ignore": ["re:.*head$"]}).quantizes_lm_head()


def test_fused_shards_in_groups_alike_share_a_scheme() -> None:
    q = quant_config("pack-quantized", weights(4, "int", "group", 32), targets=["re:.*q_proj$"])
    q["config_groups"]["group_1"] = {**q["config_groups"]["group_0"], "targets": ["re:.*[kv]_proj$"]}
    layer = QKVParallelLinear(64, 16, 2, 1, quant_config=CompressedTensorsConfig.from_config(q), prefix="a.qkv_proj")
    assert isinstance(layer.quant_method, PackedMethod)


def test_fused_shards_quantized_differently_are_refused() -> None:
    config = CompressedTensorsConfig.from_config(
        quant_config("pack-quantized", weights(4, "int", "group", 32), ignore=["model.layers.0.mlp.up_proj"])
    )
    with pytest.raises(ConfigError, match=r"fuses model.layers.0.mlp.gate_proj, model.layers.0.mlp.up_proj"):
        MergedColumnParallelLinear(64, [64, 64], quant_config=config, prefix="model.layers.0.mlp.gate_up_proj")


@pytest.mark.parametrize(
    ("q", "message"),
    [
        (quant_config("float-quantized", fp8_block_weights([128])),
         r"config_groups.group_0.weights.block_structure=\[128\]: expected two positive integers"),
        (quant_config("float-quantized", fp8_block_weights([128, 128]), FP8_STATIC),
         r"group_0 .*: static activation scales with block weights are not supported"),
        (quant_config("int-quantized", {**weights(8, "int", "block", None), "block_structure": [128, 128]}),
         r"group_0 \(int-quantized, int8 weights, strategy 'block'\): block scales are served for FP8"),
        (quant_config("pack-quantized", weights(4, "int", "group", 128), INT8_TOKEN),
         r"group_0 .*: input_activations with packed weights \(W4A8\) are not supported"),
        (quant_config("pack-quantized", weights(3, "int", "group", 128)), r"group_0 \(pack-quantized, int3 weights"),
        (quant_config("dense", None), r"config_groups.group_0.weights is null: vframe serves weight-quantized schemes"),
        # attention quantization with int8 (or dynamic) inputs: not a float8 KV cache
        (quant_config("dense", None, {**FP8_STATIC, "type": "int"}, targets=["LlamaAttention"]),
         r"config_groups.group_0.input_activations .* is not supported: vframe applies static float8 scales"),
        (quant_config("dense", None, FP8_TOKEN, targets=["LlamaAttention"]),
         r"config_groups.group_0.input_activations .* is not supported"),
        (quant_config("nvfp4-pack-quantized", weights(4, "float", "tensor_group", 32)),
         r"nvfp4-pack-quantized weights are served as float4, strategy 'tensor_group', group_size 16, symmetric; got .*group_size=32"),
        (quant_config("mxfp4-pack-quantized", weights(4, "float", "group", 16)),
         r"mxfp4-pack-quantized weights are served as float4, strategy 'group', group_size 32, .*group_size=16"),
        (quant_config("nvfp4-pack-quantized", NVFP4_WEIGHTS, INT8_TOKEN),
         r"with FP4 weights vframe reads float4 ones or none"),
        (quant_config("pack-quantized", {**weights(4), "actorder": "group"}), r"actorder='group'"),
        (quant_config("pack-quantized", weights(4), kv_cache_scheme={**FP8_KV_SCHEME, "type": "int"}),
         r"kv_cache_scheme .* is not supported: vframe applies static float8 scales \(type 'float', num_bits 8, "
         r"strategy 'tensor' or 'attn_head', dynamic false, symmetric\)"),
        (quant_config("pack-quantized", weights(4), kv_cache_scheme={**FP8_KV_SCHEME, "strategy": "channel"}),
         r"kv_cache_scheme .*'strategy': 'channel'.* is not supported"),
        (quant_config("pack-quantized", weights(4), kv_cache_scheme={**FP8_KV_SCHEME, "dynamic": True}),
         r"kv_cache_scheme .* is not supported"),
        ({"quant_method": "gptq", "bits": 4}, r"this one is quantized as 'gptq'"),
    ],
)
def test_what_it_cannot_serve_is_refused_naming_the_scheme(q: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        CompressedTensorsConfig.from_config(q)


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_attention_quantization_leaves_the_linears_float_and_reads_the_kv_scales(strategy: str) -> None:
    """llm-compressor's attention quantization: a weightless group targeting the attention modules
    with float8 inputs (q / k / v scales), and the kv_cache_scheme it implies; linears beside it
    quantized by their own groups."""
    inputs = {**FP8_STATIC, "strategy": strategy}
    attention = {"targets": ["LlamaAttention"], "weights": None, "input_activations": inputs, "format": "dense"}
    q = quant_config("pack-quantized", weights(4), kv_cache_scheme=inputs)
    config = CompressedTensorsConfig.from_config({**q, "config_groups": {"attention": attention}})
    assert config.schemes == [] and config.calibrated_kv_cache
    mixed = CompressedTensorsConfig.from_config({**q, "config_groups": {**q["config_groups"], "attention": attention}})
    assert [s.group for _, s in mixed.schemes] == ["group_0"] and mixed.calibrated_kv_cache


@pytest.mark.parametrize("strategy", ["tensor", "attn_head"])
def test_a_static_float8_kv_cache_scheme_is_read_as_the_layers_scales(strategy: str) -> None:
    # the scales themselves arrive as tensors, one a layer or one a KV head (tests/backends/test_fp8_kv_scales.py)
    config = CompressedTensorsConfig.from_config(
        quant_config("pack-quantized", weights(4), kv_cache_scheme={**FP8_KV_SCHEME, "strategy": strategy}))
    assert config.get_name() == "compressed-tensors" and config.calibrated_kv_cache


# --------------------------------------------------------------------------- #
# A whole model: a compressed-tensors tiny Llama == transformers holding the dequantized weights
# --------------------------------------------------------------------------- #

def test_a_kv_cache_scheme_needs_every_layer_s_scales_for_a_float8_cache(tmp_path: Path) -> None:
    """kv_cache_scheme says the checkpoint is calibrated: with kv_cache_dtype="fp8" each attention
    layer's k_scale / v_scale must be there (a missing one is refused, not run at 1.0); with
    "auto" they are not needed."""
    from safetensors.torch import load_file, save_file

    quant = quant_config("pack-quantized", weights(4, "int", "group", 32), kv_cache_scheme=FP8_KV_SCHEME)
    write_quantized_llama(tmp_path, quant, lambda w, generator: ct_int_quantize(w, bits=4, strategy="group",
                                                                                  group_size=32))
    common = dict(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", max_model_len=64)
    tensors = load_file(tmp_path / "model.safetensors")
    save_file({**tensors, "model.layers.0.self_attn.k_scale": torch.tensor([0.5]),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25])}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    with pytest.raises(ConfigError) as info:
        LLM(kv_cache_dtype="fp8", **common)
    assert str(info.value) == (
        "quantization_config.kv_cache_scheme says the checkpoint carries calibrated FP8 KV-cache scales, and it has "
        "none for 1 of its 2 attention layers (the first: layer 1); a float8 cache would run them at scale 1.0. Use "
        "kv_cache_dtype='auto', or a checkpoint with every layer's k_scale / v_scale"
    )
    LLM(kv_cache_dtype="auto", **common)  # the scales are not needed there
    save_file({**tensors, **{f"model.layers.{i}.self_attn.{k}": torch.tensor([0.5]) for i in (0, 1)
                             for k in ("k_scale", "v_scale")}}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    layers = LLM(kv_cache_dtype="fp8", **common).llm_engine.model_runner.model.model.layers
    assert [(layer.self_attn.attn.k_scale, layer.self_attn.attn.v_scale) for layer in layers] == [(0.5, 0.5)] * 2


def test_a_w4a16_llama_generates_what_transformers_does_with_the_dequantized_weights(tmp_path: Path) -> None:
    # asymmetric groups of 32 (down_proj's 112 inputs: 4 groups, the last of 16)
    quant = quant_config("pack-quantized", weights(4, "int", "group", 32, symmetric=False))
    hf_model = write_quantized_llama(tmp_path, quant, lambda w, generator: ct_int_quantize(
        w, bits=4, strategy="group", group_size=32, symmetric=False
    ))
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    qkv = llm.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, PackedMethod) and qkv.quant_method.kernel.name == "woq_cpu"

    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 40)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=12)


@pytest.mark.parametrize(
    ("fmt", "w", "quantize", "config"),
    [
        ("nvfp4-pack-quantized", NVFP4_WEIGHTS, ct_nvfp4_quantize, {}),
        # groups of 32 inputs: an intermediate size of 128 (the tiny Llama's 112 does not split into them)
        ("mxfp4-pack-quantized", MXFP4_WEIGHTS, ct_mxfp4_quantize, {"intermediate_size": 128}),
    ],
    ids=["nvfp4", "mxfp4"],
)
def test_an_fp4_llama_generates_what_transformers_does_with_the_dequantized_weights(
    tmp_path: Path, fmt: str, w: dict, quantize, config: dict
) -> None:
    hf_model = write_quantized_llama(tmp_path, quant_config(fmt, w), lambda weight, generator: quantize(weight), **config)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    for linear in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
        assert isinstance(linear.quant_method, Fp4Method) and linear.quant_method.kernel.name == "fp4_cpu"

    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 40)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=12)


def test_a_llama_whose_head_is_quantized_too_generates_what_transformers_does(tmp_path: Path) -> None:
    """llm-compressor with lm_head not ignored: the head is packed like the projections
    (an untied head: llm-compressor unties a tied one first) and vframe serves it quantized."""
    quant = quant_config("pack-quantized", weights(4, "int", "group", 32), ignore=[])
    hf_model = write_quantized_llama(
        tmp_path, quant, lambda w, generator: ct_int_quantize(w, bits=4, strategy="group", group_size=32),
        modules=(*PROJECTIONS, "lm_head"),
    )
    assert_head_quantized(generates_like_transformers(tmp_path, hf_model), PackedMethod)


def test_a_tied_head_stays_the_embedding_s_float_weight(tmp_path: Path) -> None:
    """A tied model's checkpoint holds no head of its own: targets that would match
    lm_head leave it tied and unquantized."""
    quant = quant_config("pack-quantized", weights(4, "int", "group", 32), ignore=[])
    hf_model = write_quantized_llama(
        tmp_path, quant, lambda w, generator: ct_int_quantize(w, bits=4, strategy="group", group_size=32),
        tie_word_embeddings=True,
    )
    llm = generates_like_transformers(tmp_path, hf_model)
    assert type(llm.llm_engine.model_runner.model.lm_head.quant_method).__name__ == "UnquantizedLinearMethod"


def test_a_float_head_that_the_config_says_is_quantized_is_refused_naming_both(tmp_path: Path) -> None:
    quant = quant_config("pack-quantized", weights(4, "int", "group", 32), ignore=[])
    write_quantized_llama(
        tmp_path, quant, lambda w, generator: ct_int_quantize(w, bits=4, strategy="group", group_size=32)
    )
    message = (r"checkpoint tensor 'lm_head.weight' has no place in LlamaForCausalLM: its layer 'lm_head' holds "
               r"weight_packed, weight_scale, weight_shape \(quantization method PackedMethod\)")
    with pytest.raises(ModelLoadError, match=message):
        LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
