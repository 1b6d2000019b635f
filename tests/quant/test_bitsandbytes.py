"""bitsandbytes checkpoints: 4-bit NF4 / FP4 (with and without double quantization) and LLM.int8.

The checkpoint tensors here are written as bitsandbytes lays them out (``bnb_quantize_4bit``:
its tables, blocks of 64 codes of the row-major weight, two codes a byte with the first in the
high nibble, the block absmax optionally quantized again per 256 blocks; the JSON quant state),
from the format's definition rather than from vframe's reader; ``make test-quant`` checks the
reader against bitsandbytes' own ``dequantize_4bit`` on checkpoints bitsandbytes made.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from packers import generates_like_transformers, write_quantized_llama
from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.linear import QKVParallelLinear
from vframe.plugins import get_registry
from vframe.quant.bitsandbytes import BitsAndBytesConfig, BnB4BitMethod, BnB8BitMethod
from vframe.quant.kernels.builtin import pairs_available
from vframe.testing.quant import check_quant_method

# bitsandbytes' 4-bit tables (bitsandbytes.functional.get_4bit_type), as float32
NF4 = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0]
FP4 = [0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5, 0.1666666716337204, 0.25,
       0.0, -0.0052083334885537624, -0.6666666865348816, -1.0, -0.3333333432674408, -0.5, -0.1666666716337204, -0.25]
BLOCK, NESTED_BLOCK = 64, 256


def quant_config(quant_type: str = "nf4", double_quant: bool = True, **more: object) -> dict:
    return {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
            "bnb_4bit_quant_type": quant_type, "bnb_4bit_use_double_quant": double_quant,
            "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8", **more}


INT8_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": False, "load_in_8bit": True,
               "llm_int8_threshold": 6.0, "llm_int8_has_fp16_weight": False}


@dataclass
class BnBQuantized:
    tensors: dict[str, torch.Tensor]  # checkpoint names below the module, as transformers saves them
    dequantized: torch.Tensor  # [out, in] float32: what the checkpoint means

    def weight(self) -> torch.Tensor:
        return self.dequantized


def bnb_quantize_4bit(w: torch.Tensor, quant_type: str = "nf4", double_quant: bool = True) -> BnBQuantized:
    """``w`` [out, in] as bitsandbytes' ``quantize_4bit`` stores it: each block of 64 consecutive
    values of the flattened weight scaled by its absmax, every value the nearest table entry; with
    ``double_quant`` the absmax values less their mean quantized to 8 bits per 256 blocks (a
    uniform map here: the reader takes the map from the checkpoint)."""
    table = torch.tensor(NF4 if quant_type == "nf4" else FP4)
    flat = w.detach().float().reshape(-1, BLOCK)  # [blocks, 64]
    absmax = flat.abs().amax(dim=1)  # [blocks]
    codes = (flat / absmax[:, None].clamp(min=1e-12))[..., None].sub(table).abs().argmin(dim=-1)  # [blocks, 64]
    packed = (codes.reshape(-1, 2)[:, 0] << 4 | codes.reshape(-1, 2)[:, 1]).to(torch.uint8)[:, None]
    state = {"quant_type": quant_type, "blocksize": BLOCK, "dtype": "float32", "shape": list(w.shape)}
    tensors = {"weight": packed, "weight.quant_map": table}
    if double_quant:
        offset = float(absmax.mean())
        centered = absmax - offset
        padded = torch.nn.functional.pad(centered, (0, -len(centered) % NESTED_BLOCK)).reshape(-1, NESTED_BLOCK)
        nested_absmax = padded.abs().amax(dim=1)  # [nested blocks]
        nested_map = torch.linspace(-1, 1, 256)
        index = ((padded / nested_absmax[:, None]).clamp(-1, 1) * 127.5 + 127.5).round().long().flatten()
        absmax_bytes = index[: len(absmax)].to(torch.uint8)
        absmax = nested_map[absmax_bytes.long()] * nested_absmax.repeat_interleave(NESTED_BLOCK)[: len(absmax)]
        absmax = absmax + torch.tensor(offset, dtype=torch.float32)
        tensors |= {"weight.absmax": absmax_bytes, "weight.nested_absmax": nested_absmax,
                    "weight.nested_quant_map": nested_map}
        state |= {"nested_blocksize": NESTED_BLOCK, "nested_dtype": "float32", "nested_offset": offset}
    else:
        tensors["weight.absmax"] = absmax
    tensors[f"weight.quant_state.bitsandbytes__{quant_type}"] = torch.tensor(list(json.dumps(state).encode()),
                                                                              dtype=torch.uint8)
    dequantized = (table[codes] * absmax[:, None]).reshape(w.shape)
    return BnBQuantized(tensors, dequantized)


def bnb_quantize_int8(w: torch.Tensor) -> BnBQuantized:
    """LLM.int8's weight: each row rounded to int8 by its absmax ``SCB`` / 127."""
    scb = w.detach().float().abs().amax(dim=1)  # [out]
    q = torch.round(w.detach().float() * (127 / scb[:, None])).clamp(-127, 127).to(torch.int8)
    return BnBQuantized({"weight": q, "SCB": scb, "weight_format": torch.tensor(0, dtype=torch.uint8)},
                        q.float() * scb[:, None] / 127)


