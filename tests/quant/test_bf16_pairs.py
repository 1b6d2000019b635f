"""bfloat16 linear weights held as pairs for vframe's AVX512-BF16 GEMM (``cpu_ops.bf16_gemm``,
vframe/layers/csrc/cpu_ops.cpp): where it runs, an unquantized bfloat16 layer's weight is
``bf16_pairs`` after loading; its products are the float32 sums of the exact bfloat16
products rounded once, its bound function and the decode plan's operator call give the same
bits, the plain weight comes back exactly, and SmolLM2 gives the tokens it gives on oneDNN."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vframe.layers import cpu_ops
from vframe.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear
from vframe.quant.base import bound_apply
from vframe.quant.native_call import native_call, native_result

pytestmark = pytest.mark.skipif(not cpu_ops.bf16_gemm_available(), reason="bf16_gemm needs a CPU with AVX512-BF16")


def _loaded(layer: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
    plain = layer.weight.detach().clone()
    layer.quant_method.process_weights_after_loading(layer)
    return layer, plain


@pytest.mark.parametrize("rows", [1, 5, 40, 300])
def test_a_bfloat16_layer_multiplies_by_pairs(rows: int) -> None:
    layer, plain = _loaded(MergedColumnParallelLinear(96, [80, 80], bias=True, params_dtype=torch.bfloat16))
    assert layer.weight.shape == (10, 48, 16, 2) and not layer.weight.is_mkldnn
    assert torch.equal(layer.quant_method.dequantize_weight(layer), plain)
    x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).bfloat16()
    with torch.no_grad():
        out = layer.quant_method.apply(layer, x, layer.bias)
        exact = (x.double() @ plain.double().T).bfloat16().double() + layer.bias.double()
        assert out.shape == (rows, 160) and out.dtype == torch.bfloat16
        # the product rounded once to bfloat16, then the bias added in bfloat16
        assert bool(((out.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-3).all())
        bound = bound_apply(layer.quant_method, layer, layer.bias)
        assert torch.equal(bound(x), out)
        call = native_call(bound)
        assert call is not None and call.op is torch.ops.vframe_cpu_ops.bf16_gemm.default
        assert torch.equal(native_result(bound, x), out)
        # a [B, T, in] input and rows of a wider tensor take the same operator
        assert torch.equal(layer.quant_method.apply(layer, x.reshape(1, rows, 96), layer.bias)[0], out)


def test_other_inputs_fall_back_to_the_plain_weight_and_other_dtypes_are_not_paired() -> None:
    layer, plain = _loaded(ColumnParallelLinear(64, 32, bias=False, params_dtype=torch.bfloat16))
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        odd_stride = torch.randn(3, 65).bfloat16()[:, :64]  # a row stride bf16_gemm cannot read in pairs
        assert torch.equal(layer.quant_method.apply(layer, odd_stride, None), F.linear(odd_stride, plain))
        assert layer.quant_method.apply(layer, x, None).shape == (3, 32)
    float32, _ = _loaded(ColumnParallelLinear(64, 32, bias=False, params_dtype=torch.float32))
    assert float32.weight.dim() == 2  # oneDNN's layout (or plain), never pairs
    odd, _ = _loaded(ColumnParallelLinear(64, 40, bias=False, params_dtype=torch.bfloat16))
    assert odd.weight.dim() == 2  # 40 outputs: not a multiple of 16


def test_smollm2_in_pairs_is_as_close_to_float32_as_on_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every linear of SmolLM2 in bfloat16 (30 x 4 and the head) held as pairs; the
    log-probabilities of a text's tokens no farther from the float32 model's than with
    oneDNN's bfloat16 products (greedy tokens may part at a bfloat16 near-tie: "def add(a, b):"
    does at its first token)."""
    from vframe import LLM, SamplingParams

    text = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is "
            "the capital of Germany. def add(a, b):\n    return a + b\n")
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)

    def text_logprobs(llm: LLM) -> torch.Tensor:
        ids = llm.get_tokenizer().encode(text)
        [out] = llm.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        return torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])

    reference = text_logprobs(LLM(dtype="float32", num_threads=2))
    errors = {}
    for bf16_gemm in ("1", "0"):
        monkeypatch.setenv("VFRAME_BF16_GEMM", bf16_gemm)
        cpu_ops.bf16_gemm_available.cache_clear()
        llm = LLM(dtype="bfloat16", num_threads=2)
        model = llm.llm_engine.model_runner.model
        paired = [n for n, m in model.named_modules() if getattr(getattr(m, "weight", None), "dim", lambda: 0)() == 4]
        assert len(paired) == (30 * 4 + 1 if bf16_gemm == "1" else 0)  # q/k/v, o, gate/up, down per layer; the head
        errors[bf16_gemm] = float((text_logprobs(llm) - reference).abs().mean())
        del llm
    cpu_ops.bf16_gemm_available.cache_clear()
    assert errors["1"] <= 1.25 * errors["0"], errors


