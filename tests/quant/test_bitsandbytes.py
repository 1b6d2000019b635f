"""bitsandbytes checkpoints: 4-bit NF4 / FP4 (with and without double quantization) and LLM.int8;
and a float checkpoint quantized to NF4 while loading (vLLM's in-flight mode).

The checkpoint tensors here are written as bitsandbytes lays them out (``bnb_quantize_4bit``:
its tables, blocks of 64 codes of the row-major weight, two codes a byte with the first in the
high nibble, the block absmax optionally quantized again per 256 blocks; the JSON quant state),
from the format's definition rather than from vframe's reader; ``make test-quant`` checks the
reader against bitsandbytes' own ``dequantize_4bit`` on checkpoints bitsandbytes made, and the
in-flight quantization against bitsandbytes' ``quantize_4bit``.
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
from vframe import LLM
from vframe.models.loader.load import weight_bytes
from vframe.quant.bitsandbytes import (
    BitsAndBytesConfig, BnB4BitInFlightMethod, BnB4BitMethod, BnB8BitMethod, double_quantize_round_trip, dynamic_map,
    quantize_4bit_blocks,
)
from vframe.testing.models import assert_matches_transformers
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


def bnb_quantize_4bit(w: torch.Tensor, quant_type: str = "nf4", double_quant: bool = True,
                      nested_map: torch.Tensor | None = None) -> BnBQuantized:
    """``w`` [out, in] as bitsandbytes' ``quantize_4bit`` stores it: each block of 64 consecutive
    values of the flattened weight (``in`` a multiple of 64 here) times the reciprocal of its
    absmax, every value the nearest table entry; with ``double_quant`` the absmax values less
    their mean each the nearest entry of ``nested_map`` (bitsandbytes' dynamic map; a uniform one
    by default: the reader takes the map from the checkpoint) over its 256 blocks' absmax."""
    table = torch.tensor(NF4 if quant_type == "nf4" else FP4)
    flat = w.detach().float().reshape(-1, BLOCK)  # [blocks, 64]
    absmax = flat.abs().amax(dim=1)  # [blocks]
    scaled = (flat * (1.0 / absmax[:, None].clamp(min=1e-38))).clamp(-1, 1)
    codes = scaled[..., None].sub(table).abs().argmin(dim=-1)  # [blocks, 64]: the first of two as near
    packed = (codes.reshape(-1, 2)[:, 0] << 4 | codes.reshape(-1, 2)[:, 1]).to(torch.uint8)[:, None]
    state = {"quant_type": quant_type, "blocksize": BLOCK, "dtype": "float32", "shape": list(w.shape)}
    tensors = {"weight": packed, "weight.quant_map": table}
    if double_quant:
        offset = absmax.mean()
        centered = absmax - offset
        padded = torch.nn.functional.pad(centered, (0, -len(centered) % NESTED_BLOCK)).reshape(-1, NESTED_BLOCK)
        nested_absmax = padded.abs().amax(dim=1)  # [nested blocks]
        nested_map = torch.linspace(-1, 1, 256) if nested_map is None else nested_map
        index = (padded / nested_absmax[:, None]).clamp(-1, 1).flatten()[:, None].sub(nested_map).abs().argmin(dim=1)
        absmax_bytes = index[: len(absmax)].to(torch.uint8)
        absmax = nested_map[absmax_bytes.long()] * nested_absmax.repeat_interleave(NESTED_BLOCK)[: len(absmax)]
        absmax = absmax + offset
        offset = float(offset)
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
    for dtype in (torch.float32, torch.bfloat16):  # float32: tensor-parallel ranks 0 and 1 of 2 too
        check_quant_method(
            "bitsandbytes", hf_quant_config=quant_config(quant_type, double_quant), dtype=dtype,
            quick=dtype != torch.float32,
            checkpoint_tensors=lambda w: as_parameters(bnb_quantize_4bit(w, quant_type, double_quant).tensors),
        )


