"""Quantized linear kernels (registry kind ``quant_kernel``): each built-in against
``IntWeight.dequantize`` through the conformance check, the choice by priority and
by the ``quant_kernel`` setting, a third party's kernel replacing the built-ins in
a real model, and the checkpoint tensors dropped once a kernel holds the weight."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from vframe import LLM, SamplingParams
from vframe.errors import ConfigError, ModelLoadError
from vframe.plugins import get_registry, hookimpl, register_plugin, unregister_plugin
from vframe.quant.kernels import (
    FP8_E4M3, INT8_PER_BLOCK, INT8_PER_TOKEN, INT_WEIGHT, MXFP4, NVFP4, WEIGHT_ONLY, Fp4Weight, Fp8Weight, IntWeight,
    QuantLinearKernel, QuantLinearSpec, choose_kernel,
)
from vframe.quant.kernels.builtin import ReferenceKernel
from vframe.quant.native_call import NativeCall, native_call, with_native
from vframe.testing import check_quant_kernel

from packers import gptq_quantize, write_quantized_llama
from defaults import BF16_FP4, BF16_FP8, BF16_INT4, BF16_INT8, bf16_int4_with_groups
from test_gptq import quant_config

CPU = torch.device("cpu")


def spec(bits: int = 4, group_size: int = 64, *, dtype: torch.dtype = torch.bfloat16, device: torch.device = CPU,
         act_order: bool = False, equal_groups: bool = True, activations: str = WEIGHT_ONLY,
         symmetric: bool = True, weight_type: str = INT_WEIGHT) -> QuantLinearSpec:
    return QuantLinearSpec(bits=bits, group_size=group_size, symmetric=symmetric, act_order=act_order,
                           equal_groups=equal_groups, activations=activations, in_features=192, out_features=48,
                           dtype=dtype, device=device, layer="model.layers.0.mlp.down_proj", weight_type=weight_type)


def _pairs_run() -> bool:
    from vframe.quant.kernels.builtin import pairs_available

    return pairs_available() is None


@pytest.mark.parametrize(
    ("kernel", "weight_type", "dtype", "activations"),
    [
        ("woq_cpu", INT_WEIGHT, torch.float32, WEIGHT_ONLY), ("woq_cpu_a8", INT_WEIGHT, torch.float32, INT8_PER_BLOCK),
        ("fp8_cpu", FP8_E4M3, torch.bfloat16, WEIGHT_ONLY), ("fp4_cpu", NVFP4, torch.float32, WEIGHT_ONLY),
        ("int4_cpu", INT_WEIGHT, torch.bfloat16, WEIGHT_ONLY), ("int8_dynamic", INT_WEIGHT, torch.float32, INT8_PER_TOKEN),
        *(pytest.param(name, INT_WEIGHT, torch.bfloat16, WEIGHT_ONLY, marks=pytest.mark.skipif(
            not _pairs_run(), reason="the pairs kernels need a CPU with AVX512-BF16"))
          for name in ("int4_pairs", "int6_pairs", "int8_pairs")),
        pytest.param("fp4_pairs", NVFP4, torch.bfloat16, WEIGHT_ONLY, marks=pytest.mark.skipif(
            not _pairs_run(), reason="the pairs kernels need a CPU with AVX512-BF16")),
        pytest.param("fp8_pairs", FP8_E4M3, torch.bfloat16, WEIGHT_ONLY, marks=pytest.mark.skipif(
            not _pairs_run(), reason="the pairs kernels need a CPU with AVX512-BF16")),
    ],
)
def test_builtin_kernels_bind_to_their_buffers(kernel: str, weight_type: str, dtype: torch.dtype, activations: str) -> None:
    """The C++ kernels hand a bound function to layers (plugin API 1.12); the check above
    compares it with apply bit for bit on every spec."""
    bits, group = (8, 192) if kernel == "int8_dynamic" else (4, 32 if weight_type == INT_WEIGHT else 16)
    bits = {"int8_pairs": 8, "int6_pairs": 6}.get(kernel, bits)
    s = spec(bits=bits, group_size=group, dtype=dtype, activations=activations, weight_type=weight_type)
    instance = get_registry("quant_kernel").load(kernel)(s, kernel)
    layer, bias = nn.Module(), torch.randn(48).to(dtype)
    g = torch.Generator().manual_seed(0)
    if weight_type == FP8_E4M3:
        weight = Fp8Weight(torch.randint(0, 0x7E, (48, 192), generator=g, dtype=torch.uint8), torch.rand(48, 1), 192)
    elif weight_type == NVFP4:
        weight = Fp4Weight(torch.randint(0, 256, (48, 96), generator=g, dtype=torch.uint8),
                           torch.full((48, 12), 0x38, dtype=torch.uint8), torch.ones(48), NVFP4)
    else:
        q = torch.randint(0, 2**bits, (48, 192), generator=g, dtype=torch.int32)
        weight = IntWeight(bits, q, torch.rand(48, 192 // group), None, group)
    instance.prepare(layer, weight)
    x = torch.randn(2, 192, generator=g).to(dtype)
    product = instance.bind(layer, bias)
    assert product is not None
    assert torch.equal(product(x), instance.apply(layer, x, bias))
    call = native_call(product)
    # where apply's path changes (int8_dynamic: one operator for every row count; int4_cpu and the pairs
    # kernels: from their PREFILL_ROWS rows bf16 GEMMs over the dequantized weight)
    pairs = ("int4_pairs", "int6_pairs", "int8_pairs", "fp4_pairs", "fp8_pairs")
    max_rows = {"int8_dynamic": None, "int4_cpu": 127, **dict.fromkeys(pairs, 1023)}.get(
        kernel, 32 if dtype == torch.float32 else 16)
    assert call is not None and call.max_rows == max_rows
    assert torch.equal(call(x), instance.apply(layer, x, bias))


def test_a_kernel_whose_bound_function_differs_from_apply_fails_the_check() -> None:
    class BoundWrong(ReferenceKernel):
        def bind(self, layer: nn.Module, bias: torch.Tensor | None):
            return lambda x: self.apply(layer, x, bias) * (1 + 2**-20)

    with pytest.raises(AssertionError, match=r"int4-g32-sym, float32, 1 tokens: bind\(layer, bias\) computes other"):
        check_quant_kernel(BoundWrong, quick=True)


def test_a_kernel_whose_rows_differ_from_its_weight_fails_the_check() -> None:
    """dequantize_rows is what a quantized embedding looks tokens up in: it must be those rows of
    dequantize_weight, which the head multiplies by."""

    class RowsWrong(ReferenceKernel):
        def dequantize_rows(self, layer: nn.Module, rows: torch.Tensor) -> torch.Tensor:
            return self.dequantize_weight(layer)[rows] * (1 + 2**-20)

    with pytest.raises(AssertionError, match=r"int4-g32-sym, float32: dequantize_rows\(layer, \[47, 0, 17, 0\]\) are not"):
        check_quant_kernel(RowsWrong, quick=True)


def test_a_kernel_whose_native_call_differs_from_its_bound_function_fails_the_check() -> None:
    """The operator call a bound function says it is must compute what it does: a decode plan
    calls that operator instead (plugin API 1.13)."""

    class NativeWrong(ReferenceKernel):
        def bind(self, layer: nn.Module, bias: torch.Tensor | None):
            def product(x: torch.Tensor) -> torch.Tensor:
                return self.apply(layer, x, bias)

            w = self.dequantize_weight(layer).to(self.spec.dtype) * (1 + 2**-10)
            return with_native(product, NativeCall(torch.ops.aten.linear.default, (w, None), bias))

    with pytest.raises(AssertionError, match=r"int4-g32-sym, float32, 1 tokens: the NativeCall that bind\(layer, bias\)"):
        check_quant_kernel(NativeWrong, quick=True)


@pytest.mark.parametrize(
    ("kernel", "dtype", "cases"),
    [
        ("reference", torch.float32, 81), ("reference", torch.bfloat16, 81),
        ("woq_cpu", torch.float32, 28), ("woq_cpu", torch.bfloat16, 28), ("woq_cpu", torch.float16, 28),
        # int8 activations per block of 32: 4 and 8 bit, groups of 32, 64 and per channel, sym and asym
        ("woq_cpu_a8", torch.float32, 12), ("woq_cpu_a8", torch.bfloat16, 12), ("woq_cpu_a8", torch.float16, 12),
        # FP8 weights: a scale per row, per 64 inputs, per 128 with a shorter last group
        ("fp8_cpu", torch.float32, 3), ("fp8_cpu", torch.bfloat16, 3), ("fp8_cpu", torch.float16, 3),
        # FP4 weights, NVFP4 and MXFP4: every code, their scales from the subnormals up
        ("fp4_cpu", torch.float32, 2), ("fp4_cpu", torch.bfloat16, 2), ("fp4_cpu", torch.float16, 2),
        # 4-bit table codes (bitsandbytes' NF4): groups of 64, 32 and per row, every code
        ("lut4_cpu", torch.float32, 3), ("lut4_cpu", torch.bfloat16, 3), ("lut4_cpu", torch.float16, 3),
        ("int4_cpu", torch.bfloat16, 10),
        # 4 bit in bfloat16: groups of 32, 64, 48 and per channel, sym and asym, act order with equal groups
        pytest.param("int4_pairs", torch.bfloat16, 14, marks=pytest.mark.skipif(
            not _pairs_run(), reason="int4_pairs needs a CPU with AVX512-BF16")),
        # 6 and 8 bit in bfloat16: the same specs
        pytest.param("int6_pairs", torch.bfloat16, 14, marks=pytest.mark.skipif(
            not _pairs_run(), reason="int6_pairs needs a CPU with AVX512-BF16")),
        pytest.param("int8_pairs", torch.bfloat16, 14, marks=pytest.mark.skipif(
            not _pairs_run(), reason="int8_pairs needs a CPU with AVX512-BF16")),
        # FP4 in bfloat16: NVFP4 and MXFP4, every code, scales from the subnormals up
        pytest.param("fp4_pairs", torch.bfloat16, 2, marks=pytest.mark.skipif(
            not _pairs_run(), reason="fp4_pairs needs a CPU with AVX512-BF16")),
        # FP8 in bfloat16: a scale per row, per 64 inputs, per 128 with a shorter last group
        pytest.param("fp8_pairs", torch.bfloat16, 3, marks=pytest.mark.skipif(
            not _pairs_run(), reason="fp8_pairs needs a CPU with AVX512-BF16")),
        # NF4 table codes in bfloat16: groups of 64, 32 and per row, every code
        pytest.param("lut4_pairs", torch.bfloat16, 3, marks=pytest.mark.skipif(
            not _pairs_run(), reason="lut4_pairs needs a CPU with AVX512-BF16")),
        ("int8_dynamic", torch.float32, 1), ("int8_dynamic", torch.bfloat16, 1),
    ],
)
def test_each_builtin_kernel_equals_the_dequantized_weight_on_every_spec_it_runs(
    kernel: str, dtype: torch.dtype, cases: int
) -> None:
    """Odd (48) groups, act order with a random permutation, offsets: whatever the kernel accepts."""
    assert len(check_quant_kernel(kernel, dtype=dtype)) == cases


def test_the_woq_builds_without_avx512_pass_the_same_check() -> None:
    """The AVX2 path (8 lanes, as on CPUs without AVX-512) and the portable loops (as on CPUs with
    neither), each built and checked in its own process, the two at once (a compile takes one core).
    Also W8A8's int8 products, which take vframe's own AVX2 loop where the CPU has no VNNI,
    and the int8-activation loops of woq_cpu_a8, the FP8 loops of fp8_cpu (F16C), fp4_cpu's and lut4_cpu's."""
    code = (
        "import torch\nfrom vframe.testing import check_quant_kernel\n"
        "print(len(check_quant_kernel('int8_dynamic', dtype=torch.float32, quick=True)))\n"
        "print(len(check_quant_kernel('woq_cpu_a8', dtype=torch.float32)))\n"
        "print(len(check_quant_kernel('fp8_cpu', dtype=torch.float32)))\n"
        "print(len(check_quant_kernel('fp4_cpu', dtype=torch.float32)))\n"
        "print(len(check_quant_kernel('lut4_cpu', dtype=torch.float32)))\n"
        "print(len(check_quant_kernel('woq_cpu', dtype=torch.bfloat16, quick=True)))"
    )
    runs = {
        cxxflags: subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env={**os.environ, "VFRAME_CPU_PAGED_CXXFLAGS": cxxflags})
        for cxxflags in ("-mno-avx512f", "-mno-avx512f -mno-avx2")
    }
    for cxxflags, process in runs.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, f"{cxxflags}: {stderr[-2000:]}"
        assert stdout.split()[-6:] == ["1", "12", "3", "2", "3", "12"], cxxflags


def test_woq_cpu_a8_quantizes_activation_blocks_as_quantize_per_block_spells_them() -> None:
    """The C++ blocks (its prefill path) bit for bit the PyTorch definition: ties to even,
    a block of zeros, blocks of very different scales."""
    from vframe.quant.kernels.builtin import _woq_ops, quantize_per_block

    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 3, 7)[:, None]
    x[0, :32] = 0.0
    x[1, :32] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5] + [0.25] * 26)  # d = 1: halves round to even
    assert quantize_per_block(x)[1, :6].tolist() == [127.0, 0.0, 2.0, 2.0, -0.0, -2.0]
    assert quantize_per_block(x)[0, :32].abs().sum() == 0
    for dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(_woq_ops().quantize_blocks(x.to(dtype)), quantize_per_block(x.to(dtype)))


def test_lut4_quantize_codes_a_float_weight_bit_for_bit_as_its_pytorch_definition() -> None:
    """bitsandbytes-style 4-bit quantization (``quantization="bitsandbytes"`` on a float checkpoint):
    the C++ operator against ``quantize_4bit_blocks_torch``, over blocks of 32 / 64 / 128, a last
    block shorter than the rest (divided by its absmax, kept at least 1e-38 as bitsandbytes keeps it;
    here all zeros), values on the table's midpoints (they take the lower code) and at +-absmax."""
    from vframe.quant.bitsandbytes import NF4, quantize_4bit_blocks_torch
    from vframe.quant.kernels.builtin import _woq_ops

    table = torch.tensor(NF4)
    boundaries = (table[:-1] + table[1:]) / 2
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4000, generator=g) * torch.logspace(-4, 2, 4000)  # blocks of very different scales
    x[64:128] = torch.cat([boundaries, -boundaries, torch.tensor([1.0, -1.0])]).repeat(2) * 2  # absmax 2: exact
    x[3968:] = 0.0  # 4000 = 62.5 blocks of 64: the last one 32 zeros
    for block in (32, 64, 128):
        codes, absmax = _woq_ops().lut4_quantize(x, boundaries, block)
        expected_codes, expected_absmax = quantize_4bit_blocks_torch(x, boundaries, block)
        assert torch.equal(codes, expected_codes) and torch.equal(absmax, expected_absmax), block
    codes, absmax = _woq_ops().lut4_quantize(x, boundaries, 64)
    unpacked = torch.stack([codes >> 4, codes & 0x0F], dim=-1).flatten()
    assert unpacked[64:79].tolist() == list(range(15)) and unpacked[94:96].tolist() == [15, 0]  # midpoints: lower
    assert absmax[1] == 2 and absmax[-1] == torch.tensor(1e-38) and unpacked[3968:].tolist() == [7] * 32


