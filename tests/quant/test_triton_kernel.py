"""The ``triton`` quant kernel: weight-only integer, FP8 and FP4 layers on NVIDIA GPUs.

On the CPU its Triton GEMM runs under Triton's interpreter (the ``interpreted`` fixture
sets ``TRITON_INTERPRET=1``; tests/conftest.py imported Triton under it): the conformance
kit checks every spec it takes against the dequantized weights. Selection is checked on
specs that say ``cuda`` (no GPU needed); the ``gpu`` tests run the kit compiled and the
embedded SmolLM2 quantized to FP8 on CUDA.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from vframe.errors import ConfigError
from vframe.quant.kernels import (
    FP8_E4M3, INT8_PER_TOKEN, INT_WEIGHT, MXFP4, NVFP4, WEIGHT_ONLY, QuantLinearSpec, choose_kernel,
)
from vframe.quant.kernels.gpu import TritonKernel, pack_nibbles
from vframe.testing import check_quant_kernel
from defaults import BF16_INT4

CUDA = torch.device("cuda")


def spec(*, device: torch.device = CUDA, weight_type: str = INT_WEIGHT, bits: int = 4, group_size: int = 128,
         activations: str = WEIGHT_ONLY, dtype: torch.dtype = torch.bfloat16) -> QuantLinearSpec:
    return QuantLinearSpec(
        bits=bits, group_size=group_size, symmetric=True, act_order=False, equal_groups=True,
        activations=activations, in_features=1024, out_features=512, dtype=dtype, device=device,
        layer="model.layers.0.mlp.down_proj", weight_type=weight_type,
    )  # fmt: skip


@pytest.mark.parametrize(
    "dtype, quick, cases",
    [(torch.float32, False, 45), (torch.bfloat16, False, 45), (torch.float16, True, 20)],
)
def test_conforms_interpreted(interpreted: ModuleType, dtype: torch.dtype, quick: bool, cases: int) -> None:
    """Every weight-only spec of the kit: 4- and 8-bit integers (groups of 32, 48, 64, per
    channel; offsets; act order, also per fused shard), FP8 per row and block, NVFP4 and
    MXFP4 over all their codes; 1 to 40 tokens, with and without a bias."""
    ran = check_quant_kernel("triton", dtype=dtype, quick=quick)
    assert len(ran) == cases
    if not quick:
        assert {"int4-g48-asym-actorder-per-shard", "int8-channel-asym", "fp8-g128", "nvfp4", "mxfp4"} <= set(ran)
    assert not [case for case in ran if "w8a8" in case or "a8block" in case]  # int8 activations are not its


def test_pack_nibbles_puts_the_even_input_low_and_pads_an_odd_last_one() -> None:
    q = torch.tensor([[1, 2, 3, 4, 5], [15, 0, 7, 8, 9]], dtype=torch.uint8)
    assert pack_nibbles(q).tolist() == [[0x21, 0x43, 0x05], [0x0F, 0x87, 0x09]]


@pytest.mark.parametrize(
    "case, expected",
    [
        (dict(bits=4), "triton"),
        (dict(bits=8, group_size=1024), "triton"),
        (dict(weight_type=FP8_E4M3, bits=8), "triton"),
        (dict(weight_type=NVFP4, group_size=16), "triton"),
        (dict(weight_type=MXFP4, group_size=32), "triton"),
        (dict(bits=8, group_size=1024, activations=INT8_PER_TOKEN), "int8_dynamic"),  # torch._int_mm on the GPU
    ],
)
def test_cuda_layers_choose_it_and_w8a8_keeps_int8_dynamic(case: dict, expected: str) -> None:
    assert choose_kernel(spec(**case)).name == expected


def test_cpu_layers_never_choose_it_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cpu = spec(device=torch.device("cpu"))
    assert choose_kernel(cpu).name == BF16_INT4
    with pytest.raises(ConfigError) as e:
        choose_kernel(cpu, "triton")
    assert str(e.value) == (
        "quant_kernel='triton' cannot run model.layers.0.mlp.down_proj: 4-bit symmetric, groups of 128, "
        "weight-only, [512, 1024], bfloat16 on cpu: it runs on NVIDIA GPUs (device 'cuda'); on the CPU only "
        "under TRITON_INTERPRET=1, for tests"
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the listing is usable on a GPU")
def test_plugins_listing_says_why_it_cannot_run_here(monkeypatch: pytest.MonkeyPatch) -> None:
    from vframe.plugins.report import describe_plugins

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = {(r.kind, r.name): r for r in describe_plugins()}
    row = rows["quant_kernel", "triton"]
    assert not row.usable
    assert row.reasons == [
        "needs an NVIDIA GPU (CUDA); TRITON_INTERPRET=1 runs it on the CPU through Triton's interpreter, for tests only"
    ]
    assert rows["quant_kernel", "reference"].usable and rows["quant_kernel", "woq_cpu"].usable


def test_refuses_activations_it_does_not_quantize() -> None:
    assert TritonKernel.can_implement(spec(bits=8, group_size=1024, activations=INT8_PER_TOKEN)) == (
        "it runs weight-only layers only (activations in the model's dtype)"
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conforms_on_the_gpu(dtype: torch.dtype) -> None:
    assert len(check_quant_kernel("triton", dtype=dtype, device="cuda")) == 45


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_smollm2_fp8_on_cuda_equals_the_reference_kernel() -> None:
    """``quantization="fp8"`` (per-channel e4m3 weights made while loading) on CUDA takes the
    ``triton`` kernel and gives the ``reference`` kernel's greedy tokens in float32."""
    from vframe import LLM, SamplingParams

    prompts = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.", "1, 2, 3, 5, 8,"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    tokens = {}
    for kernel in ("triton", "reference"):
        llm = LLM(device="cuda", dtype="float32", quantization="fp8", quant_kernel=None if kernel == "triton" else kernel)
        model = llm.llm_engine.model_runner.model
        assert model.model.layers[0].mlp.down_proj.quant_method.kernel.name == kernel
        tokens[kernel] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert tokens["triton"] == tokens["reference"]