def test_int8_conforms_on_every_layer_kind() -> None:
    for dtype in (torch.float32, torch.bfloat16):  # bfloat16: the 8-bit quant kernel
        check_quant_method("bitsandbytes", hf_quant_config=INT8_CONFIG, dtype=dtype, quick=dtype != torch.float32,
                           checkpoint_tensors=lambda w: bnb_quantize_int8(w).tensors)


def test_each_rank_takes_its_rows_or_inputs_of_the_checkpoint_s_codes_and_scales() -> None:
    """Tensor parallelism on a 4-bit checkpoint: rank 1 of 2 of a fused column-parallel layer holds
    each module's second half of rows, of a row-parallel one its inputs 64..127, of the whole
    module's codes and block scales (not those of a rank's own quantization); a rank's inputs that
    cut blocks take groups of a block's scale; inputs that do not split in groups of 16 or more are
    refused, naming the layer."""
    from vframe.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    g = torch.Generator().manual_seed(6)
    config = BitsAndBytesConfig.from_config(quant_config("nf4", True))
    gate, up = (bnb_quantize_4bit(torch.randn(128, 64, generator=g)) for _ in range(2))
    merged = MergedColumnParallelLinear(64, [128, 128], bias=False, quant_config=config, tp_rank=1, tp_size=2)
    for shard_id, packed in ((1, up), (0, gate)):  # any order
        for name, tensor in as_parameters(packed.tensors).items():
            getattr(merged, name).weight_loader(getattr(merged, name), tensor, shard_id)
    merged.quant_method.process_weights_after_loading(merged)
    assert torch.equal(merged.quant_method.dequantize_weight(merged),
                       torch.cat([gate.dequantized[64:], up.dequantized[64:]]))
    assert merged.quant_method.kernel.name == "lut4_cpu"
    assert weight_bytes(merged) == 128 * 64 // 2 + 128 * 4 + 16 * 4  # this rank's half: codes, absmax, table

    w = torch.randn(96, 128, generator=g) * torch.linspace(0.1, 3, 128)
    down = bnb_quantize_4bit(w)
    assert not torch.equal(bnb_quantize_4bit(w[:, 64:]).dequantized, down.dequantized[:, 64:])
    row = RowParallelLinear(128, 96, bias=False, quant_config=config, tp_rank=1, tp_size=2)
    for name, tensor in as_parameters(down.tensors).items():
        getattr(row, name).weight_loader(getattr(row, name), tensor)
    row.quant_method.process_weights_after_loading(row)
    assert torch.equal(row.quant_method.dequantize_weight(row), down.dequantized[:, 64:])

    # 192 inputs, 96 a rank: blocks of 64 cut at 96, held in groups of 32 (each its block's scale)
    cut = bnb_quantize_4bit(torch.randn(64, 192, generator=g))
    halves = [RowParallelLinear(192, 64, bias=False, quant_config=config, tp_rank=r, tp_size=2) for r in (0, 1)]
    for half in halves:
        for name, tensor in as_parameters(cut.tensors).items():
            getattr(half, name).weight_loader(getattr(half, name), tensor)
        half.quant_method.process_weights_after_loading(half)
    assert [h.quant_method.kernel.name for h in halves] == ["lut4_cpu"] * 2
    assert torch.equal(torch.cat([h.quant_method.dequantize_weight(h) for h in halves], dim=1), cut.dequantized)

    narrow = RowParallelLinear(200, 64, bias=False, quant_config=config, tp_rank=0, tp_size=2, prefix="mlp.down_proj")
    for name, tensor in as_parameters(bnb_quantize_4bit(torch.randn(64, 200, generator=g)).tensors).items():
        getattr(narrow, name).weight_loader(getattr(narrow, name), tensor)
    with pytest.raises(ConfigError, match=r"mlp.down_proj: .* with 200 inputs a row, of which this rank takes 100, "
                                          r"they do not split across tensor-parallel ranks in groups of 16 or more"):
        narrow.quant_method.process_weights_after_loading(narrow)


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
    # o_proj's 96 inputs and down_proj's 104: a 4-bit block of 64 runs on into the next row, as
    # bitsandbytes blocks the flattened weight
    hf_model = write_quantized_llama(tmp_path, quant, quantize, intermediate_size=104)

    llm = generates_like_transformers(tmp_path, hf_model)

    layer = llm.llm_engine.model_runner.model.model.layers[1]
    gate_up, o, down = layer.mlp.gate_up_proj, layer.self_attn.o_proj, layer.mlp.down_proj
    assert isinstance(down.quant_method, method)
    # float32 on the CPU; 4 bit: gate / up's rows of 64 inputs on lut4_cpu, o_proj's of 96 too (in
    # groups of 32, each in one block), down's of 104 (a block's parts as small as 8) dequantized
    # on each call
    assert gate_up.quant_method.kernel.name == o.quant_method.kernel.name == ("lut4_cpu" if four else "woq_cpu")
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


