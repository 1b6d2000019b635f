"""GPTQ checkpoints: the tensors AutoGPTQ / GPTQModel write, read back exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from vframe import LLM
from vframe.errors import ConfigError
from vframe.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vframe.plugins import get_registry
from vframe.quant.gptq import GPTQConfig, GPTQLinearMethod
from vframe.testing.models import assert_matches_transformers
from vframe.testing.quant import check_quant_method
from packers import (
    PROJECTIONS, assert_head_quantized, generates_like_transformers, gptq_quantize, pack_columns, to_int32,
    write_quantized_llama,
)
from defaults import BF16_INT4


def quant_config(bits: int = 4, group_size: int = 128, desc_act: bool = False, sym: bool = True, **more: Any) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size, "desc_act": desc_act, "sym": sym, **more}


def random_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=g) / in_features**0.5
    w[0] = w[0].abs()  # every group of row 0 positive: asymmetric zero point 0, which v1 stores as -1
    return w


@pytest.mark.parametrize(
    ("bits", "group_size", "desc_act", "sym", "checkpoint_format"),
    [
        (4, 32, False, True, "gptq"),
        (4, 48, True, False, "gptq"),  # 200 inputs: 5 groups, the last of 8; act order
        (8, 40, True, False, "gptq"),
        (8, -1, False, True, "gptq"),
        (4, -1, True, False, "gptq"),
        (4, 24, True, False, "gptq_v2"),
        (2, 40, False, False, "gptq"),  # 16 values a word; v1's borrow for a zero point of 0 as at 4 bit
        (3, 32, True, False, "gptq_v2"),  # 32 values in 3 words (224 inputs, 96 outputs)
        (3, 64, False, True, "gptq"),  # v1 at 3 bits: one taken from each value (a symmetric zero point 4)
    ],
)
def test_dequantized_weight_is_the_packed_integers_times_the_scales(
    bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str
) -> None:
    in_features, out_features = {3: (224, 96), 2: (208, 80)}.get(bits, (200, 72))
    w = random_weight(out_features, in_features, seed=bits + group_size)
    packed = gptq_quantize(
        w, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
        checkpoint_format=checkpoint_format, generator=torch.Generator().manual_seed(1),
    )
    config = GPTQConfig.from_config(quant_config(bits, group_size, desc_act, sym, checkpoint_format=checkpoint_format))
    layer = ReplicatedLinear(in_features, out_features, bias=True, quant_config=config)
    for name, tensor in packed.tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor)
    bias = torch.randn(out_features, generator=torch.Generator().manual_seed(2))
    layer.bias.weight_loader(layer.bias, bias)
    expected_groups = 1 if group_size == -1 else -(-in_features // group_size)
    assert tuple(layer.qweight.shape) == (in_features * bits // 32, out_features)
    assert tuple(layer.qzeros.shape) == (expected_groups, out_features * bits // 32)
    assert tuple(layer.scales.shape) == (expected_groups, out_features)
    layer.quant_method.process_weights_after_loading(layer)
    if not sym:
        assert int(packed.zeros[:, 0].min()) == 0  # the v1 borrow case is exercised
    w_deq = layer.quant_method.dequantize_weight(layer)
    # exact: fp16 scale times a small integer is a float32
    assert torch.equal(w_deq.double(), packed.weight())
    # round to nearest: at most half a step from the float weight, where not clamped
    # (a symmetric group of positive weights reaches only 7 of its 15 steps up)
    step = packed.scales.double()[packed.g_idx].T
    inside = (packed.q > 0) & (packed.q < 2**bits - 1)
    assert bool(((w_deq.double() - w.double()).abs() <= step / 2 + 1e-6)[inside].all())

    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(3))
    out = layer(x)
    reference = x.double() @ packed.weight().T + bias.double()
    assert out.dtype == torch.float32
    assert float((out.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


def test_v1_zero_points_match_autogptq_values_minus_one_when_none_is_zero() -> None:
    """AutoGPTQ stored ``zero - 1`` value by value; GPTQModel subtracts from whole
    words. They agree unless a zero point is 0, which only the word form keeps."""
    zeros = torch.randint(1, 16, (3, 16), generator=torch.Generator().manual_seed(0))
    autogptq = to_int32(pack_columns(zeros - 1, 4))
    gptqmodel = to_int32(pack_columns(zeros, 4) - 0x11111111)
    assert torch.equal(autogptq, gptqmodel)


def test_symmetric_checkpoints_store_the_middle_zero_point() -> None:
    packed = gptq_quantize(random_weight(16, 64, 0), bits=4, group_size=32, sym=True, desc_act=False)
    assert set(packed.tensors["qzeros"].flatten().tolist()) == {0x77777777}  # 8 - 1 in every nibble


def test_fused_shards_keep_their_own_activation_order() -> None:
    """q, k and v were quantized one by one: each has its own ``g_idx``."""
    config = GPTQConfig.from_config(quant_config(4, 16, desc_act=True, sym=False))
    layer = QKVParallelLinear(64, 16, 2, 1, bias=False, quant_config=config)  # q 32, k 16, v 16 rows
    g = torch.Generator().manual_seed(0)
    shards = {s: gptq_quantize(torch.randn(n, 64, generator=g), bits=4, group_size=16, sym=False, desc_act=True,
                               generator=g) for s, n in (("q", 32), ("k", 16), ("v", 16))}
    for shard_id, packed in shards.items():
        for name, tensor in packed.tensors.items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor, shard_id)

    assert not torch.equal(shards["q"].g_idx, shards["k"].g_idx)
    expected = torch.cat([shards[s].weight() for s in "qkv"])
    assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), expected)


def test_row_parallel_ranks_with_act_order_keep_every_group() -> None:
    config = GPTQConfig.from_config(quant_config(4, 32, desc_act=True))
    rank1 = RowParallelLinear(128, 64, bias=False, quant_config=config, tp_rank=1, tp_size=2)
    assert tuple(rank1.qweight.shape) == (8, 64)  # its 64 inputs, 8 per word
    assert tuple(rank1.scales.shape) == (4, 64)  # all 128 / 32 groups: g_idx may name any
    in_order = GPTQConfig.from_config(quant_config(4, 32, desc_act=False))
    assert tuple(RowParallelLinear(128, 64, quant_config=in_order, tp_rank=1, tp_size=2).scales.shape) == (2, 64)


@pytest.mark.parametrize(
    ("group_size", "desc_act", "uses_int4_kernel"), [(128, False, True), (-1, False, True), (64, True, True)]
)
def test_bfloat16_on_cpu_takes_the_4_bit_kernel_act_order_by_sorting_the_inputs(
    group_size: int, desc_act: bool, uses_int4_kernel: bool
) -> None:
    in_features, out_features = 384, 48  # 3 groups of 128; the kernel takes groups of 128 (of 128 for -1)
    packed = gptq_quantize(random_weight(out_features, in_features, 7), bits=4, group_size=group_size, sym=False,
                           desc_act=desc_act, generator=torch.Generator().manual_seed(0))
    config = GPTQConfig.from_config(quant_config(4, group_size, desc_act=desc_act, sym=False))
    layer = ReplicatedLinear(in_features, out_features, bias=False, quant_config=config, params_dtype=torch.bfloat16)
    for name, tensor in packed.tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(1)).bfloat16()

    out = layer(x)

    assert (layer.quant_method.kernel.name == BF16_INT4) == uses_int4_kernel
    assert out.dtype == torch.bfloat16
    reference = x.double() @ packed.weight().T
    # bfloat16 scales and zeros (8 bits) and output: a few 2**-8
    assert float((out.double() - reference).abs().max()) <= 2**-6 * float(reference.abs().max())


def conformance_tensors(bits: int, group_size: int, desc_act: bool, sym: bool, checkpoint_format: str = "gptq"):
    generator = torch.Generator().manual_seed(0)

    def tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        return gptq_quantize(
            weight, bits=bits, group_size=group_size, sym=sym, desc_act=desc_act,
            checkpoint_format=checkpoint_format, generator=generator,
        ).tensors

    return tensors


@pytest.mark.parametrize(
    ("bits", "group_size", "desc_act", "sym", "quick"),
    [(4, 32, True, False, False), (8, -1, False, True, False), (4, 64, False, True, False),
     (3, 32, True, True, False), (2, 64, False, False, True)],
)
def test_conforms_on_every_layer_kind(bits: int, group_size: int, desc_act: bool, sym: bool, quick: bool) -> None:
    check_quant_method(
        "gptq",
        hf_quant_config=quant_config(bits, group_size, desc_act, sym),
        checkpoint_tensors=conformance_tensors(bits, group_size, desc_act, sym),
        quick=quick,
    )


@pytest.mark.parametrize(("bits", "desc_act"), [(4, True), (4, False), (3, False)])  # the 4-bit bfloat16 kernel
def test_bfloat16_activations_conform(bits: int, desc_act: bool) -> None:  # (act order: inputs sorted)
    check_quant_method(
        "gptq", hf_quant_config=quant_config(bits, 32, desc_act, False), dtype=torch.bfloat16,
        quick=desc_act or bits == 3, checkpoint_tensors=conformance_tensors(bits, 32, desc_act, False),
    )


def test_gptq_is_a_builtin_quantizer() -> None:
    assert get_registry("quantizer").load("gptq") is GPTQConfig
    method = GPTQConfig.from_config(quant_config()).get_quant_method(ReplicatedLinear(64, 64), "x")
    assert isinstance(method, GPTQLinearMethod)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"bits": 5}, r"quantization_config.bits=5: vframe serves GPTQ with bits 2, 3, 4 or 8"),
        ({"group_size": 0}, r"quantization_config.group_size=0: expected a positive integer or -1"),
        ({"checkpoint_format": "marlin"}, r"checkpoint_format='marlin': vframe reads gptq, gptq_v2"),
        ({"dynamic": [".*mlp.*"]}, r"quantization_config.dynamic=\['.\*mlp.\*'\]: expected an object of regex"),
        ({"pack_dtype": "int16"}, r"quantization_config.pack_dtype='int16': vframe reads GPTQ packed into int32"),
        ({"quant_method": "awq"}, r"quantization='gptq' reads a GPTQ checkpoint; this one is quantized as 'awq'"),
    ],
)
def test_what_it_cannot_serve_is_refused_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GPTQConfig.from_config({**quant_config(), **changes})


def test_a_float_checkpoint_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"quantization='gptq' reads a GPTQ checkpoint"):
        GPTQConfig.from_config(None)


def test_a_layer_that_cannot_be_packed_is_refused() -> None:
    config = GPTQConfig.from_config(quant_config(4, 32))
    with pytest.raises(ConfigError, match=r"an output shard is 60, not a multiple of 8: GPTQ 4-bit packs 8"):
        ReplicatedLinear(64, 60, quant_config=config, prefix="odd")


# --------------------------------------------------------------------------- #
# A whole model: a GPTQ-packed tiny Llama == transformers holding the dequantized weights
# --------------------------------------------------------------------------- #

def test_a_gptq_llama_generates_what_transformers_does_with_the_dequantized_weights(tmp_path: Path) -> None:
    # 4 bit, groups of 32 in activation order (down_proj's 112 inputs: 4 groups, the last of 16), asymmetric
    quant = quant_config(4, 32, desc_act=True, sym=False)
    hf_model = write_quantized_llama(tmp_path, quant, lambda w, generator: gptq_quantize(
        w, bits=4, group_size=32, sym=False, desc_act=True, generator=generator
    ))
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    qkv = llm.llm_engine.model_runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant_method, GPTQLinearMethod) and qkv.quant_method.kernel.name == "reference"  # q, k, v: each its own act order

    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 40)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=12)


@pytest.mark.parametrize("bits", [2, 3])
def test_a_2_and_3_bit_gptq_llama_generates_what_transformers_does_with_the_dequantized_weights(
    bits: int, tmp_path: Path
) -> None:
    """2 bit (16 values a word) and 3 bit (32 values in 3 words), held as 4-bit integers with their
    zero points as offsets, on the kernel chosen for them."""
    quant = quant_config(bits, 32, desc_act=False, sym=bits == 3)
    sizes = dict(head_dim=32, intermediate_size=128) if bits == 3 else {}  # 3 bit: rows of 32 values
    hf_model = write_quantized_llama(tmp_path, quant, lambda w, generator: gptq_quantize(
        w, bits=bits, group_size=32, sym=bits == 3, desc_act=False, generator=generator
    ), **sizes)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    gate_up = llm.llm_engine.model_runner.model.model.layers[0].mlp.gate_up_proj
    assert isinstance(gate_up.quant_method, GPTQLinearMethod) and gate_up.quant_method.kernel.name == "woq_cpu"
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 40)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=12)


def test_lm_head_true_serves_the_head_quantized_like_the_projections(tmp_path: Path) -> None:
    """GPTQModel / auto-round ``"lm_head": true`` (an untied head): the head's qweight,
    qzeros, scales and g_idx are loaded and multiplied as a GPTQ layer's."""
    quant = quant_config(4, 32, desc_act=True, sym=False, lm_head=True)
    hf_model = write_quantized_llama(
        tmp_path, quant,
        lambda w, generator: gptq_quantize(w, bits=4, group_size=32, sym=False, desc_act=True, generator=generator),
        modules=(*PROJECTIONS, "lm_head"),
    )
    assert_head_quantized(generates_like_transformers(tmp_path, hf_model), GPTQLinearMethod)
    assert not GPTQConfig.from_config(quant_config()).quantizes_lm_head()


