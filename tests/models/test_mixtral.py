"""vframe's Mixtral routes, loads and generates as transformers does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity import assert_engine_matches_transformers, prompts_of_lengths
from safetensors.torch import save_file
from transformers import MixtralConfig, MixtralForCausalLM as HFMixtralForCausalLM

from vframe.backends.torch_attn import TorchAttentionBackend
from vframe.errors import ModelLoadError
from vframe.layers.moe import softmax_topk
from vframe.models.config import ModelConfig
from vframe.models.loader import load_model, resolve_model
from vframe.models.mixtral import ARCHITECTURES, MixtralForCausalLM, MixtralSparseMoeBlock
from vframe.plugins import get_registry
from vframe.quant import onednn_packed
from vframe.quant.onednn_packed import plain

VOCAB = 128
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=4,
    num_experts_per_tok=2,
    max_position_embeddings=256,
)
PROMPT_LENGTHS = [5, 23, 37, 12]


def tiny_hf_mixtral(**overrides: object) -> HFMixtralForCausalLM:
    """transformers' Mixtral with random weights; router and experts drawn larger
    than transformers' init (std 0.02), so that the routing is decisive and the
    experts' output weighs in the residual stream: a wrong expert would show."""
    torch.manual_seed(0)
    hf_model = HFMixtralForCausalLM(MixtralConfig(**(TINY | overrides))).eval()
    with torch.no_grad():
        for layer in hf_model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
            layer.mlp.experts.gate_up_proj.normal_(0.0, 0.15)
            layer.mlp.experts.down_proj.normal_(0.0, 0.15)
    return hf_model


def test_architecture_registered() -> None:
    assert ARCHITECTURES == ["MixtralForCausalLM"]
    assert get_registry("model").load("MixtralForCausalLM") is MixtralForCausalLM


def test_matches_transformers(tmp_path: Path) -> None:
    hf_model = tiny_hf_mixtral()
    hf_model.save_pretrained(str(tmp_path))
    prompts = prompts_of_lengths(VOCAB, PROMPT_LENGTHS, shared_prefix=4)

    assert_engine_matches_transformers(tmp_path, hf_model, prompts, max_tokens=8, num_blocks=14)


# --------------------------------------------------------------------------- #
# Routing: the experts chosen per token are transformers' choices
# --------------------------------------------------------------------------- #


def our_block(hf_block: torch.nn.Module, config: MixtralConfig) -> MixtralSparseMoeBlock:
    block = MixtralSparseMoeBlock(config, torch.float32, None, "model.layers.0.mlp")
    block.gate.weight.data.copy_(hf_block.gate.weight)
    block.experts.w13_weight.data.copy_(hf_block.experts.gate_up_proj)  # same [E, 2I, H] layout
    block.experts.w2_weight.data.copy_(hf_block.experts.down_proj)
    return block


def test_routing_picks_transformers_experts() -> None:
    config = MixtralConfig(**TINY)
    hf_block = tiny_hf_mixtral().model.layers[0].mlp
    ours = our_block(hf_block, config)
    # Router rows 0..3 read hidden features 0..3: token t scores expert e by x[t, e].
    with torch.no_grad():
        hf_block.gate.weight.zero_()
        hf_block.gate.weight[:, :4] = torch.eye(4)
    ours.gate.weight.data.copy_(hf_block.gate.weight)
    x = torch.zeros(4, 64)
    x[:, :4] = torch.tensor([
        [3.0, 1.0, 2.0, 0.0],  # experts 0, 2
        [0.0, 0.5, 1.0, 4.0],  # experts 3, 2
        [1.0, 2.0, 0.0, 0.0],  # experts 1, 0
        [0.0, 0.0, 5.0, 6.0],  # experts 3, 2
    ])
    expected = [[0, 2], [3, 2], [1, 0], [3, 2]]

    with torch.no_grad():
        _, hf_weights, hf_ids = hf_block.gate(x)
        ours_weights, ours_ids = ours_topk(ours, x)

    assert hf_ids.tolist() == expected
    assert ours_ids.tolist() == expected
    # Renormalized over the two chosen: e^3 / (e^3 + e^2) for token 0.
    assert ours_weights[0, 0].item() == pytest.approx(1 / (1 + torch.e**-1), rel=1e-6)
    torch.testing.assert_close(ours_weights, hf_weights)