def test_llm_int8_training_weights_are_refused() -> None:
    with pytest.raises(ConfigError, match="llm_int8_has_fp16_weight=true"):
        BitsAndBytesConfig.from_config(INT8_CONFIG | {"llm_int8_has_fp16_weight": True})


# --------------------------------------------------------------------------- #
# In flight: a float checkpoint quantized to NF4 while loading
# --------------------------------------------------------------------------- #

def in_flight(w: torch.Tensor) -> torch.Tensor:
    """What vLLM's in-flight bitsandbytes makes of ``w`` [out, in] (one checkpoint module, or
    one rank's part of it): NF4 in blocks of 64, double quantization with bitsandbytes' dynamic
    map, undone; float32."""
    return bnb_quantize_4bit(w, "nf4", True, nested_map=dynamic_map()).dequantized


def test_the_dynamic_map_is_bitsandbytes_signed_8_bit_map() -> None:
    """``create_dynamic_map()``'s values (``make test-quant`` compares all 256 with bitsandbytes')."""
    m = dynamic_map()
    assert m.dtype == torch.float32 and m.shape == (256,) and bool((m[1:] > m[:-1]).all())
    assert (m[127], m[255], m[0]) == (0.0, 1.0, -m[254])
    # 10^(e - 6) times the midpoints of 2^e + 1 points over [0.1, 1], e = 0..6: 127 magnitudes
    assert m[128] == pytest.approx(0.55e-6, rel=1e-6)  # e = 0: one midpoint
    assert m[129:131].tolist() == pytest.approx([0.325e-5, 0.775e-5], rel=1e-6)  # e = 1: two
    assert m[254] == pytest.approx(1 - 0.9 / 128, rel=1e-7)  # e = 6: the last of 64
    assert int(((m > 0.1) & (m < 1)).sum()) == 64 and int(((m > 1e-6) & (m < 1e-5)).sum()) == 2


def test_a_block_s_values_get_the_nearest_nf4_code_of_their_absmax_flattened_across_rows() -> None:
    table = torch.tensor(NF4)
    # row 0: one block of 64 (its absmax 2); rows 1-2 of 96 inputs: blocks run on into the next row
    w = torch.zeros(3, 96)
    w[0, :64] = torch.linspace(-2, 2, 64)
    w[1:] = torch.randn(2, 96, generator=torch.Generator().manual_seed(0))
    codes, absmax = quantize_4bit_blocks(w, table, 64)
    assert codes.shape == (3, 48) and codes.dtype == torch.uint8 and absmax.shape == (5,)  # 288 values: 4.5 blocks
    flat = w.flatten()
    blocks = [flat[i : i + 64] for i in range(0, 288, 64)]
    assert absmax.tolist() == [float(b.abs().max()) for b in blocks]
    assert absmax[0] == 2 and absmax[1] == w[1, :32].abs().max()  # block 1: row 0's last 32 zeros, then row 1
    unpacked = torch.stack([codes >> 4, codes & 0x0F], dim=-1).flatten().long()  # the first of a byte high
    for i, block in enumerate(blocks):
        expected = (block / absmax[i])[:, None].sub(table).abs().argmin(dim=1)
        assert torch.equal(unpacked[64 * i : 64 * i + len(block)], expected), i
    assert unpacked[0] == 0 and unpacked[63] == 15  # -2 and 2: the table's ends
    assert unpacked[64:96].tolist() == [7] * 32  # zeros: NF4's 0.0
    zero_codes, zero_absmax = quantize_4bit_blocks(torch.zeros(1, 64), table, 64)  # an all-zero block
    assert zero_absmax.tolist() == [0.0] and zero_codes.tolist() == [[0x77] * 32]


