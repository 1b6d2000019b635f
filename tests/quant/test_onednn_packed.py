"""float32 and bfloat16 linear weights prepacked for oneDNN on the CPU
(vframe/quant/onednn_packed.py): bfloat16 gives the same numbers as ``F.linear``, float32
the same to float32 rounding (MKL and oneDNN sum in different orders), the plain weight
recoverable exactly, float16 and layers that read their weight left alone, packing off
with ``VFRAME_ONEDNN_PACKED_WEIGHTS=0``, and SmolLM2's outputs unchanged."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from vframe.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from vframe.models.loader.load import weight_bytes
from vframe.quant.onednn_packed import onednn_bf16_available, onednn_fp32_available, plain

needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16_available(), reason="oneDNN has no native bfloat16 here")


@pytest.fixture(autouse=True)
def onednn_for_bfloat16(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """bfloat16 weights in oneDNN's layout, not as bfloat16 pairs (tests/quant/test_bf16_pairs.py)."""
    from vframe.layers import cpu_ops

    monkeypatch.setenv("VFRAME_BF16_GEMM", "0")
    cpu_ops.bf16_gemm_available.cache_clear()
    yield
    cpu_ops.bf16_gemm_available.cache_clear()
needs_onednn_fp32 = pytest.mark.skipif(not onednn_fp32_available(), reason="float32 is packed on x86-64 only")


def _loaded(layer: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def _packed_fused_layer(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    """A loaded q/k/v-like fused layer with a bias, packed, and its weight's plain form."""
    layer = _loaded(MergedColumnParallelLinear(96, [80, 80], bias=True, params_dtype=dtype))
    assert layer.weight.is_mkldnn
    plain_weight = layer.quant_method.dequantize_weight(layer)
    assert plain_weight.shape == (160, 96) and plain_weight.dtype == dtype and not plain_weight.is_mkldnn
    return layer, plain_weight


@needs_onednn_bf16
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_packed_products_equal_f_linear(rows: int) -> None:
    layer, plain_weight = _packed_fused_layer(torch.bfloat16)
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


@needs_onednn_fp32
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_float32_weights_are_packed_and_products_match_f_linear(rows: int) -> None:
    # MKL (F.linear) and oneDNN sum in different orders: equal to float32 rounding, not bit-equal
    layer, plain_weight = _packed_fused_layer(torch.float32)
    x = torch.randn(rows, 96)
    want = F.linear(x.double(), plain_weight.double(), layer.bias.double())
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)
    assert weight_bytes(layer) == 160 * 96 * 4 + 160 * 4


def test_float16_and_layers_that_read_their_weight_are_not_packed() -> None:
    fp16 = _loaded(ColumnParallelLinear(32, 16, params_dtype=torch.float16))
    assert not fp16.weight.is_mkldnn
    for dtype in (torch.float32, torch.bfloat16):
        reads_weight = ColumnParallelLinear(32, 16, params_dtype=dtype)
        reads_weight.needs_plain_weight = True
        assert not _loaded(reads_weight).weight.is_mkldnn


def test_packing_can_be_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VFRAME_ONEDNN_PACKED_WEIGHTS", "0")
    assert not _loaded(ColumnParallelLinear(32, 16, params_dtype=torch.float32)).weight.is_mkldnn


@pytest.mark.parametrize(
    "dtype",
    [pytest.param("bfloat16", marks=needs_onednn_bf16), pytest.param("float32", marks=needs_onednn_fp32)],
)
def test_smollm2_outputs_are_unchanged_by_packing(dtype: str) -> None:
    # Greedy tokens and their logprobs, then the same engine with every packed weight
    # swapped back to its plain form: in bfloat16 identical (both run oneDNN's kernel;
    # packing only skips a copy per call), in float32 the same tokens and logprobs
    # within 1e-4 (plain float32 runs MKL).
    from vframe import LLM, SamplingParams

    llm = LLM(dtype=dtype, num_threads=2)
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

    tokens, logprobs = run()
    for name in packed:
        layer = model.get_submodule(name)
        layer.weight = torch.nn.Parameter(plain(layer.weight), requires_grad=False)
    plain_tokens, plain_logprobs = run()
    assert plain_tokens == tokens
    if dtype == "bfloat16":
        assert plain_logprobs == logprobs
    else:
        torch.testing.assert_close(torch.tensor(plain_logprobs), torch.tensor(logprobs), rtol=0, atol=1e-4)
