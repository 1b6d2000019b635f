"""bfloat16 linear weights prepacked for oneDNN on the CPU (vframe/quant/onednn_packed.py):
the same numbers as ``F.linear``, the plain weight recoverable exactly, float32 and
layers that read their weight left alone, and SmolLM2's outputs unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vframe.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from vframe.models.loader.load import weight_bytes
from vframe.quant.onednn_packed import onednn_bf16_available

needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16_available(), reason="oneDNN has no native bfloat16 here")


def _loaded(layer: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_products_equal_f_linear(rows: int) -> None:
    layer = _loaded(MergedColumnParallelLinear(96, [80, 80], bias=True, params_dtype=torch.bfloat16))
    assert layer.weight.is_mkldnn
    plain_weight = layer.quant_method.dequantize_weight(layer)
    assert plain_weight.shape == (160, 96) and not plain_weight.is_mkldnn
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    assert torch.equal(layer(x), F.linear(x, plain_weight, layer.bias))
    # A [B, T, in] input, a column slice of a wider tensor (not contiguous): F.linear then
    # adds the bias in bfloat16 after the product, oneDNN inside it in float32; both are
    # within bfloat16 rounding of the float32 product.
    wide = torch.randn(3, rows, 2 * 96, dtype=torch.bfloat16)[..., :96]
    want = F.linear(wide.float(), plain_weight.float(), layer.bias.float())
    torch.testing.assert_close(layer(wide).float(), want, rtol=2**-7, atol=2**-7)


@needs_onednn_bf16
def test_the_plain_weight_comes_back_exactly_and_bytes_are_counted() -> None:
    layer = RowParallelLinear(64, 48, bias=False, params_dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(48, 64))
    before = layer.weight.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    assert torch.equal(layer.quant_method.dequantize_weight(layer), before)
    assert weight_bytes(layer) == 48 * 64 * 2


def test_float32_and_layers_that_read_their_weight_are_not_packed() -> None:
    fp32 = _loaded(ColumnParallelLinear(32, 16, params_dtype=torch.float32))
    assert not fp32.weight.is_mkldnn
    plain = ColumnParallelLinear(32, 16, params_dtype=torch.bfloat16)
    plain.needs_plain_weight = True
    assert not _loaded(plain).weight.is_mkldnn


@needs_onednn_bf16
def test_smollm2_bfloat16_outputs_are_unchanged_by_packing() -> None:
    # Greedy tokens and their logprobs, then the same engine with every packed weight
    # swapped back to its plain form: identical (both run oneDNN's kernel; packing only
    # skips a copy per call).
    from vframe import LLM, SamplingParams

    llm = LLM(dtype="bfloat16", num_threads=2)
    model = llm.llm_engine.model_runner.model
    packed = [n for n, m in model.named_modules() if getattr(getattr(m, "weight", None), "is_mkldnn", False)]
    assert len(packed) == 30 * 4 + 1 and "lm_head" in packed  # q/k/v, o, gate/up, down per layer; the head

    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time,"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=0)

    def run() -> tuple[list, list]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        return (
            [o.outputs[0].token_ids for o in outs],
            [[next(iter(p.values())).logprob for p in o.outputs[0].logprobs] for o in outs],
        )

    with_packing = run()
    for name in packed:
        layer = model.get_submodule(name)
        layer.weight = torch.nn.Parameter(layer.weight.to_dense(), requires_grad=False)
    assert run() == with_packing