def test_double_quantization_rounds_each_absmax_to_the_nearest_dynamic_map_step() -> None:
    g = torch.Generator().manual_seed(3)
    absmax = torch.rand(600, generator=g) * 0.1 + 0.01  # 3 nested blocks, the last one of 88
    kept = double_quantize_round_trip(absmax, 256)
    offset = absmax.mean()
    m = dynamic_map()
    for start in (0, 256, 512):
        part = absmax[start : start + 256] - offset
        nested = part.abs().max()
        expected = m[(part / nested)[:, None].sub(m).abs().argmin(dim=1)] * nested + offset
        assert torch.equal(kept[start : start + 256], expected), start
    assert float((kept - absmax).abs().max()) < 0.01 * float((absmax - offset).abs().max())


def test_a_float_checkpoint_is_quantized_while_loading_to_nf4_as_vllm_does() -> None:
    config = BitsAndBytesConfig.from_config(None)  # no quantization_config: vLLM's in-flight bitsandbytes
    assert (config.bits, config.quant_type, config.double_quant, config.in_flight) == (4, "nf4", True, True)
    assert isinstance(config.get_quant_method(QKVParallelLinear(64, 16, 4, 2, bias=False), "q"), BnB4BitInFlightMethod)


def test_in_flight_conforms_on_every_layer_kind_and_rank() -> None:
    check_quant_method("bitsandbytes")  # tensor-parallel ranks 0 and 1 of 2 each quantize their part
    check_quant_method("bitsandbytes", dtype=torch.bfloat16, quick=True)


def test_in_flight_quantizes_each_module_of_a_fused_layer_on_its_own_and_keeps_no_float_weight() -> None:
    g = torch.Generator().manual_seed(4)
    layer = QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=BitsAndBytesConfig.from_config(None))
    shards = {"q": torch.randn(128, 128, generator=g), "k": torch.randn(64, 128, generator=g) * 3,
              "v": torch.randn(64, 128, generator=g) / 3}
    for shard_id in ("k", "v", "q"):  # any order
        layer.weight.weight_loader(layer.weight, shards[shard_id].bfloat16(), shard_id)  # a bfloat16 checkpoint
    layer.quant_method.process_weights_after_loading(layer)

    expected = torch.cat([in_flight(shards[s].bfloat16().float()) for s in ("q", "k", "v")])
    assert torch.equal(layer.quant_method.dequantize_weight(layer), expected)
    assert layer.quant_method.kernel.name == "lut4_cpu" and "weight" not in layer._parameters
    assert weight_bytes(layer) == 256 * 64 + 4 * 256 * 2 + 4 * 16  # two codes a byte, float32 absmax per 64, table
    fused = QKVParallelLinear(128, 32, 4, 2, bias=False, quant_config=BitsAndBytesConfig.from_config(None))
    fused.weight.weight_loader(fused.weight, torch.cat([shards[s] for s in ("q", "k", "v")]))  # fused on disk
    fused.quant_method.process_weights_after_loading(fused)
    assert torch.equal(fused.quant_method.dequantize_weight(fused), torch.cat([in_flight(shards[s])
                                                                              for s in ("q", "k", "v")]))