def ours_topk(block: MixtralSparseMoeBlock, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return softmax_topk(block.gate(x), block.top_k, renormalize=True)


def test_random_batch_routes_and_outputs_as_transformers() -> None:
    config = MixtralConfig(**TINY)
    hf_block = tiny_hf_mixtral().model.layers[0].mlp
    ours = our_block(hf_block, config)
    x = torch.randn(48, 64, generator=torch.Generator().manual_seed(3))

    with torch.no_grad():
        _, _, hf_ids = hf_block.gate(x)
        _, ours_ids = ours_topk(ours, x)
        hf_out = hf_block(x[None])[0]
        ours_out = ours(x)

    assert [set(ids) for ids in ours_ids.tolist()] == [set(ids) for ids in hf_ids.tolist()]
    assert set(ours_ids.flatten().tolist()) == {0, 1, 2, 3}  # every expert gets tokens
    torch.testing.assert_close(ours_out, hf_out, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- #
# Checkpoint layouts
# --------------------------------------------------------------------------- #


def test_per_expert_and_stacked_layouts_load_the_same(tmp_path: Path) -> None:
    hf_model = tiny_hf_mixtral()
    per_expert, stacked = tmp_path / "per_expert", tmp_path / "stacked"
    hf_model.save_pretrained(str(per_expert))  # transformers 5 writes released checkpoints' names
    with (per_expert / "model.safetensors").open("rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in header
    assert "model.layers.1.block_sparse_moe.gate.weight" in header
    # transformers' in-memory names: mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I].
    stacked.mkdir()
    (stacked / "config.json").write_text((per_expert / "config.json").read_text())
    state = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    save_file(state, str(stacked / "model.safetensors"))

    a = load_model(resolve_model(str(per_expert)), MixtralForCausalLM, TorchAttentionBackend, torch.float32)
    b = load_model(resolve_model(str(stacked)), MixtralForCausalLM, TorchAttentionBackend, torch.float32)

    experts = a.model.layers[1].mlp.experts
    assert (experts.w13_packed is not None) == onednn_packed.onednn_fp32_available()  # packed after loading
    w13, w2 = experts.expert_weights()
    hf_experts = hf_model.model.layers[1].mlp.experts
    assert torch.equal(w13[2, :96], hf_experts.gate_up_proj[2, :96])  # expert 2's w1 (gate)
    assert torch.equal(w2, hf_experts.down_proj)
    b_params = dict(b.named_parameters())
    for name, param in a.named_parameters():  # oneDNN-packed weights compared in their plain form
        assert torch.equal(plain(param), plain(b_params[name])), name


def test_missing_expert_is_reported(tmp_path: Path) -> None:
    hf_model = tiny_hf_mixtral()
    state = {name: t.contiguous() for name, t in hf_model.state_dict().items()}
    del state["model.layers.0.mlp.experts.down_proj"]
    hf_model.config.save_pretrained(str(tmp_path))
    save_file(state, str(tmp_path / "model.safetensors"))

    with pytest.raises(ModelLoadError, match=r"no weights for model\.layers\.0\.mlp\.experts\.w2_weight"):
        load_model(resolve_model(str(tmp_path)), MixtralForCausalLM, TorchAttentionBackend, torch.float32)


# --------------------------------------------------------------------------- #
# Config
# --------------------------------------------------------------------------- #


def test_moe_defaults_match_transformers() -> None:
    ours = ModelConfig({"model_type": "mixtral"})
    ref = MixtralConfig()
    for name in ("num_local_experts", "num_experts_per_tok", "router_jitter_noise", "sliding_window",
                 "intermediate_size", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps"):
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.rope_parameters == {"rope_theta": 1e6, "rope_type": "default"} == dict(ref.rope_parameters)


def test_more_experts_per_token_than_experts_is_refused() -> None:
    config = ModelConfig({"model_type": "mixtral", **TINY, "num_experts_per_tok": 5})
    expected = r"'num_experts_per_tok': 5 \(expected an integer from 1 to num_local_experts=4\)"
    with pytest.raises(ModelLoadError, match=expected):
        MixtralForCausalLM(config, TorchAttentionBackend, torch.float32)


def test_zero_experts_is_refused_when_read() -> None:
    with pytest.raises(ModelLoadError, match=r"'num_local_experts': 0 \(expected an integer from 1 to 65536\)"):
        ModelConfig({"model_type": "mixtral", **TINY, "num_local_experts": 0})
