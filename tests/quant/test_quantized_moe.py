"""Mixture-of-experts models from quantized checkpoints: every expert's projections are the
quantizer's layers (vframe/layers/quantized_moe.py), as the tools save them per expert.

Each test quantizes a tiny random model's linear layers with the formats' own packers
(tests/quant/packers.py, fp8_blocks.py), saves the checkpoint under the names the tools
use, and compares vframe with transformers holding the weights the checkpoint means."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

from vframe import LLM, SamplingParams
from vframe.layers.moe import FusedMoE
from vframe.layers.quantized_moe import QuantizedExperts
from vframe.testing.models import assert_matches_transformers
from fp8_blocks import fp8_block_quantize
from packers import ct_int_quantize

from test_mixtral import tiny_hf_mixtral  # noqa: E402  (packers put tests/models on sys.path)

# the linear modules of Llama, Mixtral and DeepSeek checkpoints (the routers are "gate")
LINEAR_MODULES = {"q_proj", "k_proj", "v_proj", "o_proj", "w1", "w2", "w3", "gate_proj", "up_proj", "down_proj",
                  "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "lm_head", "gate"}
# module name -> (checkpoint tensors, the float32 weight they mean); None: the module stays float
Quantize = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor] | None]


def write_quantized(hf_model: torch.nn.Module, path: Path, quant: dict[str, Any], quantize: Quantize,
                    rename: Callable[[str], str] = lambda name: name) -> Any:
    """``hf_model`` saved as a quantizing tool saves it: each linear module ``quantize`` takes
    replaced by its tensors (per expert, as transformers' save_pretrained names experts), the
    rest as they are (``rename`` maps a quantized tensor's name), ``quant`` as config.json's
    quantization_config. Returns transformers'
    model of the weights the checkpoint means (saved beside it, float32)."""
    float_dir, reference_dir = path / "float", path / "reference"
    hf_model.save_pretrained(float_dir)
    with safe_open(str(float_dir / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    quantized, meant = {}, {}
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        linear = leaf == "weight" and module.rpartition(".")[2] in LINEAR_MODULES
        packed = quantize(module, tensor) if linear else None
        if packed is None:
            quantized[name] = meant[name] = tensor
            continue
        quantized |= {rename(f"{module}.{key}"): value for key, value in packed[0].items()}
        meant[name] = packed[1].float()
    config = json.loads((float_dir / "config.json").read_text())
    for directory, weights, extra in ((path, quantized, {"quantization_config": quant}), (reference_dir, meant, {})):
        directory.mkdir(exist_ok=True)
        save_file(weights, str(directory / "model.safetensors"), metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(config | extra))
    return AutoModelForCausalLM.from_pretrained(reference_dir, dtype=torch.float32).eval()


def prompt_logprobs(llm: LLM, ids: list[int]) -> torch.Tensor:  # [len(ids) - 1]: each token after the first
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    return torch.tensor([lp[t].logprob for lp, t in zip(out.prompt_logprobs[1:], ids[1:])])


def assert_logprobs_match(llm: LLM, hf_model: Any, ids: list[int], atol: float = 1e-4) -> None:
    """Teacher-forced over ``ids``: vframe's logprobs within ``atol`` of transformers' (float32
    on both sides, the same weights: measured ~1.5e-6; the experts' gate and up swapped: 0.8)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, :-1].float()
    expected = logits.log_softmax(-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    deltas = (prompt_logprobs(llm, ids) - expected).abs()
    assert float(deltas.max()) < atol, deltas


def prompts(n: int = 3) -> list[list[int]]:
    return [torch.randint(0, 128, (length,), generator=torch.Generator().manual_seed(length)).tolist()
            for length in (5, 17, 40)[:n]]


def w4a16(group_size: int) -> tuple[dict[str, Any], Quantize]:
    """compressed-tensors W4A16 with zero points in groups of ``group_size``: the quantization_config
    llm-compressor writes, and the packer; the router and the head stay float, as llm-compressor's
    Mixtral recipes keep them."""
    weights = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": group_size, "symmetric": False,
               "dynamic": False, "actorder": None}
    quant = {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
                                      "weights": weights}},
        "ignore": ["lm_head", "re:.*block_sparse_moe.gate$"], "kv_cache_scheme": None,
    }

    def quantize(module: str, weight: torch.Tensor):
        if module == "lm_head" or module.endswith(".gate"):
            return None
        packed = ct_int_quantize(weight, bits=4, strategy="group", group_size=group_size, symmetric=False)
        return packed.tensors, packed.weight()

    return quant, quantize


# llm-compressor (on transformers 5) saves a Mixtral's experts as gate_proj / up_proj / down_proj
LLM_COMPRESSOR_NAMES = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}