def test_in_flight_each_rank_quantizes_its_own_part() -> None:
    """Rank 1 of 2 of a row-parallel layer (inputs 64..127) and of a fused column-parallel one
    (each module's second half of rows): its own blocks, absmax mean and nested blocks, as vLLM."""
    from vframe.layers.linear import MergedColumnParallelLinear, RowParallelLinear

    g = torch.Generator().manual_seed(5)
    config = BitsAndBytesConfig.from_config(None)
    w = torch.randn(96, 128, generator=g) * torch.linspace(0.1, 3, 128)  # the columns' scales differ
    row = RowParallelLinear(128, 96, bias=False, quant_config=config, tp_rank=1, tp_size=2)
    row.weight.weight_loader(row.weight, w)
    row.quant_method.process_weights_after_loading(row)
    assert torch.equal(row.quant_method.dequantize_weight(row), in_flight(w[:, 64:]))
    assert not torch.equal(in_flight(w)[:, 64:], in_flight(w[:, 64:]))  # the whole weight's would differ

    gate, up = torch.randn(128, 64, generator=g), torch.randn(128, 64, generator=g) * 2
    merged = MergedColumnParallelLinear(64, [128, 128], bias=False, quant_config=config, tp_rank=1, tp_size=2)
    for shard_id, part in ((0, gate), (1, up)):
        merged.weight.weight_loader(merged.weight, part, shard_id)
    merged.quant_method.process_weights_after_loading(merged)
    assert torch.equal(merged.quant_method.dequantize_weight(merged), torch.cat([in_flight(gate[64:]),
                                                                                in_flight(up[64:])]))


def test_in_flight_refuses_a_module_the_checkpoint_lacks_an_integer_weight_and_nan() -> None:
    layer = QKVParallelLinear(64, 16, 4, 2, bias=False, quant_config=BitsAndBytesConfig.from_config(None),
                              prefix="model.layers.0.self_attn.qkv_proj")
    with pytest.raises(ModelLoadError, match="quantizes a float checkpoint's weights"):
        layer.weight.weight_loader(layer.weight, torch.zeros(64, 64, dtype=torch.int8), "q")
    with pytest.raises(ModelLoadError, match=r"qkv_proj \(v\): the checkpoint's weight holds NaN or infinite"):
        layer.weight.weight_loader(layer.weight, torch.full((32, 64), float("nan")), "v")
    layer.weight.weight_loader(layer.weight, torch.randn(64, 64), "q")
    with pytest.raises(ModelLoadError, match=r"qkv_proj \(k\), model.layers.0.self_attn.qkv_proj \(v\): "
                                             "the checkpoint has no weight to quantize"):
        layer.quant_method.process_weights_after_loading(layer)


def test_a_float_llama_quantized_while_loading_generates_what_transformers_does_with_nf4_weights(
    tmp_path: Path
) -> None:
    from test_llama import save_tiny_llama

    # o_proj's 96 inputs (held in groups of 32), down_proj's 104 (parts of 8): blocks run on across rows
    hf_model = save_tiny_llama(tmp_path, intermediate_size=104)
    with torch.no_grad():
        for layer in hf_model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                         layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                proj.weight.copy_(in_flight(proj.weight))
    llm = LLM(model=str(tmp_path), quantization="bitsandbytes", skip_tokenizer_init=True, dtype="float32",
              num_threads=2)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 23)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=12)
    model = llm.llm_engine.model_runner.model
    assert llm.llm_engine.model_runner.quant_config.in_flight
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.quant_method.kernel.name == layer.self_attn.o_proj.quant_method.kernel.name
    assert layer.mlp.gate_up_proj.quant_method.kernel.name == "lut4_cpu"
    assert layer.mlp.down_proj.quant_method.kernel is None  # dequantized on each call
    assert model.lm_head.weight.dtype == torch.float32  # the head stays float, as in vLLM


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
