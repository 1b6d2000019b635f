"""AWQ (GEMM) checkpoints: the tensors AutoAWQ writes, read back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vframe import LLM
from vframe.errors import ConfigError
from vframe.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
from vframe.plugins import get_registry
from vframe.quant.awq import AWQConfig, AWQLinearMethod
from vframe.testing.models import assert_matches_transformers
from vframe.testing.quant import check_quant_method
from packers import awq_quantize, write_quantized_llama
from defaults import BF16_INT4


def quant_config(group_size: int = 128, **more: object) -> dict:
    return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True, "version": "gemm", **more}


def test_the_interleaved_packing_order_is_read_back() -> None:
    """Word c of a row holds outputs 8c .. 8c+7 in the slots of [0, 2, 4, 6, 1, 3, 5, 7]."""
    config = AWQConfig.from_config(quant_config(group_size=8))
    layer = ReplicatedLinear(8, 8, bias=False, quant_config=config)
    layer.qweight.data.fill_(0x76543210)  # slot j holds the value j: output ORDER[j] gets j
    layer.qzeros.data.zero_()
    layer.scales.data.fill_(1.0)
    # outputs 0..7 sit in slots 0, 4, 1, 5, 2, 6, 3, 7
    expected_row = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7], dtype=torch.float32)
    assert torch.equal(layer.quant_method.dequantize_weight(layer), expected_row[:, None].expand(8, 8))


@pytest.mark.parametrize(("in_features", "group_size"), [(192, 64), (120, 40), (96, 32)])  # 3 groups each
def test_dequantized_weight_is_the_packed_integers_times_the_scales(in_features: int, group_size: int) -> None:
    out_features = 80
    g = torch.Generator().manual_seed(in_features)
    w = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    packed = awq_quantize(w, group_size=group_size)
    config = AWQConfig.from_config(quant_config(group_size))
    layer = ReplicatedLinear(in_features, out_features, bias=False, quant_config=config)
    for name, tensor in packed.tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    assert tuple(layer.qweight.shape) == (in_features, out_features // 8)
    assert tuple(layer.qzeros.shape) == (3, out_features // 8)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "qweight")  # dropped: the kernel holds the weight
    assert len(set(packed.zeros.flatten().tolist())) > 4  # asymmetric: zero points vary
    w_deq = layer.quant_method.dequantize_weight(layer)
    assert torch.equal(w_deq.double(), packed.weight())
    assert float((w_deq - w).abs().max()) <= float(packed.scales.max())  # within a step

    x = torch.randn(6, in_features, generator=g)
    reference = x.double() @ packed.weight().T
    assert float((layer(x).double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


def test_merged_gate_up_shards_are_placed_in_packed_columns() -> None:
    g = torch.Generator().manual_seed(0)
    gate, up = awq_quantize(torch.randn(48, 64, generator=g), group_size=32), awq_quantize(
        torch.randn(16, 64, generator=g), group_size=32
    )
    layer = MergedColumnParallelLinear(64, [48, 16], bias=False, quant_config=AWQConfig.from_config(quant_config(32)))
    for shard_id, packed in enumerate((gate, up)):
        for name, tensor in packed.tensors.items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor, shard_id)
    expected = torch.cat([gate.weight(), up.weight()])
    assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), expected)


@pytest.mark.parametrize(("group_size", "quick"), [(64, False), (128, True)])
def test_conforms_on_every_layer_kind(group_size: int, quick: bool) -> None:
    check_quant_method(
        "awq",
        hf_quant_config=quant_config(group_size),
        checkpoint_tensors=lambda w: awq_quantize(w, group_size=group_size).tensors,
        quick=quick,
    )
    check_quant_method(  # bfloat16: the 4-bit kernel (int4_pairs, or torch's int4_cpu)
        "awq", hf_quant_config=quant_config(group_size), dtype=torch.bfloat16, quick=quick,
        checkpoint_tensors=lambda w: awq_quantize(w, group_size=group_size).tensors,
    )


@pytest.mark.parametrize(("out_features", "uses_int4_kernel"), [(64, True), (40, False)])  # the kernel: out % 16
def test_bfloat16_on_cpu_takes_the_4_bit_kernel_where_the_sizes_fit(out_features: int, uses_int4_kernel: bool):
    g = torch.Generator().manual_seed(5)
    packed = awq_quantize(torch.randn(out_features, 384, generator=g) / 20, group_size=128)
    config = AWQConfig.from_config(quant_config(128))
    layer = ReplicatedLinear(384, out_features, bias=True, quant_config=config, params_dtype=torch.bfloat16)
    for name, tensor in {**packed.tensors, "bias": torch.randn(out_features, generator=g)}.items():
        getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(5, 384, generator=g).bfloat16()

    out = layer(x)

    assert (layer.quant_method.kernel.name == BF16_INT4) == uses_int4_kernel
    reference = x.double() @ packed.weight().T + layer.bias.double()
    # bfloat16 scales and zeros (8 bits), the output and the bias add: a few 2**-8
    assert float((out.double() - reference).abs().max()) <= 2**-6 * float(reference.abs().max())


def test_awq_is_a_builtin_quantizer_that_skips_listed_modules() -> None:
    skipping = quant_config(64, modules_to_not_convert=["lm_head", "visual"])
    config = get_registry("quantizer").load("awq").from_config(skipping)
    assert config.get_quant_method(ReplicatedLinear(64, 64), "visual.blocks.0.attn.qkv") is None
    assert config.get_quant_method(ReplicatedLinear(64, 64), "model.layers.0.mlp.down_proj") is not None
    # a fused layer asks for its checkpoint modules: all listed, or none
    shards = quant_config(64, modules_to_not_convert=["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"])
    config = AWQConfig.from_config(shards)
    assert config.get_quant_method(ReplicatedLinear(64, 64), "model.layers.0.mlp.gate_up_proj") is None
    assert config.get_quant_method(ReplicatedLinear(64, 64), "model.layers.1.mlp.gate_up_proj") is not None
    with pytest.raises(ConfigError, match=r"model.layers.0.self_attn.qkv_proj: vframe fuses .* into one layer, but "
                                          r"quantization_config.modules_to_not_convert quantizes them differently"):
        AWQConfig.from_config(quant_config(64, modules_to_not_convert=["layers.0.self_attn.q_proj"])).get_quant_method(
            ReplicatedLinear(64, 64), "model.layers.0.self_attn.qkv_proj")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bits": 8}, r"quantization_config.bits=8: vframe serves AWQ with 4 bits"),
        ({"version": "GEMV"}, r"quantization_config.version='GEMV': vframe reads the AWQ GEMM layout"),
        ({"zero_point": False}, r"quantization_config.zero_point=false"),
        ({"group_size": -1}, r"quantization_config.group_size=-1: expected a positive integer"),
        ({"quant_method": "gptq"}, r"quantization='awq' reads an AWQ checkpoint; this one is quantized as 'gptq'"),
    ],
)
def test_what_it_cannot_serve_is_refused_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        AWQConfig.from_config({**quant_config(), **changes})


def test_autoawq_spelling_of_the_fields_is_read() -> None:
    config = AWQConfig.from_config({"quant_method": "awq", "w_bit": 4, "q_group_size": 64, "version": "GEMM"})
    assert config.group_size == 64


def test_an_awq_llama_generates_what_transformers_does_with_the_dequantized_weights(tmp_path: Path) -> None:
    # groups of 16: down_proj's 112 inputs make 7
    hf_model = write_quantized_llama(tmp_path, quant_config(16), lambda w, _: awq_quantize(w, group_size=16))
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    down = llm.llm_engine.model_runner.model.model.layers[1].mlp.down_proj
    assert isinstance(down.quant_method, AWQLinearMethod) and down.quant_method.kernel.name == "woq_cpu"

    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (4, 31)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=12)
