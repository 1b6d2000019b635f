"""The fused CPU operators (RMSNorm, rotary, KV write, SwiGLU activation; vframe/layers/cpu_ops.py) against the
PyTorch expressions they replace, and the layers taking them."""

from __future__ import annotations

import pytest
import torch

from vframe.layers import cpu_ops
from vframe.models.llama import RMSNorm, RotaryEmbedding

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


class _Config:
    rope_theta = 10000.0
    max_position_embeddings = 4096
    rope_scaling = None


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def torch_rotary(positions, query, key, cache):  # noqa: ANN001, ANN201
    cos, sin = cache[positions].to(query.dtype).unsqueeze(1).chunk(2, dim=-1)
    qk = torch.cat([query, key], dim=1)
    x1, x2 = qk.chunk(2, dim=-1)
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return rotated[:, : query.shape[1]], rotated[:, query.shape[1]:]


def test_the_operators_build_here() -> None:
    assert cpu_ops.available()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "dim"), [(1, 64), (7, 64), (300, 64), (4, 48), (5, 20)])  # 48: 16 + 8 lanes, 20: a scalar tail
def test_rotary_is_bit_exact_on_views_of_a_fused_projection(dtype: torch.dtype, tokens: int, dim: int) -> None:
    heads, kv_heads = 9, 3  # SmolLM2's q / k heads
    g = torch.Generator().manual_seed(tokens)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g) * 4).to(dtype)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)  # strided views, as the attention layer cuts them
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    rope = RotaryEmbedding(_Config(), dim)
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    expected_q, expected_k = torch_rotary(positions, q, k, rope.cos_sin_cache)

    with torch.inference_mode():
        cpu_ops.rotary_neox_(positions, q, k, rope.cos_sin_cache)  # in place

    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # v untouched


# ulps relative to |value| * eps: a last-bit step counts as up to 2
@pytest.mark.parametrize(("dtype", "max_ulps"), [(torch.float32, 8), (torch.bfloat16, 2), (torch.float16, 2)])
@pytest.mark.parametrize("width", [576, 37])  # vectors only, and a scalar tail
def test_rms_norm_equals_the_expression_up_to_the_variance_s_last_bit(
    dtype: torch.dtype, max_ulps: int, width: int
) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, width, generator=g) * 3).to(dtype)
    norm = RMSNorm(width, 1e-5, dtype)
    norm.weight.data = torch.randn(width, generator=g).to(dtype)
    with torch.inference_mode():
        expected = torch_rms_norm(x, norm.weight, 1e-5)
        got = cpu_ops.rms_norm(x, norm.weight, 1e-5)

    ulp = torch.finfo(dtype).eps * expected.float().abs().clamp(min=torch.finfo(dtype).tiny)
    assert float(((got.float() - expected.float()).abs() / ulp).max()) <= max_ulps
    if dtype != torch.float32:  # a last-bit float32 difference rarely survives rounding to 16 bits
        assert float((got != expected).float().mean()) < 1e-3


def test_rms_norm_reads_rows_with_a_stride() -> None:
    x = torch.randn(5, 1000)[:, :576]  # rows 1000 apart
    weight = torch.randn(576)
    assert torch.allclose(cpu_ops.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6), rtol=1e-6, atol=1e-6)