def test_a_kernel_is_offered_only_the_integer_widths_its_int_bits_name() -> None:
    """Plugin API 1.23: 6-bit IntWeights (GGUF's 5- and 6-bit types) go to kernels naming 6 in
    ``int_bits``; one written before (default (4, 8)) never sees them, whatever its can_implement."""
    from vframe.quant.kernels import refusal

    class TakesAnything(ReferenceKernel):
        int_bits = QuantLinearKernel.int_bits  # the default, as a kernel written for 1.22 has it

    six = spec(bits=6, group_size=32)
    assert refusal(TakesAnything, six) == "it takes 4 and 8-bit integer weights, not 6-bit"
    assert refusal(TakesAnything, spec(bits=8, group_size=32)) is None
    assert refusal(ReferenceKernel, six) is None
    assert get_registry("quant_kernel").load("woq_cpu").int_bits == (4, 8)
    every = check_quant_kernel(ReferenceKernel, quick=True)
    assert any(name.startswith("int6") for name in every)
    assert check_quant_kernel(TakesAnything, quick=True) == [name for name in every if not name.startswith("int6")]


def test_a_kernel_that_computes_wrong_fails_the_check() -> None:
    class OffByOne(ReferenceKernel):
        def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            return super().apply(layer, x, bias) + 1e-3

    with pytest.raises(AssertionError, match=r"int4-g32-sym, float32, 1 tokens: max error"):
        check_quant_kernel(OffByOne, quick=True)