def as_parameters(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Checkpoint names below a module -> vframe's parameter names (what the loader does)."""
    config = BitsAndBytesConfig.from_config(quant_config())
    return {config.checkpoint_tensor_name(f"m.{name}").removeprefix("m."): t for name, t in tensors.items()}


def test_bitsandbytes_is_a_builtin_quantizer_whose_dotted_names_load_into_parameters() -> None:
    config = get_registry("quantizer").load("bitsandbytes").from_config(quant_config())
    rename = config.checkpoint_tensor_name
    assert rename("model.layers.0.self_attn.q_proj.weight.absmax") == "model.layers.0.self_attn.q_proj.weight_absmax"
    assert rename("a.weight.nested_quant_map") == "a.weight_nested_quant_map"
    assert rename("a.weight.quant_state.bitsandbytes__nf4") == "a.weight_quant_state"
    assert rename("a.weight") == "a.weight" and rename("a.SCB") == "a.SCB" and rename("a.bias") == "a.bias"


@pytest.mark.parametrize(("quant_type", "double_quant"), [("nf4", True), ("fp4", False), ("nf4", False)])
def test_4_bit_conforms_on_every_layer_kind(quant_type: str, double_quant: bool) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        check_quant_method(
            "bitsandbytes", hf_quant_config=quant_config(quant_type, double_quant), dtype=dtype, quick=True,
            checkpoint_tensors=lambda w: as_parameters(bnb_quantize_4bit(w, quant_type, double_quant).tensors),
        )


def test_int8_conforms_on_every_layer_kind() -> None:
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16: the 8-bit quant kernel
        check_quant_method("bitsandbytes", hf_quant_config=INT8_CONFIG, dtype=dtype, quick=True,
                           checkpoint_tensors=lambda w: bnb_quantize_int8(w).tensors)


def test_fused_q_k_v_modules_each_bring_their_own_blocks_and_state() -> None:
    g = torch.Generator().manual_seed(0)
    config = BitsAndBytesConfig.from_config(quant_config())
    layer = QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=config)  # q 128 rows, k and v 64
    shards = {s: bnb_quantize_4bit(torch.randn(rows, 128, generator=g)) for s, rows in (("q", 128), ("k", 64),
                                                                                        ("v", 64))}
    for shard_id in ("v", "q", "k"):  # any order
        for name, tensor in as_parameters(shards[shard_id].tensors).items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    expected = torch.cat([shards[s].dequantized for s in ("q", "k", "v")])
    assert torch.equal(layer.quant_method.dequantize_weight(layer), expected)
    # blocks within rows: a Lut4Weight on the C++ kernel, the checkpoint's bytes and a scale per 64 inputs
    assert layer.quant_method.kernel.name == "lut4_cpu"
    assert layer.lut4_cpu_q.shape == (256, 64) and layer.lut4_cpu_scales.shape == (256, 2)
    assert not hasattr(layer, "weight_absmax")  # the checkpoint tensors are dropped
    x = torch.randn(3, 128, generator=g)
    torch.testing.assert_close(layer(x), x @ expected.T, rtol=0, atol=1e-5)


@pytest.mark.skipif(pairs_available() is not None, reason="lut4_pairs needs a CPU with AVX512-BF16")
def test_in_bfloat16_4_bit_layers_run_on_lut4_pairs_within_bfloat16_rounding_of_their_weight() -> None:
    """The bfloat16 default for NF4 on AVX512-BF16: the table's values rounded to bfloat16 in
    place (each within 2^-9 of NF4's), the dequantized weight exact in float32."""
    g = torch.Generator().manual_seed(1)
    config = BitsAndBytesConfig.from_config(quant_config())
    layer = QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=config, params_dtype=torch.bfloat16)
    shards = {s: bnb_quantize_4bit(torch.randn(rows, 128, generator=g)) for s, rows in (("q", 128), ("k", 64),
                                                                                        ("v", 64))}
    for shard_id, shard in shards.items():
        for name, tensor in as_parameters(shard.tensors).items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    assert layer.quant_method.kernel.name == "lut4_pairs"
    expected = torch.cat([shards[s].dequantized for s in ("q", "k", "v")])  # [256, 128]
    assert torch.equal(layer.quant_method.dequantize_weight(layer), expected)
    for tokens in (1, 7, 64, 65, 300):  # in place up to 64 tokens, the weight dequantized above
        x = torch.randn(tokens, 128, generator=g).bfloat16()
        reference = x.double() @ expected.double().T
        error = float((layer(x).double() - reference).abs().max() / reference.abs().max())
        assert error < 2**-7, f"{tokens} tokens: {error}"