def test_with_autograd_the_layers_keep_the_pytorch_expressions() -> None:
    """Gradients flow through the expressions; the operators are for inference."""
    norm = RMSNorm(64, 1e-5, torch.float32)
    x = torch.randn(3, 64, requires_grad=True)
    norm(x).sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_the_switch_turns_them_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VFRAME_CPU_FUSED_OPS", "0")
    cpu_ops.available.cache_clear()
    try:
        assert not cpu_ops.available()
    finally:
        monkeypatch.delenv("VFRAME_CPU_FUSED_OPS")
        cpu_ops.available.cache_clear()
    assert cpu_ops.available()


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_layers_take_the_operators_at_every_size(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """Decode steps and prefills alike, in every float dtype (the loops are vectorised)."""
    calls = []
    monkeypatch.setattr(cpu_ops, "rms_norm", lambda x, w, eps: calls.append("norm") or torch_rms_norm(x, w, eps))
    monkeypatch.setattr(cpu_ops, "rotary_neox_", lambda *args: calls.append("rope"))
    norm, rope = RMSNorm(64, 1e-5, dtype), RotaryEmbedding(_Config(), 64)
    with torch.inference_mode():
        for tokens in (1, 16, 17, 4096):
            x = torch.randn(tokens, 64).to(dtype)
            norm(x)
            rope(torch.arange(tokens) % 8, x.view(tokens, 1, 64), x.view(tokens, 1, 64).clone())
    assert calls == ["norm", "rope"] * 4


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_what_two_index_copies_write(dtype: torch.dtype) -> None:
    """The fused qkv output's k and v views (rows not contiguous with each other), three of
    five rows stored (the rest are padding past the slot mapping), slots in any order."""
    torch.manual_seed(0)
    qkv = torch.randn(5, (9 + 3 + 3) * 64).to(dtype)
    _, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    k, v = k.view(5, 3, 64), v.view(5, 3, 64)
    kv_cache = torch.full((2, 6, 16, 3, 64), float("nan"), dtype=dtype)
    slots = torch.tensor([37, 2, 95])
    expected = kv_cache.clone()
    expected[0].view(-1, 3, 64).index_copy_(0, slots, k[:3])
    expected[1].view(-1, 3, 64).index_copy_(0, slots, v[:3])

    assert cpu_ops.stores_kv(k, v, kv_cache, slots)
    cpu_ops.store_kv(k, v, kv_cache, slots)

    assert torch.equal(kv_cache.nan_to_num(7.0), expected.nan_to_num(7.0))
    assert kv_cache[0].view(-1, 3, 64)[37].equal(k[0]) and kv_cache[1].view(-1, 3, 64)[95].equal(v[2])


def test_store_kv_refuses_a_slot_outside_the_cache_and_int32_slots() -> None:
    k = v = torch.randn(1, 3, 64)
    kv_cache = torch.zeros(2, 6, 16, 3, 64)
    with pytest.raises(RuntimeError, match=r"store_kv: slot 96 outside the cache's 96"):
        cpu_ops.store_kv(k, v, kv_cache, torch.tensor([96]))
    assert not cpu_ops.stores_kv(k, v, kv_cache, torch.tensor([0], dtype=torch.int32))
    assert not cpu_ops.stores_kv(k, v.to(torch.bfloat16), kv_cache.to(torch.float8_e4m3fn), torch.tensor([0]))


@pytest.mark.parametrize("cache_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_rounds_into_a_float8_cache_as_the_pytorch_path(dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    """Bytes equal to the torch backend's store_rows (clamp to the largest finite value,
    then round to nearest even): values past the range, ties, subnormals, zeros of both
    signs and NaN included."""
    from vframe.backends.torch_attn import store_rows

    torch.manual_seed(1)
    k = torch.randn(4, 3, 64) * torch.logspace(-9, 5, 4)[:, None, None]
    k[0, 0, :8] = torch.tensor([1000.0, -1e6, 0.0, -0.0, float("nan"), 1.0625, 1.1875, 2.0**-9])
    k, v = k.to(dtype), (-k).to(dtype)
    slots = torch.tensor([5, 40, 17])
    kv_cache = torch.zeros(2, 4, 16, 3, 64, dtype=cache_dtype)
    expected = kv_cache.clone()
    store_rows(expected[0].view(-1, 3, 64), slots, k[:3])
    store_rows(expected[1].view(-1, 3, 64), slots, v[:3])

    assert cpu_ops.stores_kv(k, v, kv_cache, slots)
    cpu_ops.store_kv(k, v, kv_cache, slots)

    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    assert kv_cache[0].view(-1, 3, 64)[5, 0, :4].float().tolist() == (
        [448.0, -448.0, 0.0, -0.0] if cache_dtype == torch.float8_e4m3fn else [1024.0, -57344.0, 0.0, -0.0]
    )

    # calibrated scales (the decode plan's write): the bytes of x.float() / scale through the same rounding
    k_scale, v_scale = 0.0198, 3.3
    store_rows(expected[0].view(-1, 3, 64), slots, k[:3].float() / k_scale)
    store_rows(expected[1].view(-1, 3, 64), slots, v[:3].float() / v_scale)
    cpu_ops.store_kv(k, v, kv_cache, slots, k_scale, v_scale)
    assert torch.equal(kv_cache.view(torch.uint8), expected.view(torch.uint8))
    assert not torch.equal(expected[0].view(-1, 3, 64)[5].view(torch.uint8), store_rows_bytes(k[0], cache_dtype))
    with pytest.raises(RuntimeError, match="store_kv: k_scale / v_scale apply to a float8 cache only"):
        cpu_ops.store_kv(k, v, torch.zeros(2, 4, 16, 3, 64, dtype=dtype), slots, k_scale, v_scale)


def store_rows_bytes(rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """``rows`` as an unscaled float8 cache holds them, as bytes."""
    from vframe.backends.torch_attn import to_cache_dtype

    return to_cache_dtype(rows, cache_dtype).view(torch.uint8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 1536), (7, 1536), (300, 1536), (5, 37), (3, 24)])
def test_silu_and_mul_equals_the_swiglu_expression(dtype: torch.dtype, tokens: int, inter: int) -> None:
    """Widths that 16 divides and ones with a remainder (the scalar tail), saturated
    inputs (exp(-g) overflowing and vanishing), rows of a wider tensor (a stride)."""
    g = torch.Generator().manual_seed(tokens * inter)
    wide = (torch.randn(tokens, 2 * inter + 5, generator=g) * 4).to(dtype)
    wide[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0]).to(dtype)
    gate_up = wide[:, : 2 * inter]  # row stride 2 * inter + 5
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up

    got = torch.ops.vframe_cpu_ops.silu_and_mul(gate_up)

    assert got.shape == (tokens, inter) and got.dtype == dtype
    if torch.backends.cpu.get_cpu_capability() == "AVX2":  # torch's kernels and the operator: one expf
        assert torch.equal(got, expected)
    else:  # AVX-512 kernels take SLEEF's 16-wide expf, which may round differently
        torch.testing.assert_close(got, expected, rtol=4 * torch.finfo(dtype).eps, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_silu_and_mul_rounds_every_16_bit_value_as_pytorch(dtype: torch.dtype) -> None:
    """All 65,536 bit patterns as gates (subnormals, infinities, NaNs included), each times
    a random up: the vector loops' loads, rounding to nearest even and stores give PyTorch's
    bits (a NaN is a NaN in both)."""
    gate = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype).reshape(-1, 32)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(0)).to(dtype)
    expected = torch.nn.functional.silu(gate) * up

    got = torch.ops.vframe_cpu_ops.silu_and_mul(torch.cat([gate, up], dim=1))

    assert torch.equal(got.isnan(), expected.isnan())
    finite = ~expected.isnan()
    assert torch.equal(got[finite].view(torch.int16), expected[finite].view(torch.int16))


def test_the_mlp_takes_silu_and_mul_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    fused = torch.ops.vframe_cpu_ops.silu_and_mul
    monkeypatch.setattr(torch.ops.vframe_cpu_ops, "silu_and_mul", lambda x: calls.append(x.shape[0]) or fused(x))
    x = torch.randn(20, 64)
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            for tokens in (1, 17):
                cpu_ops.silu_and_mul(x[:tokens].to(dtype))
    assert calls == [1, 17, 1, 17]
    with torch.enable_grad():
        y = torch.randn(2, 64, requires_grad=True)
        cpu_ops.silu_and_mul(y).sum().backward()  # autograd keeps the expression, which has a gradient
    assert calls == [1, 17, 1, 17] and y.grad is not None


def test_argmax_equals_torch_s_argmax_ties_nan_and_inf_included() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 100, generator=g)
    x[0, 50] = x[0, 70] = float("nan")  # NaN is the maximum: the first one
    x[1] = float("-inf")  # nothing but -inf: index 0
    x[2, 10] = x[2, 90] = 1e9  # a tie: the first
    x[3, 99] = float("nan")  # in the scalar tail
    x[4, 3] = x[4, 97] = float("inf")
    x[5, 96:] = 50.0  # the maximum only in the tail
    wide = torch.randn(3, 49152 + 5, generator=g)[:, :49152]  # SmolLM2's vocabulary, strided rows
    for logits in (x, wide, torch.randn(2, 1, generator=g), torch.randn(4, 13, generator=g)):
        got = torch.ops.vframe_cpu_ops.argmax_rows(logits)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
        assert torch.equal(cpu_ops.argmax(logits), logits.argmax(-1))
    assert torch.ops.vframe_cpu_ops.argmax_rows(x)[:6].tolist() == [50, 0, 10, 99, 3, 96]
    assert torch.equal(cpu_ops.argmax(x.double()), x.double().argmax(-1))  # other dtypes: torch's own


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("pairs", "tokens", "hidden"), [(0, 3, 64), (1, 1, 8), (128, 64, 512), (37, 5, 100)])
def test_moe_combine_sums_what_index_add_sums(dtype: torch.dtype, pairs: int, tokens: int, hidden: int) -> None:
    """Bit for bit the expression FusedMoE used: each pair's row times its router weight in
    float32, added to its token's row in pair order; tokens without pairs stay 0."""
    assert cpu_ops.available()
    generator = torch.Generator().manual_seed(pairs + hidden)
    rows = torch.randn(pairs, hidden, generator=generator).to(dtype)
    token_ids = torch.randint(0, tokens, (pairs,), generator=generator)  # repeats: several experts a token
    weights = torch.rand(pairs, generator=generator)
    want = torch.zeros(tokens, hidden).index_add_(0, token_ids, rows.float() * weights[:, None])
    got = torch.ops.vframe_cpu_ops.moe_combine(rows, token_ids, weights, tokens)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(cpu_ops.moe_combine(rows, token_ids, weights, tokens), want)


def test_moe_combine_refuses_a_token_id_out_of_range_by_name() -> None:
    assert cpu_ops.available()
    rows, weights = torch.ones(2, 4), torch.ones(2)
    with pytest.raises(RuntimeError, match="moe_combine: token id 3 is not below 3"):
        torch.ops.vframe_cpu_ops.moe_combine(rows, torch.tensor([0, 3]), weights, 3)
    with pytest.raises(RuntimeError, match="moe_combine: weights must be float32"):
        torch.ops.vframe_cpu_ops.moe_combine(rows, torch.tensor([0, 1]), weights.double(), 3)


needs_bf16_gemm = pytest.mark.skipif(not cpu_ops.bf16_gemm_available(), reason="bf16_gemm needs a CPU with AVX512-BF16")


@needs_bf16_gemm
@pytest.mark.parametrize(("rows", "outputs", "inputs"), [(1, 16, 2), (7, 48, 64), (8, 2048, 512), (13, 80, 96),
                                                         (16, 512, 1024), (300, 64, 576), (0, 32, 4)])
def test_bf16_gemm_is_the_product_rounded_once_to_bfloat16(rows: int, outputs: int, inputs: int) -> None:
    """Tiles of 8 rows x 32 outputs and every remainder (1-7 rows, an odd block of 16 outputs):
    float32 sums of the exact bfloat16 products, rounded to bfloat16 once, so within half a
    bfloat16 step (2**-9 relative) of the float64 product, plus the float32 sums' own error."""
    generator = torch.Generator().manual_seed(rows * 7 + outputs)
    weight = (torch.randn(outputs, inputs, generator=generator) * 0.1).bfloat16()
    x = torch.randn(rows, inputs, generator=generator).bfloat16()
    pairs = cpu_ops.bf16_pairs(weight)
    assert pairs.shape == (outputs // 16, inputs // 2, 16, 2)
    assert torch.equal(cpu_ops.bf16_unpairs(pairs), weight)
    out = cpu_ops.bf16_gemm(x, pairs)
    assert out.shape == (rows, outputs) and out.dtype == torch.bfloat16
    exact = x.double() @ weight.double().T
    sums = x.double().abs() @ weight.double().abs().T  # bounds the float32 accumulation's error
    assert bool(((out.double() - exact).abs() <= exact.abs() * 2**-8 + sums * inputs * 2**-24).all())


@needs_bf16_gemm
def test_bf16_gemm_takes_rows_of_a_larger_tensor_and_names_what_is_wrong() -> None:
    weight = torch.randn(32, 64).bfloat16()
    x = torch.randn(10, 128).bfloat16()
    pairs = cpu_ops.bf16_pairs(weight)
    assert torch.equal(cpu_ops.bf16_gemm(x[:, :64], pairs), cpu_ops.bf16_gemm(x[:, :64].contiguous(), pairs))
    with pytest.raises(RuntimeError, match=r"bf16_gemm: w must be contiguous bfloat16 \[N / 16, K / 2, 16, 2\]"):
        cpu_ops.bf16_gemm(x, pairs)  # 128 inputs against a weight of 64
    with pytest.raises(RuntimeError, match="bf16_gemm: x must be bfloat16"):
        cpu_ops.bf16_gemm(x[:, :64].float(), pairs)