@pytest.mark.parametrize(
    ("kernel_spec", "expected"),
    [
        (spec(4, 64), BF16_INT4),  # bfloat16, 4 bit: int4_pairs (35) with AVX512-BF16, else torch's kernel (30)
        (spec(4, 64, act_order=True), BF16_INT4),  # act order with equal groups: inputs sorted
        (spec(4, 64, dtype=torch.float32), "woq_cpu"),  # torch's int4 kernel is bfloat16 only
        (spec(8, 64), BF16_INT8),
        (spec(4, 48), bf16_int4_with_groups(48)),  # torch's kernel takes groups of 32 .. 256 that tile the inputs
        (spec(8, 192, activations=INT8_PER_TOKEN), "int8_dynamic"),
        (spec(4, 32, activations=INT8_PER_BLOCK), "woq_cpu_a8"),  # GGUF's blocks: llama.cpp's numerics
        (spec(8, 32, activations=INT8_PER_BLOCK, dtype=torch.float32), "woq_cpu_a8"),
        (spec(4, 48, activations=INT8_PER_BLOCK), "reference"),  # a block of 32 would straddle two groups
        (spec(8, 128, weight_type=FP8_E4M3), BF16_FP8),  # FP8 weights: only kernels that name the form
        (spec(8, 128, weight_type=FP8_E4M3, dtype=torch.float32), "fp8_cpu"),
        (spec(8, 192, weight_type=FP8_E4M3, device=torch.device("cuda")), "triton"),
        (spec(4, 16, weight_type=NVFP4, dtype=torch.float32), "fp4_cpu"),  # NVFP4: not woq_cpu's integers
        (spec(4, 32, weight_type=MXFP4), BF16_FP4),  # nor int4_cpu's: bfloat16, fp4_pairs with AVX512-BF16
        (spec(4, 16, weight_type=NVFP4, device=torch.device("cuda")), "triton"),
        (spec(4, 64, act_order=True, equal_groups=False), "reference"),  # q, k, v each in its own order
        (spec(4, 64, device=torch.device("cuda")), "triton"),  # the GPU's weight-only kernel
        (spec(4, 32, activations=INT8_PER_BLOCK, device=torch.device("cuda")), "reference"),  # GGUF's int8 blocks
    ],
)
def test_the_highest_priority_kernel_that_can_run_a_layer_runs_it(kernel_spec: QuantLinearSpec, expected: str) -> None:
    assert choose_kernel(kernel_spec).name == expected


