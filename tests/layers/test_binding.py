"""Layers bound to their loaded tensors (vframe/layers/binding.py) compute exactly what
the unbound layers do: per layer, and through whole engine steps."""

from __future__ import annotations

import pytest
import torch

from vframe import LLM, SamplingParams
from vframe.layers.binding import bind_model
from vframe.layers.linear import QKVParallelLinear, ReplicatedLinear, RowParallelLinear
from vframe.models.llama import RMSNorm, RotaryEmbedding
from vframe.quant.base import UnquantizedLinearMethod


class _RopeConfig:
    max_position_embeddings = 512
    rope_theta = 10000.0


def _pair(module: torch.nn.Module, *inputs: torch.Tensor):
    """``module``'s outputs on copies of ``inputs``, unbound then bound."""
    outs = []
    for enabled in (False, True):
        module.bind_forward(enabled)
        outs.append(module(*(t.clone() for t in inputs)))
    module.bind_forward(False)
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_bound_rms_norm_and_rotary_equal_unbound(dtype: torch.dtype, tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    norm = RMSNorm(64, 1e-5, dtype)
    norm.weight.data = torch.randn(64, generator=g).to(dtype)
    rope = RotaryEmbedding(_RopeConfig(), 64)
    x = torch.randn(tokens, 64, generator=g).to(dtype)
    heads = torch.randn(tokens, 4, 64, generator=g).to(dtype)  # a q/k norm's [T, H, D] (Qwen3)
    q, k = torch.randn(tokens, 6, 64, generator=g).to(dtype), torch.randn(tokens, 2, 64, generator=g).to(dtype)
    positions = torch.randint(0, 512, (tokens,), generator=g)
    norm.bind_forward()
    rope.bind_forward()
    assert norm._bound is not None and rope._bound is not None  # the fused operators built: bound paths exist
    with torch.inference_mode():
        unbound, bound = _pair(norm, x)
        assert torch.equal(bound, unbound)
        unbound, bound = _pair(norm, heads)
        assert torch.equal(bound, unbound)
        (uq, uk), (bq, bk) = _pair(rope, positions, q, k)
        assert torch.equal(bq, uq) and torch.equal(bk, uk)
        (uq, uk), (bq, bk) = _pair(rope, positions.to(torch.int32), q, k)  # not the fused operator's
        assert torch.equal(bq, uq) and torch.equal(bk, uk)
    with torch.enable_grad():  # outside inference the PyTorch expressions run, bound or not
        unbound, bound = _pair(norm, x)
        assert torch.equal(bound, unbound)


def test_bind_forward_takes_the_quant_method_s_function_and_gives_it_back() -> None:
    layer = QKVParallelLinear(64, 16, 4, 2, bias=True, params_dtype=torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        unbound = layer(x)
        layer.bind_forward()
        assert layer._bound is not None
        assert torch.equal(layer(x), unbound)
        layer.bind_forward(False)
        assert layer._bound is None


def test_a_method_that_overrides_apply_but_not_bind_keeps_its_apply() -> None:
    """A plugin written before plugin API 1.12 that subclasses UnquantizedLinearMethod to
    change apply: the inherited bind would multiply by the parent's weight; it is not used."""

    class Doubled(UnquantizedLinearMethod):
        def apply(self, layer, x, bias=None):
            return 2 * super().apply(layer, x, bias)

    layer = ReplicatedLinear(8, 4, bias=False, params_dtype=torch.float32)
    layer.quant_method = Doubled()
    layer.weight.data = torch.eye(4, 8)
    x = torch.arange(8.0)[None]
    layer.bind_forward()
    assert layer._bound is None
    assert layer(x).tolist() == [[0.0, 2.0, 4.0, 6.0]]


def test_a_row_parallel_layer_of_one_rank_binds_with_its_bias() -> None:
    layer = RowParallelLinear(64, 32, bias=True, params_dtype=torch.float32)
    layer.weight.data.normal_()
    layer.bias.data.normal_()
    x = torch.randn(2, 64)
    with torch.inference_mode():
        expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
        layer.bind_forward()
        assert torch.equal(layer(x), expected)


def _steps(llm: LLM, params: SamplingParams) -> list[tuple[list[int], list[float]]]:
    prompts = [
        "The capital of France is",
        "List three prime numbers and explain why each of them is prime, in one short sentence each, "
        "then say which of them is the largest and why:",
        "def fibonacci(n):",
    ]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [
        (list(o.outputs[0].token_ids), [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
        for o in outs
    ]


@pytest.mark.parametrize("kind", ["dense", "gguf-woq_cpu_a8"])
def test_engine_steps_are_bit_identical_bound_and_unbound(kind: str) -> None:
    """Prefill chunks beside decodes (a 24-token budget splits the prompts), greedy: the
    same tokens and the same logprobs to the last bit with every layer bound (as loaded)
    as with every layer unbound."""
    quant = {"quantization": "gguf", "quant_kernel": "woq_cpu_a8"} if kind != "dense" else {}
    # No prefix caching: the second run would attend over the first's cached blocks, in other chunks.
    llm = LLM(dtype="float32", max_model_len=256, num_threads=1, max_num_batched_tokens=24,
              enable_prefix_caching=False, **quant)
    model = llm.llm_engine.model_runner.model
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, ignore_eos=True)
    layer = model.model.layers[0]
    assert layer.self_attn.qkv_proj._bound is not None and layer.mlp.down_proj._bound is not None
    assert layer.input_layernorm._bound is not None and model.rotary_emb._bound is not None
    bound = _steps(llm, params)
    assert bind_model(model, enabled=False) > 0
    assert layer.self_attn.qkv_proj._bound is None and layer.input_layernorm._bound is None
    assert _steps(llm, params) == bound
