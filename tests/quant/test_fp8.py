"""FP8 (e4m3) weights: quantized while loading, or read from a per-tensor FP8 checkpoint."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from vframe import LLM
from vframe.errors import ConfigError
from vframe.layers.linear import QKVParallelLinear, ReplicatedLinear
from vframe.models.loader.load import quantized_linear_layers, weight_bytes
from vframe.quant.fp8 import Fp8Config
from vframe.testing.models import assert_matches_transformers
from vframe.testing.quant import check_quant_method

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_llama import save_tiny_llama  # noqa: E402
from fp8_blocks import fp8_block_quantize  # noqa: E402

E4M3 = torch.float8_e4m3fn


def test_on_the_fly_scales_each_output_row_to_448() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=g)
    w[3] *= 100  # a row far larger than the others keeps its own scale
    layer = ReplicatedLinear(64, 48, bias=False, quant_config=Fp8Config.from_config(None))
    layer.weight.weight_loader(layer.weight, w)
    layer.quant_method.process_weights_after_loading(layer)

    assert (layer.weight.dtype, tuple(layer.weight.shape)) == (E4M3, (48, 64))
    assert (layer.weight_scale.dtype, tuple(layer.weight_scale.shape)) == (torch.float32, (48,))
    assert torch.equal(layer.weight.float().abs().amax(dim=1), torch.full((48,), 448.0))
    torch.testing.assert_close(layer.weight_scale, w.abs().amax(dim=1) / 448, rtol=1e-6, atol=0)
    w_deq = layer.quant_method.dequantize_weight(layer)
    # 3 mantissa bits: within 1/16 of each value (plus e4m3's subnormal step near zero)
    subnormal_step = layer.weight_scale[:, None] * 2.0**-9
    assert bool(((w_deq - w).abs() <= w.abs() / 16 + subnormal_step).all())

    x = torch.randn(4, 64, generator=g)
    reference = x.double() @ w_deq.double().T
    assert float((layer(x).double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


def test_on_the_fly_conforms_on_every_layer_kind() -> None:
    check_quant_method("fp8")
    check_quant_method("fp8", dtype=torch.bfloat16, quick=True)


def fp8_checkpoint_tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """What vLLM / llm-compressor write per tensor: e4m3 weight, a float32 scalar scale."""
    scale = weight.float().abs().max() / 448
    return {"weight": (weight.float() / scale).to(E4M3), "weight_scale": scale}


def test_checkpoint_conforms_on_every_layer_kind() -> None:
    config = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    check_quant_method("fp8", hf_quant_config=config, checkpoint_tensors=fp8_checkpoint_tensors)


def test_checkpoint_scales_stay_per_fused_shard() -> None:
    config = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "static"})
    layer = QKVParallelLinear(32, 8, 2, 1, bias=False, quant_config=config)  # q 16, k 8, v 8 rows
    g = torch.Generator().manual_seed(0)
    shards = {"q": torch.randn(16, 32, generator=g), "k": 10 * torch.randn(8, 32, generator=g),
              "v": torch.randn(8, 32, generator=g) / 10}
    for shard_id, w in shards.items():
        for name, tensor in {**fp8_checkpoint_tensors(w), "input_scale": torch.tensor(0.5)}.items():
            getattr(layer, name).weight_loader(getattr(layer, name), tensor, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    scales = [shards[s].abs().max() / 448 for s in "qkv"]
    expected = torch.cat([torch.full((n,), float(s)) for s, n in zip(scales, (16, 8, 8), strict=True)])
    assert torch.equal(layer.weight_scale, expected)
    assert layer.input_scale is None  # read, not used: activations stay float
    w_deq = layer.quant_method.dequantize_weight(layer)
    assert torch.equal(w_deq, torch.cat([fp8_checkpoint_tensors(shards[s])["weight"].float() for s in "qkv"])
                       * expected[:, None])


def block_checkpoint_tensors(block: tuple[int, int]):
    def tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        q, scales, _ = fp8_block_quantize(weight, block)
        return {"weight": q, "weight_scale_inv": scales}

    return tensors


@pytest.mark.parametrize("block", [(32, 64), (128, 128)])
def test_block_checkpoint_conforms_on_every_layer_kind(block: tuple[int, int]) -> None:
    # 32 x 64 blocks: whole blocks per tensor-parallel rank; 128 x 128: partial blocks (k, v of 64 rows)
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(block)}
    check_quant_method("fp8", hf_quant_config=config, checkpoint_tensors=block_checkpoint_tensors(block),
                       quick=block == (128, 128))


def test_block_scales_stay_with_their_shard_across_partial_blocks() -> None:
    # SmolLM2's attention: q 576 rows (4.5 blocks of 128), k and v 192 (1.5 blocks), 576 inputs
    config = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    layer = QKVParallelLinear(576, 64, 9, 3, bias=False, quant_config=config, prefix="l.qkv_proj")
    g = torch.Generator().manual_seed(0)
    shards = {"q": torch.randn(576, 576, generator=g), "k": 30 * torch.randn(192, 576, generator=g),
              "v": torch.randn(192, 576, generator=g) / 30}
    packed = {s: fp8_block_quantize(w, (128, 128)) for s, w in shards.items()}
    for shard_id, (q, scales, _) in packed.items():
        layer.weight.weight_loader(layer.weight, q, shard_id)
        layer.weight_scale_inv.weight_loader(layer.weight_scale_inv, scales, shard_id)
    layer.quant_method.process_weights_after_loading(layer)

    assert tuple(layer.weight_scale_inv.shape) == (5 + 2 + 2, 5)  # per shard ceil(rows / 128), ceil(576 / 128)
    assert [tuple(packed[s][1].shape) for s in "qkv"] == [(5, 5), (2, 5), (2, 5)]
    w_deq = layer.quant_method.dequantize_weight(layer)
    assert torch.equal(w_deq, torch.cat([packed[s][2] for s in "qkv"]))
    # e4m3 rounding: within 1/16 of each value, plus the subnormal step of its block
    w = torch.cat(list(shards.values()))
    assert float((w_deq - w).abs().max()) <= float(w.abs().max()) / 16
    # on fp8_cpu: the e4m3 bytes in place, each row with its shard's block-row scales
    assert layer.quant_method.kernel.name == "fp8_cpu"
    assert torch.equal(layer.quant_method.kernel.dequantize_weight(layer), w_deq)
    for tokens in (3, 40):  # in place, and dequantized for one GEMM
        x = torch.randn(tokens, 576, generator=g)
        reference = x.double() @ w_deq.double().T
        assert float((layer(x).double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


def test_block_scales_a_rank_cannot_cut_whole_are_refused() -> None:
    config = Fp8Config.from_config({"quant_method": "fp8", "weight_block_size": [128, 128]})
    with pytest.raises(ConfigError, match=r"output shards of \[192, 64, 64\] per tensor-parallel rank"):
        QKVParallelLinear(576, 64, 9, 3, bias=False, quant_config=config, tp_rank=0, tp_size=3)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"quant_method": "fp8", "weight_block_size": [128]}, r"weight_block_size=\[128\]: expected two positive"),
        ({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "static"},
         r"activation_scheme='static' with weight_block_size"),
        ({"quant_method": "fp8", "activation_scheme": "per-token"}, r"activation_scheme='per-token'"),
        ({"quant_method": "gptq", "bits": 4}, r"already quantized as 'gptq'"),
    ],
)
def test_what_it_cannot_serve_is_refused_naming_the_field(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        Fp8Config.from_config(config)


def test_ignored_layers_name_the_checkpoint_s_modules_behind_a_fused_layer() -> None:
    """ignored_layers list checkpoint modules (q_proj, k_proj, v_proj): vframe's qkv_proj
    stays float when all three are listed, and is refused when only some are."""
    attention = "model.layers.0.self_attn"
    config = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": [
        f"{attention}.q_proj", f"{attention}.k_proj", f"{attention}.v_proj", "lm_head"]})
    assert config.get_quant_method(ReplicatedLinear(64, 64), f"{attention}.qkv_proj") is None
    assert config.get_quant_method(ReplicatedLinear(64, 64), f"{attention}.o_proj") is not None
    assert config.get_quant_method(ReplicatedLinear(64, 64), "model.layers.1.self_attn.qkv_proj") is not None
    fused = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                   "ignored_layers": [f"{attention}.qkv_proj"]})  # vframe's (and vLLM's) fused name
    assert fused.get_quant_method(ReplicatedLinear(64, 64), f"{attention}.qkv_proj") is None
    partly = Fp8Config.from_config({"quant_method": "fp8", "activation_scheme": "dynamic",
                                    "ignored_layers": [f"{attention}.q_proj"]})
    with pytest.raises(ConfigError, match=rf"{attention}.qkv_proj: vframe fuses .* but "
                                          r"quantization_config.ignored_layers quantizes them differently"):
        partly.get_quant_method(ReplicatedLinear(64, 64), f"{attention}.qkv_proj")


def test_an_fp8_llama_generates_what_transformers_does_with_the_dequantized_weights(tmp_path: Path) -> None:
    hf_model = save_tiny_llama(tmp_path)
    llm = LLM(model=str(tmp_path), quantization="fp8", skip_tokenizer_init=True, dtype="float32", num_threads=2)
    ours = llm.llm_engine.model_runner.model
    with torch.no_grad():
        for ours_layer, hf_layer in zip(ours.model.layers, hf_model.model.layers, strict=True):
            attn, mlp, hf_attn, hf_mlp = ours_layer.self_attn, ours_layer.mlp, hf_layer.self_attn, hf_layer.mlp
            assert attn.qkv_proj.weight.dtype == E4M3
            q, k, v = attn.qkv_proj.quant_method.dequantize_weight(attn.qkv_proj).split([96, 48, 48])
            gate, up = mlp.gate_up_proj.quant_method.dequantize_weight(mlp.gate_up_proj).chunk(2)
            down = mlp.down_proj.quant_method.dequantize_weight(mlp.down_proj)
            o = attn.o_proj.quant_method.dequantize_weight(attn.o_proj)
            for hf_proj, w in ((hf_attn.q_proj, q), (hf_attn.k_proj, k), (hf_attn.v_proj, v), (hf_attn.o_proj, o),
                               (hf_mlp.gate_proj, gate), (hf_mlp.up_proj, up), (hf_mlp.down_proj, down)):
                hf_proj.weight.copy_(w)

    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (6, 23)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=12)
    # every layer on fp8_cpu, which reads the e4m3 bytes and per-row scales in place: held once
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert {m.quant_method.kernel.name for m in quantized_linear_layers(ours)} == {"fp8_cpu"}
    assert weight_bytes(qkv) == qkv.weight.numel() + 4 * qkv.weight.shape[0] == 192 * 64 + 4 * 192