@pytest.mark.parametrize(("fmt", "nan_byte"), [(NVFP4, 0x7F), (NVFP4, 0xFF), (MXFP4, 0xFF)])
def test_an_fp4_weight_with_a_nan_scale_is_refused_by_name(fmt: str, nan_byte: int) -> None:
    group = 16 if fmt == NVFP4 else 32
    scales = torch.full((48, 192 // group), 0x38, dtype=torch.uint8)  # e4m3 1.0; e8m0 2^-71
    scales[5, 1] = nan_byte
    weight = Fp4Weight(torch.zeros(48, 96, dtype=torch.uint8), scales, torch.ones(48), fmt)
    kernel = choose_kernel(spec(4, group, weight_type=fmt, dtype=torch.float32))
    assert kernel.name == "fp4_cpu"
    with pytest.raises(ModelLoadError, match=rf"model.layers.0.mlp.down_proj: a scale is NaN \({fmt} byte\)"):
        kernel.prepare(nn.Module(), weight)


def test_a_named_kernel_that_cannot_run_a_layer_is_refused_saying_why() -> None:
    with pytest.raises(
        ConfigError,
        match=r"quant_kernel='int4_cpu' cannot run model.layers.0.mlp.down_proj: 8-bit symmetric, groups of 64, "
        r"weight-only, \[48, 192\], bfloat16 on cpu: it runs 4-bit weight-only formats only",
    ):
        choose_kernel(spec(8, 64), "int4_cpu")
    with pytest.raises(
        ConfigError,
        match=r"quant_kernel='woq_cpu' cannot run model.layers.0.mlp.down_proj: 4-bit symmetric, groups of 64, "
        r"act order \(unequal groups\), weight-only, \[48, 192\], bfloat16 on cpu: its groups must each hold 64 "
        r"inputs, in the same order for every output",
    ):
        choose_kernel(spec(4, 64, act_order=True, equal_groups=False), "woq_cpu")
    with pytest.raises(
        ConfigError,
        match=r"quant_kernel='woq_cpu' cannot run model.layers.0.mlp.down_proj: FP8 e4m3, groups of 128, "
        r"weight-only, \[48, 192\], bfloat16 on cpu: it takes int weights, not fp8-e4m3",
    ):
        choose_kernel(spec(8, 128, weight_type=FP8_E4M3), "woq_cpu")


class DoubleCheckedKernel(ReferenceKernel):
    """A third party's kernel: the reference's arithmetic, counting its calls."""

    priority = 100
    calls = 0

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        type(self).calls += 1
        return super().apply(layer, x, bias)


class AcmeKernels:
    @staticmethod
    @hookimpl
    def vframe_register_quant_kernels(register) -> None:  # noqa: ANN001
        register("acme_int", DoubleCheckedKernel)


@pytest.fixture(scope="module")
def gptq_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gptq")
    write_quantized_llama(path, quant_config(4, 32, sym=False), lambda w, generator: gptq_quantize(
        w, bits=4, group_size=32, sym=False, desc_act=False, generator=generator
    ))
    return path


def _greedy(llm: LLM) -> tuple[list[list[int]], list[float]]:
    prompts = [{"prompt_token_ids": [3, 17, 42, 8, 77, 5]}, {"prompt_token_ids": list(range(1, 40))}]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, logprobs=0))
    return ([list(o.outputs[0].token_ids) for o in outs],
            [lp[t].logprob for o in outs for t, lp in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)])


