"""The worked int8 quantizer ("w8-test", tests/quant/w8_quantizer.py) end to end:
layer arithmetic, a whole model against transformers, the engine, the refusals."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from vframe import LLM, SamplingParams
from vframe.backends.torch_attn import TorchAttentionBackend
from vframe.errors import ConfigError, PluginError
from vframe.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from vframe.models.llama import LlamaForCausalLM
from vframe.models.loader import load_model, resolve_model
from vframe.plugins import hookimpl, register_plugin, unregister_plugin
from w8_quantizer import W8Config, W8LinearMethod, W8Plugin

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_llama import PagedRun, save_tiny_llama  # noqa: E402


class W8Bf16Only(W8Config):
    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.bfloat16]


class RefusingPlugin:
    @staticmethod
    @hookimpl
    def vframe_register_quantizers(register) -> None:
        register("w8-bf16-only", W8Bf16Only)


@pytest.fixture(scope="module", autouse=True)
def w8_registered() -> Iterator[None]:
    register_plugin(W8Plugin, "w8-test-plugin")
    register_plugin(RefusingPlugin, "w8-refusing-plugin")
    yield
    unregister_plugin("w8-refusing-plugin")
    unregister_plugin("w8-test-plugin")


# --------------------------------------------------------------------------- #
# (a) One layer against plain PyTorch
# --------------------------------------------------------------------------- #


def quantized_qkv(dtype: torch.dtype) -> tuple[QKVParallelLinear, torch.Tensor]:
    """SmolLM2's attention shape (9 heads, 3 kv heads of 64, hidden 576), loaded shard by shard."""
    g = torch.Generator().manual_seed(0)
    layer = QKVParallelLinear(576, 64, 9, 3, bias=True, quant_config=W8Config(), params_dtype=dtype)
    w = (torch.randn(576 + 2 * 192, 576, generator=g) / 24).to(dtype)  # [q 576 | k 192 | v 192, 576]
    for shard_id, part in zip("qkv", w.split([576, 192, 192]), strict=True):
        layer.weight.weight_loader(layer.weight, part, shard_id)
        layer.bias.weight_loader(layer.bias, part[:, 0], shard_id)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, w


def test_weights_become_int8_with_one_scale_per_output_channel() -> None:
    layer, w = quantized_qkv(torch.float32)

    assert isinstance(layer.quant_method, W8LinearMethod)
    assert (layer.weight.dtype, tuple(layer.weight.shape)) == (torch.int8, (960, 576))
    assert (layer.weight_scale.dtype, tuple(layer.weight_scale.shape)) == (torch.float32, (960,))
    assert int(layer.weight.abs().amax(dim=1).min()) == 127  # every row uses the whole range
    # round to nearest: no weight moves by more than half a step
    error = (layer.weight.float() * layer.weight_scale[:, None] - w).abs().amax(dim=1)
    assert bool((error <= w.abs().amax(dim=1) / 254 * (1 + 1e-6)).all())