@pytest.mark.parametrize(("quant", "method"), [(quant_config("nf4", True), BnB4BitMethod),
                                               (quant_config("fp4", False), BnB4BitMethod),
                                               (INT8_CONFIG, BnB8BitMethod)])
def test_a_bitsandbytes_llama_generates_what_transformers_does_with_the_dequantized_weights(
    quant: dict, method: type, tmp_path: Path
) -> None:
    four = quant["load_in_4bit"]
    quantize = ((lambda w, _: bnb_quantize_4bit(w, quant["bnb_4bit_quant_type"], quant["bnb_4bit_use_double_quant"]))
                if four else (lambda w, _: bnb_quantize_int8(w)))
    # o_proj's 96 inputs and down_proj's 112: a 4-bit block of 64 runs on into the next row, as
    # bitsandbytes blocks the flattened weight
    hf_model = write_quantized_llama(tmp_path, quant, quantize)

    llm = generates_like_transformers(tmp_path, hf_model)

    layer = llm.llm_engine.model_runner.model.model.layers[1]
    gate_up, down = layer.mlp.gate_up_proj, layer.mlp.down_proj
    assert isinstance(down.quant_method, method)
    # float32 on the CPU; 4 bit: gate / up's rows of 64 inputs on lut4_cpu, down's rows of 112 (and
    # o_proj's of 96) not a multiple of the blocks of 64: dequantized on each call
    assert gate_up.quant_method.kernel.name == ("lut4_cpu" if four else "woq_cpu")
    assert down.quant_method.kernel is None if four else down.quant_method.kernel.name == "woq_cpu"


@pytest.mark.parametrize(("changes", "message"), [
    ({"load_in_4bit": False}, "expected exactly one of them true"),
    ({"load_in_8bit": True}, "expected exactly one of them true"),
    ({"bnb_4bit_quant_type": "int4"}, "bnb_4bit_quant_type='int4': expected one of"),
    ({"bnb_4bit_quant_storage": "bfloat16"}, "bnb_4bit_quant_storage='bfloat16'"),
    ({"quant_method": "gptq"}, "this one is quantized as 'gptq'"),
])
def test_what_it_cannot_serve_is_refused_naming_the_field(changes: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        BitsAndBytesConfig.from_config(quant_config() | changes)


def test_a_float_checkpoint_is_refused_pointing_at_fp8() -> None:
    with pytest.raises(ConfigError, match="does not quantize to bitsandbytes while loading: use quantization='fp8'"):
        BitsAndBytesConfig.from_config(None)
    with pytest.raises(ConfigError, match="llm_int8_has_fp16_weight=true"):
        BitsAndBytesConfig.from_config(INT8_CONFIG | {"llm_int8_has_fp16_weight": True})


def test_skip_modules_stay_float() -> None:
    from vframe.layers.linear import ReplicatedLinear

    config = BitsAndBytesConfig.from_config(quant_config(llm_int8_skip_modules=["mlp"]))
    assert config.get_quant_method(ReplicatedLinear(64, 64), "model.layers.0.mlp.down_proj") is None
    assert isinstance(config.get_quant_method(ReplicatedLinear(64, 64), "model.layers.0.self_attn.o_proj"),
                      BnB4BitMethod)


def test_a_module_without_its_state_is_refused_naming_what_is_missing() -> None:
    from vframe.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(128, 64, bias=False, quant_config=BitsAndBytesConfig.from_config(quant_config()),
                             prefix="model.layers.3.mlp.down_proj")
    tensors = as_parameters(bnb_quantize_4bit(torch.randn(64, 128)).tensors)
    del tensors["weight_quant_state"]
    for name, tensor in tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    with pytest.raises(ModelLoadError, match="down_proj: the checkpoint lacks its bitsandbytes tensors "
                                             "weight.quant_state.bitsandbytes__nf4"):
        layer.quant_method.process_weights_after_loading(layer)