def test_a_registered_kernel_of_higher_priority_runs_every_layer_and_quant_kernel_names_one(gptq_llama: Path) -> None:
    base = LLM(model=str(gptq_llama), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    layers = base.llm_engine.model_runner.model.model.layers
    assert {layer.mlp.gate_up_proj.quant_method.kernel.name for layer in layers} == {"woq_cpu"}
    tokens, logprobs = _greedy(base)
    register_plugin(AcmeKernels, "acme-kernels")
    try:
        assert "acme_int" in get_registry("quant_kernel").names()
        acme = LLM(model=str(gptq_llama), skip_tokenizer_init=True, dtype="float32", num_threads=2)
        acme_layers = acme.llm_engine.model_runner.model.model.layers
        assert acme_layers[0].self_attn.qkv_proj.quant_method.kernel.name == "acme_int"
        acme_tokens, acme_logprobs = _greedy(acme)
        assert DoubleCheckedKernel.calls > 0
        assert acme_tokens == tokens
        assert max(abs(a - b) for a, b in zip(acme_logprobs, logprobs)) < 1e-4
        named = LLM(model=str(gptq_llama), skip_tokenizer_init=True, dtype="float32", num_threads=2,
                    quant_kernel="reference")
        assert named.llm_engine.model_runner.model.model.layers[1].mlp.down_proj.quant_method.kernel.name == "reference"
        assert _greedy(named)[0] == tokens
    finally:
        unregister_plugin("acme-kernels")


def test_an_unknown_quant_kernel_is_refused_naming_the_known_ones(gptq_llama: Path) -> None:
    with pytest.raises(Exception, match=r"fp4_cpu, fp4_pairs, fp8_cpu, fp8_pairs, int4_cpu, int4_pairs, int6_pairs, int8_dynamic, "
                                        r"int8_pairs, lut4_cpu, lut4_pairs, reference, triton, woq_cpu, woq_cpu_a8"):
        LLM(model=str(gptq_llama), skip_tokenizer_init=True, dtype="float32", quant_kernel="marlin")


def test_the_checkpoint_tensors_are_dropped_once_the_kernel_holds_the_weight() -> None:
    """A 4-bit layer then holds its integers once, two per byte, not the checkpoint's words beside them."""
    from vframe.layers.linear import ReplicatedLinear
    from vframe.models.loader.load import weight_bytes
    from vframe.quant.gptq import GPTQConfig

    in_features, out_features = 256, 64
    packed = gptq_quantize(torch.randn(out_features, in_features), bits=4, group_size=64, sym=True,
                           desc_act=False, generator=torch.Generator().manual_seed(0))
    layer = ReplicatedLinear(in_features, out_features, bias=False, params_dtype=torch.float32,
                             quant_config=GPTQConfig.from_config(quant_config(4, 64)))
    for name, tensor in packed.tensors.items():
        getattr(layer, name).weight_loader(getattr(layer, name), tensor)
    layer.quant_method.process_weights_after_loading(layer)

    assert [name for name, _ in layer.named_parameters()] == []
    q_bytes = out_features * in_features // 2
    scale_bytes = out_features * (in_features // 64) * 4  # float32
    assert weight_bytes(layer) == q_bytes + scale_bytes + 0  # symmetric: no offsets (an empty tensor)
    assert torch.equal(layer.quant_method.dequantize_weight(layer).double(), packed.weight())


def test_int_weight_dequantize_is_the_definition() -> None:
    q = torch.tensor([[0, 15, 8, 3]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, 2.0]])
    offsets = torch.tensor([[1.0, -1.0]])
    w = IntWeight(4, q, scales, offsets, group_size=2).dequantize()
    assert w.tolist() == [[0.5 * (0 - 8) + 1, 0.5 * (15 - 8) + 1, 2.0 * (8 - 8) - 1, 2.0 * (3 - 8) - 1]]
    act_order = IntWeight(4, q, scales, None, group_size=2, g_idx=torch.tensor([1, 0, 0, 1])).dequantize()
    assert act_order.tolist() == [[2.0 * -8, 0.5 * 7, 0.5 * 0, 2.0 * -5]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_woq_cpu_multiplies_a_large_weight_by_many_rows_a_block_of_outputs_at_a_time(monkeypatch, dtype) -> None:
    """Above MAX_ROWS rows the weight is dequantized for a GEMM; above CHUNK_BYTES of it (an
    LM head) a block of output rows at a time, the last block partial: the same products,
    up to the GEMM's own summation order for another output width."""
    from vframe.quant.kernels.builtin import WoqCpuKernel

    generator = torch.Generator().manual_seed(3)
    out_features, in_features, group = 100, 128, 32
    weight = IntWeight(
        4, torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8),
        torch.rand(out_features, in_features // group, generator=generator) * 0.1,
        torch.randn(out_features, in_features // group, generator=generator) * 0.1, group,
    )
    kernel = choose_kernel(QuantLinearSpec.for_weight(weight, activations=WEIGHT_ONLY, dtype=dtype, layer="head"),
                           "woq_cpu")
    layer = nn.Module()
    kernel.prepare(layer, weight)
    x = torch.randn(40, in_features, generator=generator).to(dtype)  # more than MAX_ROWS in either dtype
    whole = kernel.apply(layer, x, None)
    # 30 output rows a block: 30, 30, 30 and 10
    monkeypatch.setattr(WoqCpuKernel, "CHUNK_BYTES", 30 * in_features * x.element_size())
    blocks = kernel.apply(layer, x, None)
    assert float((blocks.double() - whole.double()).abs().max()) <= 1e-6 * float(whole.double().abs().max())
    reference = x.double() @ weight.dequantize().double().T
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    assert float((blocks.double() - reference).abs().max()) <= tolerance * float(reference.abs().max())


@pytest.mark.skipif(not _pairs_run(), reason="the pairs kernels need a CPU with AVX512-BF16")
@pytest.mark.parametrize(
    ("kernel_name", "bits", "offsets"),
    [("int4_pairs", 4, True), ("int4_pairs", 4, False), ("int6_pairs", 6, True), ("int6_pairs", 6, False),
     ("int8_pairs", 8, True)],
)
# past the in-place tiles (4 bit: 64 rows); past a block of 256; from PREFILL_ROWS, the weight dequantized
# for bf16_gemm a chunk at a time (3 blocks a chunk here: 3, 3, 1)
@pytest.mark.parametrize("rows", [65, 300, 1100])
def test_a_pairs_kernel_multiplies_many_rows_as_bf16_gemm_multiplies_its_dequantized_pairs(
    kernel_name: str, bits: int, offsets: bool, rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the in-place tiles each thread dequantizes two blocks of 16 outputs at a time (here 7
    blocks: the last task holds one) and multiplies them as bf16_gemm does; from PREFILL_ROWS rows
    bf16_gemm takes the weight dequantized in chunks: either way bit for bit
    bf16_gemm(x, pairs_dequantize(w)), and within bfloat16's rounding of the float64 product."""
    from vframe.layers import cpu_ops
    from vframe.quant.kernels.builtin import _PairsKernel, _woq_ops

    monkeypatch.setattr(_PairsKernel, "CHUNK_BYTES", 3 * 16 * 128 * 2)

    generator = torch.Generator().manual_seed(5)
    out_features, in_features, group = 112, 128, 32
    weight = IntWeight(
        bits, torch.randint(0, 1 << bits, (out_features, in_features), generator=generator, dtype=torch.uint8),
        torch.rand(out_features, in_features // group, generator=generator) * 0.1,
        torch.randn(out_features, in_features // group, generator=generator) * 0.1 if offsets else None, group,
    )
    kernel = choose_kernel(QuantLinearSpec.for_weight(weight, activations=WEIGHT_ONLY, dtype=torch.bfloat16,
                                                      layer="x"), kernel_name)
    layer = nn.Module()
    kernel.prepare(layer, weight)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    got = kernel.apply(layer, x, None)
    q, scales, zeros, group_size = kernel._pairs_args(layer)
    pairs = _woq_ops().pairs_dequantize(q, scales, zeros, group_size, bits, kernel.zero_points)
    assert torch.equal(got, cpu_ops.bf16_gemm(x, pairs))
    reference = x.double() @ weight.dequantize().double().T
    assert float((got.double() - reference).abs().max()) <= 2**-7 * float(reference.abs().max())


@pytest.mark.skipif(not _pairs_run(), reason="fp4_pairs needs a CPU with AVX512-BF16")
@pytest.mark.parametrize("fmt", [NVFP4, MXFP4])
def test_fp4_pairs_multiplies_many_rows_as_bf16_gemm_multiplies_its_dequantized_pairs(fmt: str) -> None:
    """fp4_pairs past its in-place tiles: bit for bit bf16_gemm(x, fp4_pairs_dequantize(w))."""
    from vframe.layers import cpu_ops
    from vframe.quant.kernels.builtin import _woq_ops

    generator = torch.Generator().manual_seed(6)
    group = 16 if fmt == NVFP4 else 32
    scale_bytes = (0x30, 0x40) if fmt == NVFP4 else (120, 130)  # e4m3 0.5-1.9; e8m0 2^-7-2^3
    weight = Fp4Weight(torch.randint(0, 256, (112, 64), generator=generator, dtype=torch.uint8),
                       torch.randint(*scale_bytes, (112, 128 // group), generator=generator, dtype=torch.uint8),
                       torch.rand(112, generator=generator) + 0.5 if fmt == NVFP4 else torch.ones(112), fmt)
    kernel = choose_kernel(QuantLinearSpec.for_weight(weight, activations=WEIGHT_ONLY, dtype=torch.bfloat16,
                                                      layer="x"), "fp4_pairs")
    layer = nn.Module()
    kernel.prepare(layer, weight)
    x = torch.randn(40, 128, generator=generator).bfloat16()
    pairs = _woq_ops().fp4_pairs_dequantize(*kernel._args(layer))
    assert torch.equal(kernel.apply(layer, x, None), cpu_ops.bf16_gemm(x, pairs))


@pytest.mark.skipif(not _pairs_run(), reason="the pairs kernels need a CPU with AVX512-BF16")
@pytest.mark.parametrize(
    ("offsets", "zero_points", "bytes_per_group"),
    [
        ("gptq", True, 2 + 2),  # float16 scale and integer zero point: -scale z needs more bits
        ("gguf", False, 2 + 2),  # float16 d and m, as the file holds them
        ("none", False, 2),  # symmetric: the float16 scale alone
    ],
)
def test_int4_pairs_keeps_a_checkpoint_s_scales_and_zeros_in_float16(
    offsets: str, zero_points: bool, bytes_per_group: int
) -> None:
    """A layer holds about the checkpoint's packed bytes: integers two a byte, and per group of 64
    a float16 scale and, where there are offsets, a float16 zero (GGUF's m) or integer zero point
    (GPTQ / AWQ's z): the weight it multiplies by is IntWeight.dequantize's, exactly."""
    generator = torch.Generator().manual_seed(9)
    out_features, in_features, group = 64, 256, 64
    q = torch.randint(0, 16, (out_features, in_features), generator=generator, dtype=torch.uint8)
    scales = (torch.rand(out_features, in_features // group, generator=generator) * 0.02 + 0.001).half().float()
    if offsets == "gptq":  # w = s (q - z)
        z = torch.randint(0, 16, scales.shape, generator=generator).float()
        weight = IntWeight(4, q, scales, scales * (8 - z), group)
    elif offsets == "gguf":  # w = d q + m
        m = (-8 * scales * torch.rand(scales.shape, generator=generator)).half().float()
        weight = IntWeight(4, q, scales, m + 8 * scales, group)
    else:
        weight = IntWeight(4, q, scales, None, group)
    kernel = choose_kernel(QuantLinearSpec.for_weight(weight, activations=WEIGHT_ONLY, dtype=torch.bfloat16, layer="x"),
                           "int4_pairs")
    layer = nn.Module()
    kernel.prepare(layer, weight)
    assert kernel.zero_points == zero_points
    groups = out_features * in_features // group
    held = sum(b.numel() * b.element_size() for b in layer.buffers())
    assert held == out_features * in_features // 2 + groups * bytes_per_group
    assert torch.equal(kernel.dequantize_weight(layer), weight.dequantize())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 3, 9, 40])
def test_w8a8_in_one_call_equals_its_pytorch_spelling_bit_for_bit(tokens: int, dtype: torch.dtype) -> None:
    """int8_dynamic's C++ call (its own exact int8 products on AVX2 CPUs without VNNI and, given
    the weight's row sums, for up to 8 rows on AVX512-VNNI, 16 outputs a tile and the last 2 alone;
    torch._int_mm elsewhere) against quantize_per_token, torch._int_mm and the scaling in PyTorch:
    int32 sums are exact, so the outputs are equal, rounded to the activations' dtype as ``.to`` rounds
    (the bfloat16 tile's own rounding included: outputs down to float32 subnormals, a tie, halves)."""
    from vframe.quant.kernels.builtin import _scaled, _woq_ops, quantize_per_token

    generator = torch.Generator().manual_seed(tokens)
    weight = torch.randint(-127, 128, (50, 192), generator=generator, dtype=torch.int8)
    w_scale = torch.rand(50, generator=generator) * 0.01
    w_scale[:4] = torch.tensor([1e-38, 3e-41, 1.0, 0.5])  # subnormal outputs; large, exact ones
    x = (torch.randn(tokens, 192, generator=generator) * 3).to(dtype)
    xq, x_scale = quantize_per_token(x)
    acc = torch._int_mm(xq, weight.T)
    assert int(acc.abs().max()) > 1000  # sums large enough that a dropped or doubled product shows
    expected = _scaled(acc.float(), x_scale, w_scale, dtype, None)
    assert torch.equal(_woq_ops().int8_dynamic_mm(x, weight, w_scale), expected)
    # with the weight's row sums: up to 8 rows on AVX512-VNNI its own vpdpbusd loop, the same bits
    sums = weight.sum(dim=1, dtype=torch.int32)
    assert torch.equal(_woq_ops().int8_dynamic_mm(x, weight, w_scale, sums), expected)


@pytest.mark.parametrize("group", [32, 64, 256])
def test_int4_cpu_prefills_multiply_the_dequantized_weight_and_decodes_call_torchs_kernel(group: int) -> None:
    from vframe.quant import int4_cpu

    g = torch.Generator().manual_seed(group)
    out_features, in_features = 192, 512  # three blocks of 64 outputs in torch's packing
    q = torch.randint(0, 16, (out_features, in_features), generator=g, dtype=torch.int32)
    weight = IntWeight(4, q, torch.rand(out_features, in_features // group, generator=g) / 8,
                       torch.randn(out_features, in_features // group, generator=g) / 64, group)  # fmt: skip
    packed, scales_and_zeros = int4_cpu.pack(weight, group)
    exact = int4_cpu.unpack(packed, scales_and_zeros, group)  # float32, the kernel's own values
    dequantized = int4_cpu._dequantizer()(packed, scales_and_zeros, group)
    assert torch.equal(dequantized, exact.to(torch.bfloat16))
    bias = torch.randn(out_features, generator=g).to(torch.bfloat16)
    for rows in (1, int4_cpu.PREFILL_ROWS - 1, int4_cpu.PREFILL_ROWS, 300):
        x = torch.randn(rows, in_features, generator=g).to(torch.bfloat16)
        got = int4_cpu.matmul(x, packed, scales_and_zeros, group, bias)
        if rows < int4_cpu.PREFILL_ROWS:
            want = torch._weight_int4pack_mm_for_cpu(x, packed, group, scales_and_zeros) + bias
        else:
            want = torch.nn.functional.linear(x, dequantized) + bias
        assert torch.equal(got, want), rows
        reference = x.float() @ exact.T + bias.float()  # both paths within bfloat16 rounding of it
        tolerance = 2**-7 * reference.abs().max().item()  # outputs of up to ~30: a bfloat16 step is 0.125
        torch.testing.assert_close(got.float(), reference, atol=tolerance, rtol=0)


@pytest.mark.parametrize("kernel", ["fp8_cpu", pytest.param("fp8_pairs", marks=pytest.mark.skipif(
    not _pairs_run(), reason="the pairs kernels need a CPU with AVX512-BF16"))])
def test_fp8_kernels_refuse_a_weight_holding_e4m3_nan(kernel: str) -> None:
    s = spec(bits=8, group_size=192, dtype=torch.bfloat16, weight_type=FP8_E4M3)
    q = torch.randint(0, 0x7E, (48, 192), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    q[5, 7] = 0xFF  # -NaN
    instance = get_registry("quant_kernel").load(kernel)(s, kernel)
    with pytest.raises(ModelLoadError, match=r"^model.layers.0.mlp.down_proj: the FP8 weight holds NaN \(e4m3 bytes "
                                             r"0x7F / 0xFF\)$"):
        instance.prepare(nn.Module(), Fp8Weight(q, torch.rand(48, 1), 192))