@pytest.mark.parametrize("names", ["w1/w3/w2", "gate_proj/up_proj/down_proj"])
def test_a_mixtral_whose_experts_are_w4a16_generates_what_transformers_does(tmp_path: Path, names: str) -> None:
    def rename(name: str) -> str:
        if names == "w1/w3/w2" or ".experts." not in name:
            return name
        for old, new in LLM_COMPRESSOR_NAMES.items():
            name = name.replace(old, new)
        return name

    hf_model = write_quantized(tiny_hf_mixtral(), tmp_path, *w4a16(32), rename=rename)  # Mixtral's 64 and 96 inputs
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    experts = layer.mlp.experts
    assert isinstance(experts, QuantizedExperts) and len(experts) == 4
    methods = [type(getattr(experts[2], name).quant_method).__name__ for name in ("w1", "w3", "w2")]
    assert methods == ["PackedMethod"] * 3
    assert type(layer.mlp.gate.quant_method).__name__ == "UnquantizedLinearMethod"
    assert_logprobs_match(llm, hf_model, prompts()[2])
    assert_matches_transformers(None, prompts(), hf_model=hf_model, llm=llm, max_tokens=12)


# DeepSeek-V3's own layout: quant_method fp8, e4m3 weights with a float32 scale per block
# (weight_scale_inv), every linear layer but the head and the router: MLA's kv_b_proj too
# (dequantized for its absorption), the shared and routed experts. Blocks of 32 here (V3: 128),
# so that the tiny shapes hold partial blocks (q_a_proj's 48 outputs, kv_a_proj's 40).
FP8_BLOCKS = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}


def fp8_blocks(module: str, weight: torch.Tensor):
    if module == "lm_head" or module.endswith("mlp.gate"):
        return None
    q, scales, dequantized = fp8_block_quantize(weight, (32, 32))
    return {"weight": q, "weight_scale_inv": scales}, dequantized


TINY_V3 = DeepseekV3Config(
    vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, intermediate_size=96,
    n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=256, initializer_range=0.1,
)


def test_deepseek_v3_in_its_block_fp8_layout_generates_what_transformers_does(tmp_path: Path) -> None:
    torch.manual_seed(0)
    hf_model = write_quantized(DeepseekV3ForCausalLM(TINY_V3).eval(), tmp_path, FP8_BLOCKS, fp8_blocks)
    llm = LLM(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    model = llm.llm_engine.model_runner.model
    moe = model.model.layers[1].mlp
    assert isinstance(moe.experts, QuantizedExperts)
    assert type(moe.experts[3].down_proj.quant_method).__name__ == "BlockFp8Method"
    assert type(moe.shared_experts.gate_up_proj.quant_method).__name__ == "BlockFp8Method"
    attention = model.model.layers[0].self_attn
    assert type(attention.kv_b_proj.quant_method).__name__ == "BlockFp8Method"
    assert_logprobs_match(llm, hf_model, prompts()[2])
    assert_matches_transformers(None, prompts(), hf_model=hf_model, llm=llm, max_tokens=12)
    # kv_b_proj's dequantized weight (its absorption reads it as a tensor) is the blocks' values
    expected = hf_model.model.layers[0].self_attn.kv_b_proj.weight
    assert torch.equal(attention.kv_b_weight(), expected)


def test_bitsandbytes_in_flight_quantizes_a_float_mixtral_s_experts_to_nf4(tmp_path: Path) -> None:
    """quantization="bitsandbytes" on a float Mixtral (the checkpoint as it is; config.json's
    quantization_config null): each expert's w1 / w3 / w2 quantized to NF4 on its own while loading,
    the router and the head float; transformers holding those NF4 weights agrees."""
    from test_bitsandbytes import in_flight

    def quantize(module: str, weight: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        if module == "lm_head" or module.endswith(".gate"):
            return None
        return {"weight": weight}, in_flight(weight)  # the checkpoint float, the reference its NF4

    hf_model = write_quantized(tiny_hf_mixtral(), tmp_path, None, quantize)
    llm = LLM(model=str(tmp_path), quantization="bitsandbytes", skip_tokenizer_init=True, dtype="float32",
              num_threads=2)
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    assert isinstance(layer.mlp.experts, QuantizedExperts)
    assert type(layer.mlp.experts[3].w2.quant_method).__name__ == "BnB4BitInFlightMethod"
    assert type(layer.mlp.gate.quant_method).__name__ == "UnquantizedLinearMethod"
    assert_logprobs_match(llm, hf_model, prompts()[2])
    assert_matches_transformers(None, prompts(), hf_model=hf_model, llm=llm, max_tokens=12)


def test_fp8_on_the_fly_quantizes_a_float_mixtral_s_experts(tmp_path: Path) -> None:
    """quantization="fp8" on a float Mixtral: each expert's projections become FP8 layers
    (a scale per row, e4m3 values); the answers move by FP8's rounding only."""
    tiny_hf_mixtral().save_pretrained(str(tmp_path))
    common = dict(model=str(tmp_path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    dense, fp8 = LLM(**common), LLM(quantization="fp8", **common)
    assert isinstance(dense.llm_engine.model_runner.model.model.layers[0].mlp.experts, FusedMoE)
    experts = fp8.llm_engine.model_runner.model.model.layers[0].mlp.experts
    assert isinstance(experts, QuantizedExperts) and experts[1].w2.weight.dtype == torch.float8_e4m3fn
    ids = prompts()[2]
    deltas = (prompt_logprobs(fp8, ids) - prompt_logprobs(dense, ids)).abs()
    assert 1e-3 < float(deltas.max()) < 0.3, deltas  # measured: max 0.040, mean 0.011
