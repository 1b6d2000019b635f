"""FusedMoE gives each token the router-weighted sum of its experts' SwiGLU outputs."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator
from math import exp

import pytest
import torch
import torch.nn.functional as F

from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.moe import FusedMoE, expert_params_mapping, match_expert_weight, softmax_topk
from vframe.quant import onednn_packed

HIDDEN, INTER = 32, 48


def make_moe(num_experts: int, seed: int = 0) -> FusedMoE:
    layer = FusedMoE(num_experts, HIDDEN, INTER, params_dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)
    layer.w13_weight.data.copy_(torch.randn(layer.w13_weight.shape, generator=generator) * 0.2)
    layer.w2_weight.data.copy_(torch.randn(layer.w2_weight.shape, generator=generator) * 0.2)
    return layer


def per_token_reference(layer: FusedMoE, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate, up = (layer.w13_weight[e] @ x[t]).chunk(2)
            out[t] += weights[t, k] * (layer.w2_weight[e] @ (F.silu(gate) * up))
    return out


@pytest.mark.parametrize(
    ("num_tokens", "top_k", "num_experts"),
    [(1, 1, 4), (1, 2, 4), (7, 1, 4), (13, 2, 8), (64, 2, 8)],
)
def test_matches_per_token_loop(num_tokens: int, top_k: int, num_experts: int) -> None:
    layer = make_moe(num_experts)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(num_tokens, HIDDEN, generator=generator)
    weights, ids = softmax_topk(torch.randn(num_tokens, num_experts, generator=generator), top_k, renormalize=True)
    out = layer(x, weights, ids)
    assert out.shape == (num_tokens, HIDDEN) and out.dtype == torch.float32
    torch.testing.assert_close(out, per_token_reference(layer, x, weights, ids), rtol=1e-5, atol=1e-5)


def test_experts_without_tokens() -> None:
    layer = make_moe(6)
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(2))
    # Experts 0, 2 and 4 get no token; expert 5 gets two, out of token order.
    ids = torch.tensor([[5, 1], [3, 5], [1, 3]])
    weights = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.5, 0.5]])
    expected = per_token_reference(layer, x, weights, ids)
    torch.testing.assert_close(layer(x, weights, ids), expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_output_dtype() -> None:
    layer = make_moe(4).to(torch.bfloat16)
    x = torch.randn(5, HIDDEN).to(torch.bfloat16)
    weights, ids = softmax_topk(torch.randn(5, 4), 2, renormalize=True)
    out = layer(x, weights, ids)
    assert out.dtype == torch.bfloat16
    ref = per_token_reference(layer.float(), x.float(), weights, ids)
    torch.testing.assert_close(out.float(), ref, rtol=0.05, atol=0.05)


def test_softmax_topk_hand_computed() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0], [3.0, 0.0, 0.0, 3.5]])
    weights, ids = softmax_topk(logits, 2, renormalize=False)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32
    assert ids.tolist() == [[1, 2], [3, 0]]
    row0 = 1 + exp(2) + exp(1) + exp(-1)
    row1 = exp(3) + 2 + exp(3.5)
    expected = torch.tensor([[exp(2) / row0, exp(1) / row0], [exp(3.5) / row1, exp(3) / row1]])
    torch.testing.assert_close(weights, expected)

    # bfloat16 logits are routed in float32; renormalized over the chosen two.
    weights, ids = softmax_topk(logits.bfloat16(), 2, renormalize=True)
    assert ids.tolist() == [[1, 2], [3, 0]] and weights.dtype == torch.float32
    expected = torch.tensor([[exp(2) / (exp(2) + exp(1)), exp(1) / (exp(2) + exp(1))],
                             [exp(3.5) / (exp(3.5) + exp(3)), exp(3) / (exp(3.5) + exp(3))]])
    torch.testing.assert_close(weights, expected)


def test_weight_loader_places_gate_up_and_down() -> None:
    layer = FusedMoE(3, 4, 2, params_dtype=torch.float32)
    layer.w13_weight.data.zero_()
    layer.w2_weight.data.zero_()
    gate, up, down = torch.full((2, 4), 1.0), torch.full((2, 4), 3.0), torch.full((4, 2), 2.0)
    layer.w13_weight.weight_loader(layer.w13_weight, gate, expert_id=1, shard_id="w1")
    layer.w13_weight.weight_loader(layer.w13_weight, up, expert_id=1, shard_id="w3")
    layer.w2_weight.weight_loader(layer.w2_weight, down, expert_id=2, shard_id="w2")
    assert layer.w13_weight[1, :, 0].tolist() == [1.0, 1.0, 3.0, 3.0]
    assert layer.w13_weight[0].abs().sum() == 0 and layer.w13_weight[2].abs().sum() == 0
    assert layer.w2_weight[2].tolist() == down.tolist() and layer.w2_weight[:2].abs().sum() == 0
    with pytest.raises(ModelLoadError, match=r"has shape \(3, 4\), expert 0 shard w1 expects \(2, 4\)"):
        layer.w13_weight.weight_loader(layer.w13_weight, torch.zeros(3, 4), expert_id=0, shard_id="w1")


def test_fused_moe_holds_float_experts_only() -> None:
    class FakeQuant:
        @classmethod
        def get_name(cls) -> str:
            return "gptq"

    with pytest.raises(ConfigError, match=r"FusedMoE holds float experts; a quantized checkpoint's experts "
                       r"\(quantization='gptq'\) are vframe.layers.quantized_moe.QuantizedExperts"):
        FusedMoE(4, 8, 8, params_dtype=torch.float32, quant_config=FakeQuant(), prefix="model.layers.0.mlp.experts")


def test_expert_params_mapping_and_matching() -> None:
    mapping = expert_params_mapping(2, gate="w1", down="w2", up="w3")
    assert mapping == [
        ("experts.w13_weight", "experts.0.w1.", 0, "w1"),
        ("experts.w2_weight", "experts.0.w2.", 0, "w2"),
        ("experts.w13_weight", "experts.0.w3.", 0, "w3"),
        ("experts.w13_weight", "experts.1.w1.", 1, "w1"),
        ("experts.w2_weight", "experts.1.w2.", 1, "w2"),
        ("experts.w13_weight", "experts.1.w3.", 1, "w3"),
    ]
    assert match_expert_weight("model.layers.3.block_sparse_moe.experts.1.w3.weight", mapping) == (
        "model.layers.3.block_sparse_moe.experts.w13_weight", 1, "w3"
    )
    deepseek = expert_params_mapping(12, gate="gate_proj", down="down_proj", up="up_proj")
    assert match_expert_weight("model.layers.1.mlp.experts.11.down_proj.weight", deepseek) == (
        "model.layers.1.mlp.experts.w2_weight", 11, "w2"
    )
    assert match_expert_weight("model.layers.1.mlp.shared_experts.gate_proj.weight", deepseek) is None
    assert match_expert_weight("model.layers.1.mlp.gate.weight", deepseek) is None


@pytest.fixture
def bf16_gemm(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[bool]:
    """Whether FusedMoE may hold bfloat16 experts as cpu_ops.bf16_pairs (VFRAME_BF16_GEMM)."""
    from vframe.layers import cpu_ops

    monkeypatch.setenv("VFRAME_BF16_GEMM", "1" if request.param else "0")
    cpu_ops.bf16_gemm_available.cache_clear()
    if request.param and not cpu_ops.bf16_gemm_available():
        pytest.skip("bf16_gemm needs a CPU with AVX512-BF16")
    yield request.param
    cpu_ops.bf16_gemm_available.cache_clear()


@pytest.mark.skipif(not onednn_packed.onednn_bf16_available(), reason="oneDNN has no native bfloat16 here")
@pytest.mark.parametrize("bf16_gemm", [False, True], indirect=True, ids=["onednn", "bf16-pairs"])
def test_packed_experts_replace_the_stacked_weights(bf16_gemm: bool) -> None:
    """process_weights_after_loading (what a loaded model runs) packs each expert: as bfloat16
    pairs for cpu_ops.bf16_gemm where it runs, else for oneDNN. The stacked parameters are gone
    (memory is not doubled), their plain form comes back exactly; oneDNN's products are the
    stacked ones' bit for bit, bf16_gemm's within bfloat16 rounding of them."""
    from vframe.layers.moe import LAYOUT_BF16_PAIRS, LAYOUT_ONEDNN

    stacked = make_moe(8).to(torch.bfloat16)
    packed = copy.deepcopy(stacked)
    packed.process_weights_after_loading()
    assert packed.w13_packed is not None and len(packed.w13_packed) == len(packed.w2_packed) == 8
    assert "w13_weight" not in dict(packed.named_parameters())
    if bf16_gemm:
        assert packed.layout == LAYOUT_BF16_PAIRS and packed.w13_packed[0].shape == (2 * INTER // 16, HIDDEN // 2, 16, 2)
    else:
        assert packed.layout == LAYOUT_ONEDNN and all(w.is_mkldnn for w in packed.w13_packed)
    w13, w2 = packed.expert_weights()
    assert torch.equal(w13, stacked.w13_weight) and torch.equal(w2, stacked.w2_weight)
    generator = torch.Generator().manual_seed(4)
    for num_tokens in (1, 5, 64):  # some experts get no token at 1 and 5
        x = torch.randn(num_tokens, HIDDEN, generator=generator).bfloat16()
        weights, ids = softmax_topk(torch.randn(num_tokens, 8, generator=generator), 2, renormalize=True)
        got, expected = packed(x, weights, ids), stacked(x, weights, ids)
        if bf16_gemm:
            torch.testing.assert_close(got.float(), expected.float(), rtol=2**-6, atol=2**-6)
        else:
            assert torch.equal(got, expected)
    packed.process_weights_after_loading()  # a second call changes nothing
    assert torch.equal(packed.expert_weights()[0], w13)


@pytest.mark.parametrize("bf16_gemm", [False], indirect=True)
def test_packing_turned_off_keeps_the_stacked_weights(bf16_gemm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VFRAME_ONEDNN_PACKED_WEIGHTS", "0")
    layer = make_moe(4).to(torch.bfloat16)
    layer.process_weights_after_loading()
    assert layer.w13_packed is None and layer.expert_weights()[0] is layer.w13_weight


@pytest.mark.parametrize(("dtype", "packed"), [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)])
def test_bound_experts_run_one_operator_bit_for_bit_as_the_python_path(dtype: torch.dtype, packed: bool) -> None:
    """bind_forward hands the sort, the products, the activation and the sum to cpu_ops.cpp's
    moe_experts: the same operators on the same rows in the same order, so the same bits, with
    experts that get no token, top-1 and top-2, one token to a prefill's worth."""
    from vframe.layers import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the fused CPU operators are not built here")
    unbound = make_moe(8, seed=5).to(dtype)
    bound = copy.deepcopy(unbound)
    if packed:  # each expert's matrices in oneDNN's layout (packed tensors cannot be deep-copied)
        unbound.process_weights_after_loading()
        bound.process_weights_after_loading()
        assert unbound.w13_packed is not None
    bound.bind_forward()
    assert bound._bound is not None and (bound._bound.args[2] != 0) is packed and unbound._bound is None
    calls = []
    op = bound._bound.op
    bound._bound = dataclasses.replace(bound._bound, op=lambda *a: calls.append(1) or op(*a))
    generator = torch.Generator().manual_seed(6)
    with torch.no_grad():  # as the engine runs (the fused operators stay out of autograd)
        for num_tokens, top_k in ((1, 2), (5, 1), (5, 2), (64, 2), (300, 2)):
            x = torch.randn(num_tokens, HIDDEN, generator=generator).to(dtype)
            weights, ids = softmax_topk(torch.randn(num_tokens, 8, generator=generator), top_k, renormalize=True)
            assert torch.equal(bound(x, weights, ids), unbound(x, weights, ids)), (num_tokens, top_k)
    assert len(calls) == 5
    bound.bind_forward(enabled=False)
    assert bound._bound is None


def test_moe_experts_names_an_expert_id_out_of_range() -> None:
    from vframe.layers import cpu_ops

    if not cpu_ops.available():
        pytest.skip("the fused CPU operators are not built here")
    layer = make_moe(4)
    layer.bind_forward()
    x = torch.randn(2, HIDDEN)
    with torch.no_grad(), pytest.raises(RuntimeError, match="moe_experts: expert id 4 is not below 4"):
        layer(x, torch.tensor([[0.5, 0.5], [1.0, 0.0]]), torch.tensor([[0, 1], [4, 2]]))