def test_dynamic_rules_set_each_module_s_bits_or_leave_it_float(tmp_path: Path) -> None:
    """GPTQModel's ``dynamic``: the first matching rule decides; ``-:`` leaves modules
    float, ``+:`` overrides the settings (here 8 bit in groups of 16 for the MLP's
    gate / up, its down_proj left float, the head in 8 bit per channel)."""
    rules = {"-:.*down_proj": {}, "+:.*mlp\\..*": {"bits": 8, "group_size": 16, "damp_percent": 0.05},
             r"+:lm_head": {"bits": 8, "group_size": -1}}
    quant = quant_config(4, 32, lm_head=True, dynamic=rules)

    def by_module(name: str):
        if name.endswith("down_proj"):
            return None
        bits, group_size = (8, 16) if ".mlp." in name else (8, -1) if name == "lm_head" else (4, 32)
        return lambda w, generator: gptq_quantize(w, bits=bits, group_size=group_size, sym=True, desc_act=False,
                                                  generator=generator)

    hf_model = write_quantized_llama(tmp_path, quant, None, by_module=by_module)
    model = generates_like_transformers(tmp_path, hf_model).llm_engine.model_runner.model
    layer = model.model.layers[0]

    def settings(linear) -> tuple[int, int] | None:
        method = linear.quant_method
        return (method.config.bits, method.config.group_size) if isinstance(method, GPTQLinearMethod) else None

    assert settings(layer.self_attn.qkv_proj) == (4, 32) and settings(layer.self_attn.o_proj) == (4, 32)
    assert settings(layer.mlp.gate_up_proj) == (8, 16)
    assert settings(layer.mlp.down_proj) is None
    assert settings(model.lm_head) == (8, -1)


@pytest.mark.parametrize(
    ("dynamic", "message"),
    [
        ({"+:.*q_proj": {"bits": 8}}, r"qkv_proj: vframe fuses .*q_proj, .*k_proj, .*v_proj into one layer, but "
                                      r"quantization_config.dynamic quantizes them differently"),
        ({"+:.*": {"bits": 6}},
         r"quantization_config.dynamic\['\+:\.\*'\].bits=6: vframe serves GPTQ with bits 2, 3, 4 or 8"),
        ({"+:.*": {"format": "marlin"}}, r"dynamic\['\+:\.\*'\] sets format: vframe reads bits, group_size"),
        ({"+:(": {}}, r"dynamic\['\+:\('\]: '\(' is not a regular expression"),
    ],
)
def test_dynamic_rules_vframe_cannot_serve_are_refused_naming_the_rule(dynamic: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        GPTQConfig.from_config(quant_config(dynamic=dynamic)).get_quant_method(
            QKVParallelLinear(64, 16, 4, 2, prefix="model.layers.0.self_attn.qkv_proj"),
            "model.layers.0.self_attn.qkv_proj",
        )