@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_float32_apply_is_x_times_dequantized_weight(num_tokens: int) -> None:
    layer, _ = quantized_qkv(torch.float32)
    x = torch.randn(num_tokens, 576, generator=torch.Generator().manual_seed(1))

    out = layer(x)

    reference = x.double() @ (layer.weight.double() * layer.weight_scale.double()[:, None]).T + layer.bias.double()
    # float32 rounding only: the matmul over 576 terms, then the scale applied after it
    assert out.dtype == torch.float32
    assert float((out.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


def test_bfloat16_apply_uses_the_int8_kernel_within_bfloat16_rounding() -> None:
    layer, _ = quantized_qkv(torch.bfloat16)
    x = torch.randn(3, 576, generator=torch.Generator().manual_seed(2)).bfloat16()

    out = layer(x)

    reference = x.double() @ (layer.weight.double() * layer.weight_scale.double()[:, None]).T + layer.bias.double()
    assert out.dtype == torch.bfloat16
    # the output's own rounding (8 bits) and the bias added in bfloat16: 2 ulps
    assert float((out.double() - reference).abs().max()) <= 2**-7 * float(reference.abs().max())


def test_merged_and_row_parallel_layers_quantize_each_row() -> None:
    g = torch.Generator().manual_seed(3)
    gate, up, down = torch.randn(96, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(64, 96, generator=g)
    merged = MergedColumnParallelLinear(64, [96, 96], bias=False, quant_config=W8Config())
    merged.weight.weight_loader(merged.weight, gate, 0)
    merged.weight.weight_loader(merged.weight, up, 1)
    row = RowParallelLinear(96, 64, bias=False, quant_config=W8Config())
    row.weight.weight_loader(row.weight, down)
    for layer in (merged, row):
        layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(4, 64, generator=g)

    hidden = F.silu(merged(x)[:, :96]) * merged(x)[:, 96:]
    ref_gate_up = x @ torch.cat([gate, up]).T
    ref = F.silu(ref_gate_up[:, :96]) * ref_gate_up[:, 96:]
    # 1/254 of each row's largest weight, summed over 64 inputs of |x| ~ 1: a few percent at most
    assert float((hidden - ref).abs().max()) <= 0.05 * float(ref.abs().max())
    assert torch.equal(row.weight.float() * row.weight_scale[:, None], W8LinearMethod().dequantize_weight(row))


# --------------------------------------------------------------------------- #
# A whole model: quantized Llama == transformers' Llama holding the dequantized weights
# --------------------------------------------------------------------------- #


def test_quantized_tiny_llama_matches_transformers_with_the_same_dequantized_weights(tmp_path: Path) -> None:
    hf_model = save_tiny_llama(tmp_path, attention_bias=True)
    ours = load_model(
        resolve_model(str(tmp_path)), LlamaForCausalLM, TorchAttentionBackend, torch.float32, quant_config=W8Config()
    )
    for ours_layer, hf_layer in zip(ours.model.layers, hf_model.model.layers, strict=True):
        attn, mlp = ours_layer.self_attn, ours_layer.mlp
        assert {attn.qkv_proj.weight.dtype, attn.o_proj.weight.dtype, mlp.gate_up_proj.weight.dtype} == {torch.int8}
        q, k, v = attn.qkv_proj.quant_method.dequantize_weight(attn.qkv_proj).split([96, 48, 48])
        gate, up = mlp.gate_up_proj.quant_method.dequantize_weight(mlp.gate_up_proj).chunk(2)
        with torch.no_grad():
            for hf_proj, w in (
                (hf_layer.self_attn.q_proj, q),
                (hf_layer.self_attn.k_proj, k),
                (hf_layer.self_attn.v_proj, v),
                (hf_layer.self_attn.o_proj, attn.o_proj.quant_method.dequantize_weight(attn.o_proj)),
                (hf_layer.mlp.gate_proj, gate),
                (hf_layer.mlp.up_proj, up),
                (hf_layer.mlp.down_proj, mlp.down_proj.quant_method.dequantize_weight(mlp.down_proj)),
            ):
                hf_proj.weight.copy_(w)
    assert ours.lm_head.weight.dtype == torch.float32  # the head stays unquantized
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()

    logits = PagedRun(ours, [[4, 0, 6]]).step([tokens])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]

    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


# --------------------------------------------------------------------------- #
# (b) The engine: LLM(quantization="w8-test") on SmolLM2
# --------------------------------------------------------------------------- #

PROMPTS = [
    "The capital of France is",
    "Water boils at a temperature of",
    "In 1969, the first humans",
    "The largest planet in the solar system is",
]
PARAMS = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5)


def test_quantized_engine_follows_the_float32_engine(llm_fp32: LLM) -> None:
    """Per-row int8 moves each weight by at most 1/254 of its row's largest, which
    shifts the logits a little: greedy decoding can only take another path where
    the float model's top two tokens are nearly tied. So the bound is DESIGN.md §6's
    for transformers parity, plus a prefix: the first 5 tokens of every prompt are
    the float model's (measured: 19 of 20 or more on six prompts), and where the two
    first differ, each side's token is in the other's top 5."""
    quantized = LLM(dtype="float32", quantization="w8-test", max_model_len=256, num_threads=2)
    runner = quantized.llm_engine.model_runner
    assert runner.model.model.layers[0].mlp.down_proj.weight.dtype == torch.int8

    expected = llm_fp32.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = quantized.generate(PROMPTS, PARAMS, use_tqdm=False)

    for prompt, e, g in zip(PROMPTS, expected, got, strict=True):
        e_ids, g_ids = e.outputs[0].token_ids, g.outputs[0].token_ids
        assert g_ids[:5] == e_ids[:5], prompt
        first = next((i for i, (a, b) in enumerate(zip(e_ids, g_ids)) if a != b), None)
        if first is not None:
            assert e_ids[first] in g.outputs[0].logprobs[first], prompt
            assert g_ids[first] in e.outputs[0].logprobs[first], prompt


# --------------------------------------------------------------------------- #
# (c) Refusals
# --------------------------------------------------------------------------- #


def test_unknown_quantization_lists_the_known_names() -> None:
    with pytest.raises(PluginError, match=r"unknown quantization method 'int3'; known: .*w8-bf16-only, w8-test"):
        LLM(dtype="float32", quantization="int3", num_threads=2)


def test_a_method_refusing_the_dtype_says_which_it_takes() -> None:
    with pytest.raises(
        ConfigError,
        match=r"quantization='w8-bf16-only' cannot serve this configuration: "
        r"dtype='float32' is not supported \(supported: bfloat16\)",
    ):
        LLM(dtype="float32", quantization="w8-bf16-only", num_threads=2)


def test_a_model_class_without_quant_config_runs_only_unquantized(tmp_path: Path) -> None:
    class OldStyleLlama(LlamaForCausalLM):  # a model plugin written for plugin API 1.1
        def __init__(self, hf_config, attn_backend, dtype) -> None:
            super().__init__(hf_config, attn_backend, dtype)

    save_tiny_llama(tmp_path)
    resolved = resolve_model(str(tmp_path))
    load_model(resolved, OldStyleLlama, TorchAttentionBackend, torch.float32)  # unquantized: fine
    with pytest.raises(ConfigError, match=r"OldStyleLlama takes no quant_config, so it cannot run quantized \(w8-test\)"):
        load_model(resolved, OldStyleLlama, TorchAttentionBackend, torch.float32, quant_config=W8Config())
