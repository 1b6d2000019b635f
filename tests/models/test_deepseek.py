"""vframe's DeepSeek-V2/V3 (multi-head latent attention + routed and shared experts)
gives the tokens and logprobs transformers gives, caches only the latent, routes
tokens to the experts transformers picks and loads every checkpoint layout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity import assert_engine_matches_transformers, prompts_of_lengths
from safetensors.torch import load_file, save_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2TopkRouter
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3TopkRouter

from vframe import LLM
from vframe.backends.torch_attn import TorchAttentionBackend
from vframe.errors import ModelLoadError
from vframe.layers.moe_routing import grouped_topk
from vframe.layers.rotary import yarn_inv_freq
from vframe.models.config import ModelConfig
from vframe.models.deepseek import DeepseekV2ForCausalLM as OurV2
from vframe.models.deepseek import DeepseekV3ForCausalLM as OurV3
from vframe.models.deepseek import Routing, mla_softmax_scale
from vframe.models.loader import load_model, resolve_model
from vframe.quant.onednn_packed import plain

VOCAB = 128
TINY = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, intermediate_size=96,
    max_position_embeddings=256,
    initializer_range=0.1,  # at the default 0.02 the logits are nearly flat and greedy ties flip
)
YARN = {
    "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
    "mscale": 0.8, "mscale_all_dim": 0.6, "beta_fast": 16, "beta_slow": 2,
}
# V2: no q compression, softmax routing limited to the best of 2 groups of 4 experts
# (top-2 of one group of 4 differs from the global top-2).
V2_CONFIG = DeepseekV2Config(
    **TINY, q_lora_rank=None, topk_method="group_limited_greedy", n_group=2, topk_group=1,
    routed_scaling_factor=1.3,
)
# V3: compressed q, sigmoid routing with a correction bias, a dense first layer, YaRN.
V3_CONFIG = DeepseekV3Config(
    **TINY, q_lora_rank=48, n_group=2, topk_group=1, first_k_dense_replace=1, routed_scaling_factor=1.7,
    rope_parameters=YARN,
)
# 4 prompts of up to 37 + 8 tokens in blocks of 4: 14 blocks force a preemption.
NUM_BLOCKS = 14


def save_tiny(cls: type, config, path: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = cls(config).eval()
    for layer in model.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is not None and hasattr(gate, "e_score_correction_bias"):
            gate.e_score_correction_bias.copy_(torch.randn(config.n_routed_experts) * 0.1)  # init leaves it zero
    for name, param in model.named_parameters():
        if name.endswith(".bias"):
            param.data.normal_(std=0.1)  # init leaves them zero
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def v2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("deepseek_v2")
    return path, save_tiny(DeepseekV2ForCausalLM, V2_CONFIG, path)


@pytest.fixture(scope="module")
def v3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    path = tmp_path_factory.mktemp("deepseek_v3")
    return path, save_tiny(DeepseekV3ForCausalLM, V3_CONFIG, path)


def test_v2_matches_transformers(v2) -> None:
    path, hf_model = v2
    prompts = prompts_of_lengths(VOCAB, [5, 23, 37, 12], shared_prefix=4)
    assert_engine_matches_transformers(path, hf_model, prompts, num_blocks=NUM_BLOCKS)


def test_v3_matches_transformers(v3) -> None:
    path, hf_model = v3
    assert any(layer.mlp.gate.e_score_correction_bias.abs().sum() > 0 for layer in hf_model.model.layers[1:])
    prompts = prompts_of_lengths(VOCAB, [5, 23, 37, 12], shared_prefix=4)
    assert_engine_matches_transformers(path, hf_model, prompts, num_blocks=NUM_BLOCKS)


def test_v3_variant_matches_transformers(tmp_path: Path) -> None:
    """Rotation by halves, projection biases, no q compression, unnormalized
    weights, two shared experts, no dense layer, default rope."""
    config = DeepseekV3Config(
        **(TINY | dict(n_shared_experts=2)), q_lora_rank=None, rope_interleave=False, attention_bias=True,
        norm_topk_prob=False, first_k_dense_replace=0, n_group=4, topk_group=2,
    )
    hf_model = save_tiny(DeepseekV3ForCausalLM, config, tmp_path)
    assert hf_model.model.layers[0].self_attn.kv_a_proj_with_mqa.bias.abs().sum() > 0
    prompts = prompts_of_lengths(VOCAB, [9, 30], shared_prefix=4)
    assert_engine_matches_transformers(tmp_path, hf_model, prompts, expect_stress=False)


def test_cache_holds_only_the_latent(v3) -> None:
    path, _ = v3
    llm = LLM(str(path), dtype="float32", block_size=4, num_gpu_blocks_override=10, skip_tokenizer_init=True)
    runner = llm.llm_engine.model_runner

    # block_size 4 * (kv_lora_rank 32 + qk_rope_head_dim 8) * 3 layers * 4 bytes
    assert runner.bytes_per_block() == 4 * (32 + 8) * 3 * 4 == 1920
    assert [tuple(cache.shape) for cache in runner.kv_caches] == [(10, 4, 40)] * 3


# --------------------------------------------------------------------------- #
# Routing: the experts transformers' routers pick
# --------------------------------------------------------------------------- #


def routed_by_transformers(router: torch.nn.Module, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        _, weights, ids = router(hidden)
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)  # by expert id


def sorted_by_id(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = ids.argsort(dim=-1)
    return ids.gather(1, order), weights.gather(1, order)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_v2_routing_picks_transformers_experts(topk_method: str) -> None:
    config = DeepseekV2Config(**(TINY | dict(n_routed_experts=16, num_experts_per_tok=3)), topk_method=topk_method,
                              n_group=4, topk_group=2, routed_scaling_factor=1.3, norm_topk_prob=True)
    torch.manual_seed(1)
    router = DeepseekV2TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    hidden = torch.randn(64, 64)

    ref_ids, ref_weights = routed_by_transformers(router, hidden)
    routing = Routing.v2(config)
    weights, ids = grouped_topk(
        hidden @ router.weight.T, routing.top_k, scoring_func="softmax", num_expert_group=routing.num_expert_group,
        topk_group=routing.topk_group, renormalize=routing.renormalize,
        routed_scaling_factor=routing.routed_scaling_factor,
    )
    ids, weights = sorted_by_id(weights, ids)

    assert torch.equal(ids, ref_ids)
    assert weights.dtype == ref_weights.dtype == torch.float32
    torch.testing.assert_close(weights, ref_weights)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_v3_routing_picks_transformers_experts(norm_topk_prob: bool) -> None:
    config = DeepseekV3Config(**(TINY | dict(n_routed_experts=16, num_experts_per_tok=3)), n_group=4, topk_group=2,
                              routed_scaling_factor=2.5, norm_topk_prob=norm_topk_prob)
    torch.manual_seed(2)
    router = DeepseekV3TopkRouter(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    router.e_score_correction_bias.copy_(torch.randn(16) * 0.5)
    hidden = torch.randn(64, 64)

    ref_ids, ref_weights = routed_by_transformers(router, hidden)
    routing = Routing.v3(config)
    weights, ids = grouped_topk(
        hidden @ router.weight.T, routing.top_k, scoring_func="sigmoid", num_expert_group=routing.num_expert_group,
        topk_group=routing.topk_group, e_score_correction_bias=router.e_score_correction_bias,
        renormalize=routing.renormalize, routed_scaling_factor=routing.routed_scaling_factor,
    )
    ids, weights = sorted_by_id(weights, ids)

    assert torch.equal(ids, ref_ids)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, ref_weights)
    # The bias moved some choices: without it the experts differ.
    unbiased = grouped_topk(hidden @ router.weight.T, 3, scoring_func="sigmoid", num_expert_group=4, topk_group=2)[1]
    assert not torch.equal(unbiased.sort(dim=-1).values, ref_ids)


def test_routing_refuses_groups_too_small_for_top_k() -> None:
    config = DeepseekV3Config(**TINY, n_group=4, topk_group=1)  # top-2 from one group of 2 experts
    Routing.v3(config).check(8)
    config = DeepseekV3Config(**(TINY | dict(num_experts_per_tok=3)), n_group=4, topk_group=1)
    with pytest.raises(ModelLoadError, match="topk_group=1 groups of 2 experts hold fewer than num_experts_per_tok=3"):
        Routing.v3(config).check(8)


def test_v2_refuses_an_unknown_topk_method() -> None:
    with pytest.raises(ModelLoadError, match="topk_method='noaux_tc'"):
        Routing.v2(DeepseekV2Config(**TINY, topk_method="noaux_tc"))


# --------------------------------------------------------------------------- #
# YaRN and the softmax scale
# --------------------------------------------------------------------------- #

YARN_CASES = [
    YARN,
    # DeepSeek-V3's own rope_scaling (config.json), at its 163840 positions
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
     "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
    {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0, "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
     "attention_factor": 0.9, "truncate": False},
]


@pytest.mark.parametrize("rope", YARN_CASES)
@pytest.mark.parametrize(("config_cls", "attention_cls"), [(DeepseekV2Config, DeepseekV2Attention),
                                                           (DeepseekV3Config, DeepseekV3Attention)])
def test_yarn_and_softmax_scale_match_transformers(rope: dict, config_cls: type, attention_cls: type) -> None:
    config = config_cls(**(TINY | {"max_position_embeddings": 64 * 40}), rope_parameters=dict(rope))
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)

    ours = ModelConfig(json.loads(config.to_json_string()))
    inv_freq, factor = yarn_inv_freq(ours, ours.qk_rope_head_dim)

    assert inv_freq.tolist() == ref_inv_freq.tolist()
    assert factor == ref_factor
    assert mla_softmax_scale(ours) == attention_cls(config, 0).scaling


# --------------------------------------------------------------------------- #
# Checkpoint layouts
# --------------------------------------------------------------------------- #


def load(path: Path, cls: type) -> torch.nn.Module:
    return load_model(resolve_model(path), cls, TorchAttentionBackend, torch.float32)


def assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module) -> None:
    ours, theirs = dict(a.named_parameters()), dict(b.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in ours.items():  # oneDNN-packed weights compared in their plain form
        assert torch.equal(plain(param), plain(theirs[name])), name


def test_loads_stacked_expert_tensors(v3, tmp_path: Path) -> None:
    """transformers holds experts stacked (``experts.gate_up_proj [E, 2I, H]``,
    ``experts.down_proj [E, H, I]``); save_pretrained splits them per expert,
    a checkpoint written from the state dict keeps them stacked."""
    path, hf_model = v3
    state = {name: tensor.contiguous() for name, tensor in hf_model.state_dict().items()}
    assert state["model.layers.1.mlp.experts.gate_up_proj"].shape == (8, 64, 64)
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())

    assert_same_parameters(load(tmp_path, OurV3), load(path, OurV3))


def test_skips_the_multi_token_prediction_layer(v3, tmp_path: Path) -> None:
    path, _ = v3
    state = load_file(str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 3
    # DeepSeek-V3's MTP module: a whole decoder layer plus its projections, as layer 3.
    mtp = {name.replace("layers.2.", "layers.3."): t.clone() for name, t in state.items() if "layers.2." in name}
    mtp |= {f"model.layers.3.{n}": torch.zeros(4) for n in ("enorm.weight", "hnorm.weight")}
    mtp |= {"model.layers.3.eh_proj.weight": torch.zeros(64, 128),
            "model.layers.3.shared_head.head.weight": torch.zeros(VOCAB, 64)}
    save_file(state | mtp, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))

    assert_same_parameters(load(tmp_path, OurV3), load(path, OurV3))

    # Past the MTP layers, an unknown layer is still an error.
    save_file(state | {"model.layers.4.input_layernorm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="model.layers.4.input_layernorm.weight"):
        load(tmp_path, OurV3)


def test_v2_checkpoint_without_q_compression_loads(v2) -> None:
    path, _ = v2
    model = load(path, OurV2)
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.shape == (4 * (16 + 8), 64)
    assert not hasattr(attn, "q_a_proj")
    assert model.model.layers[0].mlp.gate.e_score_correction_bias is None


# --------------------------------------------------------------------------- #
# config.json defaults
# --------------------------------------------------------------------------- #

DEEPSEEK_FIELDS = [
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "attention_bias", "bos_token_id", "eos_token_id", "kv_lora_rank", "q_lora_rank", "qk_nope_head_dim",
    "qk_rope_head_dim", "v_head_dim", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "first_k_dense_replace", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
]


@pytest.mark.parametrize(
    ("model_type", "config_cls", "own_fields"),
    [
        ("deepseek_v2", DeepseekV2Config, ["topk_method", "mlp_bias"]),
        ("deepseek_v3", DeepseekV3Config, ["rope_interleave", "num_nextn_predict_layers"]),
    ],
)
def test_sparse_config_json_takes_transformers_defaults(
    tmp_path: Path, model_type: str, config_cls: type, own_fields: list[str]
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    ours = ModelConfig.from_file(tmp_path / "config.json")
    ref = config_cls()
    for name in DEEPSEEK_FIELDS + own_fields:
        assert getattr(ours, name) == getattr(ref, name), name
    assert ours.rope_parameters == ref.rope_parameters == {"rope_theta": 10000.0, "rope_type": "default"}