@pytest.mark.parametrize(("rows", "inputs", "inter"), [(1, 96, 16), (7, 64, 48), (40, 576, 1536), (300, 128, 32)])
def test_gate_up_and_silu_in_one_operator_equal_the_two(rows: int, inputs: int, inter: int) -> None:
    """``bf16_gemm_silu``: silu_and_mul(bf16_gemm(x, W)) bit for bit, rows past a tile of 8 and
    past a block of 256, shards of one, three and 96 blocks; large values (silu's tail) too."""
    layer, plain = _loaded(MergedColumnParallelLinear(inputs, [inter, inter], bias=False, params_dtype=torch.bfloat16))
    pairs = layer.silu_pairs()
    assert pairs is layer.weight and pairs.shape == (2 * inter // 16, inputs // 2, 16, 2)
    x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows)).bfloat16() * 3
    two = cpu_ops.silu_and_mul(cpu_ops.bf16_gemm(x, pairs))
    one = cpu_ops.bf16_gemm_silu(x, pairs)
    assert one.shape == (rows, inter) and one.dtype == torch.bfloat16
    assert torch.equal(one, two)
    # torch's SwiGLU on the bfloat16 product (within a bfloat16 rounding of the exact one)
    product = cpu_ops.bf16_gemm(x, pairs)
    exact = x.double() @ plain.double().T
    assert bool(((product.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-2).all())
    gate, up = product.chunk(2, dim=-1)
    assert torch.equal(one, F.silu(gate).mul_(up))


def test_a_product_of_several_megabytes_is_streamed_to_memory_with_the_same_bits() -> None:
    """Outputs of 4 MiB and more are written with non-temporal stores (a prefill step's): the
    same bits as the same rows taken 256 at a time (ordinary stores), a ragged last tile too."""
    rows = 2101  # 2101 x 1024 bfloat16 outputs: 4.1 MiB
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(7)).bfloat16() * 3
    pairs = cpu_ops.bf16_pairs(torch.randn(2048, 64, generator=torch.Generator().manual_seed(8)).bfloat16() * 0.2)
    for product, width in ((cpu_ops.bf16_gemm, 2048), (cpu_ops.bf16_gemm_silu, 1024)):
        whole = product(x, pairs)
        assert whole.shape == (rows, width)
        chunks = torch.cat([product(x[i : i + 256], pairs) for i in range(0, rows, 256)])
        assert torch.equal(whole, chunks), product
        # and each row is what the rows alone give (the stores wrote every line, nothing stale)
        assert torch.equal(whole[-5:], product(x[-5:].clone(), pairs))
    product = cpu_ops.bf16_gemm(x, pairs)
    exact = x.double() @ cpu_ops.bf16_unpairs(pairs).double().T
    assert bool(((product.double() - exact).abs() <= exact.abs() * 2**-7 + 1e-2).all())


def test_only_an_unquantized_bias_free_pair_of_equal_shards_fuses() -> None:
    for sizes, bias, dtype in [([32, 32], True, torch.bfloat16), ([32, 48], False, torch.bfloat16),
                               ([32, 32], False, torch.float32)]:
        layer, _ = _loaded(MergedColumnParallelLinear(64, sizes, bias=bias, params_dtype=dtype))
        assert layer.silu_pairs() is None, (sizes, bias, dtype)
    fused, _ = _loaded(MergedColumnParallelLinear(64, [32, 32], bias=False, params_dtype=torch.bfloat16))
    assert fused.silu_pairs() is fused.weight
    with pytest.raises(RuntimeError, match=r"a \[gate; up\] weight as bf16_pairs"):
        cpu_ops.bf16_gemm_silu(torch.randn(2, 64).bfloat16(), cpu_ops.bf16_pairs(torch.randn(48, 64).bfloat16()))


def test_bound_llama_mlp_takes_the_fused_operator_and_gives_the_same_bits() -> None:
    """A bound LlamaMLP runs gate/up and SwiGLU as one operator for bfloat16 rows; unbound, or
    its gate/up layer swapped for another module (a LoRA wrapper), it makes the two calls."""
    from types import SimpleNamespace

    from vframe.models.llama import LlamaMLP

    config = SimpleNamespace(hidden_size=64, intermediate_size=96)
    mlp = LlamaMLP(config, torch.bfloat16, None, "mlp")
    for linear in (mlp.gate_up_proj, mlp.down_proj):
        _loaded(linear)
    x = torch.randn(33, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        unbound = mlp(x)
        mlp.bind_forward(True)
        assert mlp._fused is not None and mlp._fused[1] is mlp.gate_up_proj.weight
        calls = []
        real = cpu_ops.bf16_gemm_silu
        try:
            cpu_ops.bf16_gemm_silu = lambda *a: calls.append(1) or real(*a)
            assert torch.equal(mlp(x), unbound) and calls == [1]
            wrapped = torch.nn.Sequential(mlp.gate_up_proj)  # another module in its place
            mlp.gate_up_proj = wrapped
            assert torch.equal(mlp(x), unbound) and calls == [1]
        finally:
            cpu_ops.bf16_gemm_silu = real
        mlp.bind_forward(False)
        assert mlp._fused is None
