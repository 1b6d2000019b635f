"""Conformance check for quantized linear kernels: ``check_quant_kernel``.

The check builds random ``IntWeight``s over a matrix of specs (4 and 8 bit;
groups of 32, 64, an odd 48-wide group and one per output channel; float16 scales;
symmetric and with offsets, in groups of 32 as GGUF's ``d q + m`` with a float16 ``m``,
else from an integer zero point; inputs in order, in act order with equal groups, and in a
different act order per fused shard; weight-only, W8A8, and int8 activations per
block of 32 in groups of 32, 64 and per channel), random ``Fp8Weight``s (a scale
per row, per 64 inputs, per 128 with a shorter last group) for kernels whose
``weight_types`` name ``FP8_E4M3``, and random ``Fp4Weight``s (every code; NVFP4: e4m3
scales from subnormal to 448, a global scale per row; MXFP4: e8m0 scales 2^-127 to 2^127)
for those naming ``NVFP4`` / ``MXFP4``, and random ``Lut4Weight``s (every code into NF4's table,
groups of 64, 32 and one per row) for those naming ``LUT4``, keeps those the
kernel says it can run (``can_implement`` returns ``None``), and for each:

* ``prepare`` on a bare ``nn.Module`` layer, then ``dequantize_weight(layer)``
  equals ``IntWeight.dequantize()`` (``Fp8Weight.dequantize()``) within ``weight_tolerance(dtype)`` of each
  row's largest value (a kernel may round its scales to the activations' dtype);
* ``apply(layer, x, bias)`` for 1, 5, 20 and 40 tokens (one decode row, small and
  larger decode batches, a prefill chunk) has shape ``[T, out]``, the activation dtype, and is
  within ``OUTPUT_TOLERANCES[dtype]`` (relative to the largest reference value) of
  ``x @ W.T + bias`` in float64 with ``W = IntWeight.dequantize()``; for W8A8
  the reference quantizes ``x`` per token as ``quantize_per_token`` does, for
  ``INT8_PER_BLOCK`` per block as ``quantize_per_block`` does;
* ``dequantize_rows(layer, rows)``, where the kernel overrides it, equals those rows of
  ``dequantize_weight(layer)`` bit for bit (the last row, the first twice, row 17);
* ``bind(layer, bias)`` and ``bind(layer, None)``, where they return a function, give
  ``apply``'s outputs bit for bit on the same inputs (plugin API 1.12), and so does the
  operator call the function says it is (``vframe.quant.native_call``, plugin API 1.13).

It raises ``AssertionError`` naming the case, or when the kernel runs none of
the specs. Returns the names of the cases that ran.
"""

from __future__ import annotations

from itertools import product

import torch
from torch import nn

from vframe.quant.base import bound_apply
from vframe.quant.bitsandbytes import NF4
from vframe.quant.native_call import native_result
from vframe.quant.kernels import (
    FP4_GROUPS, FP8_E4M3, INT8_PER_BLOCK, INT8_PER_TOKEN, LUT4, MXFP4, NVFP4, WEIGHT_ONLY, Fp4Weight, Fp8Weight,
    IntWeight, Lut4Weight, QuantLinearKernel, QuantLinearSpec, reads_rows, refusal,
)

# largest |apply - reference| / max |reference| per activation dtype
OUTPUT_TOLERANCES: dict[torch.dtype, float] = {torch.float32: 2e-5, torch.bfloat16: 2**-6, torch.float16: 2**-9}


def weight_tolerance(dtype: torch.dtype) -> float:
    """Largest |dequantize_weight - IntWeight.dequantize()| relative to a row's max:
    float32 exact; narrower activations allow scales rounded to their dtype."""
    return 0.0 if dtype == torch.float32 else 2 * torch.finfo(dtype).eps


def _int_weight(spec: QuantLinearSpec, shards: int, generator: torch.Generator) -> IntWeight:
    out, inp, gs = spec.out_features, spec.in_features, spec.group_size
    groups = -(-inp // gs)
    q = torch.randint(0, 1 << spec.bits, (out, inp), generator=generator, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(out, groups, generator=generator) + 0.5) / (1 << spec.bits) / inp**0.5
    scales = scales.half().float()  # checkpoints store float16 scales
    offsets = None
    if not spec.symmetric and gs == 32:  # GGUF's Q4_1 / Q5_1: w = d q + m, d and m float16 (6 bit: m + 32 d)
        m = (-(1 << (spec.bits - 1)) * scales * (torch.rand(out, groups, generator=generator) + 0.5)).half().float()
        offsets = m + (1 << (spec.bits - 1)) * scales
    elif not spec.symmetric:  # GPTQ / AWQ: w = scale (q - zero), zero an integer
        zeros = torch.randint(0, 1 << spec.bits, (out, groups), generator=generator).float()
        offsets = scales * ((1 << (spec.bits - 1)) - zeros)
    g_idx = None
    if spec.act_order:
        def order() -> torch.Tensor:
            return (torch.arange(inp) // gs)[torch.randperm(inp, generator=generator)]
        if spec.equal_groups:
            g_idx = order()
        else:  # each fused shard (a slice of the outputs) in its own order
            g_idx = torch.cat([order().expand(out // shards, inp) for _ in range(shards)])
    return IntWeight(spec.bits, q, scales, offsets, gs, g_idx)


def _specs(dtype: torch.dtype, device: torch.device, quick: bool) -> list[QuantLinearSpec]:
    inp, out = 192, 48
    specs = []
    groups = (32, inp) if quick else (32, 64, 48, inp)
    for bits, gs, symmetric, order in product((4, 6, 8), groups, (True, False), ("none", "equal", "per-shard")):
        if gs == inp and order != "none":
            continue
        specs.append(QuantLinearSpec(
            bits=bits, group_size=gs, symmetric=symmetric, act_order=order != "none",
            equal_groups=order != "per-shard", activations=WEIGHT_ONLY, in_features=inp, out_features=out,
            dtype=dtype, device=device,
        ))
    specs.append(QuantLinearSpec(
        bits=8, group_size=inp, symmetric=True, act_order=False, equal_groups=True, activations=INT8_PER_TOKEN,
        in_features=inp, out_features=out, dtype=dtype, device=device,
    ))
    for bits, gs, symmetric in product((4, 8), (32, inp) if quick else (32, 64, inp), (True, False)):
        specs.append(QuantLinearSpec(
            bits=bits, group_size=gs, symmetric=symmetric, act_order=False, equal_groups=True,
            activations=INT8_PER_BLOCK, in_features=inp, out_features=out, dtype=dtype, device=device,
        ))
    for gs in (inp, 128) if quick else (inp, 64, 128):  # 128: a last group of 64 (block FP8's cut padding)
        specs.append(QuantLinearSpec(
            bits=8, group_size=gs, symmetric=True, act_order=False, equal_groups=inp % gs == 0,
            activations=WEIGHT_ONLY, in_features=inp, out_features=out, dtype=dtype, device=device,
            weight_type=FP8_E4M3,
        ))
    for fp4 in (NVFP4, MXFP4):
        specs.append(QuantLinearSpec(
            bits=4, group_size=FP4_GROUPS[fp4], symmetric=True, act_order=False, equal_groups=True,
            activations=WEIGHT_ONLY, in_features=inp, out_features=out, dtype=dtype, device=device, weight_type=fp4,
        ))
    for gs in (64,) if quick else (64, 32, inp):  # bitsandbytes' blocks of 64, and others
        specs.append(QuantLinearSpec(
            bits=4, group_size=gs, symmetric=True, act_order=False, equal_groups=True, activations=WEIGHT_ONLY,
            in_features=inp, out_features=out, dtype=dtype, device=device, weight_type=LUT4,
        ))
    return specs


def _fp8_weight(spec: QuantLinearSpec, generator: torch.Generator) -> Fp8Weight:
    """Random float weights rounded to e4m3, each group's largest |w| on 448."""
    out, inp, gs = spec.out_features, spec.in_features, spec.group_size
    w = torch.randn(out, inp, generator=generator) / inp**0.5
    groups = -(-inp // gs)
    padded = torch.nn.functional.pad(w, (0, groups * gs - inp)).view(out, groups, gs)
    scales = padded.abs().amax(dim=-1).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max  # [out, groups]
    q = (w / scales.repeat_interleave(gs, dim=1)[:, :inp]).to(torch.float8_e4m3fn)
    return Fp8Weight(q.view(torch.uint8), scales, gs)


def _fp4_weight(spec: QuantLinearSpec, generator: torch.Generator) -> Fp4Weight:
    """Random codes (all 16, zero's two signs included); NVFP4: e4m3 scale bytes from the
    subnormals to 448 (never NaN) and a global scale per row; MXFP4: e8m0 bytes around 2^0
    (0, 2^-127, included) and global scales of one."""
    out, inp, group = spec.out_features, spec.in_features, spec.group_size
    q = torch.randint(0, 256, (out, inp // 2), generator=generator, dtype=torch.int32).to(torch.uint8)
    if spec.weight_type == MXFP4:
        scales = torch.randint(112, 136, (out, inp // group), generator=generator, dtype=torch.int32).to(torch.uint8)
        scales[0, 0] = 0
        return Fp4Weight(q, scales, torch.ones(out), MXFP4)
    scales = torch.randint(0, 0x7F, (out, inp // group), generator=generator, dtype=torch.int32).to(torch.uint8)
    global_scale = (torch.rand(out, generator=generator) + 0.5) * 448 * 6 * inp**0.5
    return Fp4Weight(q, scales, global_scale, NVFP4)


def _lut4_weight(spec: QuantLinearSpec, generator: torch.Generator) -> Lut4Weight:
    """Random codes (all 16) into bitsandbytes' NF4 table, positive float32 group scales."""
    out, inp, group = spec.out_features, spec.in_features, spec.group_size
    q = torch.randint(0, 256, (out, inp // 2), generator=generator, dtype=torch.int32).to(torch.uint8)
    scales = (torch.rand(out, inp // group, generator=generator) + 0.5) / inp**0.5
    return Lut4Weight(q, scales, torch.tensor(NF4), group)


def _name(spec: QuantLinearSpec) -> str:
    if spec.weight_type in (NVFP4, MXFP4):
        return spec.weight_type
    group = "channel" if spec.group_size == spec.in_features else f"g{spec.group_size}"
    if spec.weight_type == LUT4:
        return f"lut4-{group}"
    if spec.weight_type == FP8_E4M3:
        return f"fp8-{group}"
    order = "" if not spec.act_order else "-actorder" if spec.equal_groups else "-actorder-per-shard"
    act = {INT8_PER_TOKEN: "-w8a8", INT8_PER_BLOCK: "-a8block"}.get(spec.activations, "")
    return f"int{spec.bits}-{group}-{'sym' if spec.symmetric else 'asym'}{order}{act}"


def check_quant_kernel(
    kernel: type[QuantLinearKernel] | str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    quick: bool = False,
) -> list[str]:
    """Check ``kernel`` (a class, or its ``quant_kernel`` registry name) on every
    spec of the matrix it can run; see the module."""
    from vframe.quant.kernels.builtin import quantize_per_block, quantize_per_token

    name = kernel if isinstance(kernel, str) else kernel.__name__
    if isinstance(kernel, str):
        from vframe.plugins import get_registry

        kernel = get_registry("quant_kernel").load(kernel)
    device = torch.device(device)
    ran = []
    for i, spec in enumerate(_specs(dtype, device, quick)):
        if refusal(kernel, spec) is not None:
            continue
        case = f"quant kernel {name}, {_name(spec)}, {str(dtype).removeprefix('torch.')}"
        generator = torch.Generator().manual_seed(i)
        layer = nn.Module()
        instance = kernel(spec, name)
        if spec.weight_type == FP8_E4M3:
            weight = _fp8_weight(spec, generator)
            instance.prepare(layer, Fp8Weight(weight.q.to(device), weight.scales.to(device), weight.group_size))
        elif spec.weight_type in (NVFP4, MXFP4):
            weight = _fp4_weight(spec, generator)
            instance.prepare(layer, Fp4Weight(weight.q.to(device), weight.scales.to(device),
                                              weight.global_scale.to(device), weight.format))
        elif spec.weight_type == LUT4:
            weight = _lut4_weight(spec, generator)
            instance.prepare(layer, Lut4Weight(weight.q.to(device), weight.scales.to(device), weight.table.to(device),
                                               weight.group_size))
        else:
            weight = _int_weight(spec, shards=3, generator=generator)
            instance.prepare(layer, IntWeight(weight.bits, weight.q.to(device), weight.scales.to(device),
                                              None if weight.offsets is None else weight.offsets.to(device),
                                              weight.group_size, None if weight.g_idx is None else weight.g_idx.to(device)))
        w = weight.dequantize()  # [out, in] float32
        got_w = instance.dequantize_weight(layer).float().cpu()
        assert got_w.shape == w.shape, f"{case}: dequantize_weight has shape {tuple(got_w.shape)}, not {tuple(w.shape)}"
        row_max = w.abs().amax(dim=1, keepdim=True)
        excess = float(((got_w - w).abs() - weight_tolerance(dtype) * row_max).max())
        assert excess <= 0, f"{case}: dequantize_weight differs from IntWeight.dequantize() by {excess:.3g} beyond tolerance"
        if reads_rows(instance):  # a kernel that looks rows up on its own (a quantized embedding's)
            ids = torch.tensor([spec.out_features - 1, 0, 17 % spec.out_features, 0], device=device)
            got_rows = instance.dequantize_rows(layer, ids).float().cpu()
            assert torch.equal(got_rows, got_w[ids.cpu()]), f"{case}: dequantize_rows(layer, {ids.tolist()}) are not those rows of dequantize_weight"
        bias = torch.randn(spec.out_features, generator=generator)
        for tokens in (1, 5, 20, 40):
            x = torch.randn(tokens, spec.in_features, generator=generator).to(dtype)
            out = instance.apply(layer, x.to(device), bias.to(dtype).to(device))
            _check_bound(instance, layer, x.to(device), bias.to(dtype).to(device), out, f"{case}, {tokens} tokens")
            assert tuple(out.shape) == (tokens, spec.out_features), f"{case}, {tokens} tokens: shape {tuple(out.shape)}"
            assert out.dtype == dtype, f"{case}, {tokens} tokens: output dtype {out.dtype}, expected {dtype}"
            assert torch.isfinite(out).all(), f"{case}, {tokens} tokens: NaN or inf in the output"
            if spec.activations == INT8_PER_TOKEN:
                xq, x_scale = quantize_per_token(x)
                ref = (xq.double() * x_scale.double()) @ w.double().T
            elif spec.activations == INT8_PER_BLOCK:
                ref = quantize_per_block(x).double() @ w.double().T
            else:
                ref = x.double() @ w.double().T
            ref = ref + bias.to(dtype).double()
            err = float((out.cpu().double() - ref).abs().max()) / max(float(ref.abs().max()), 1e-30)
            assert err <= OUTPUT_TOLERANCES[dtype], (
                f"{case}, {tokens} tokens: max error {err:.3g} of the largest output, "
                f"above {OUTPUT_TOLERANCES[dtype]:.3g}"
            )
        ran.append(_name(spec))
    assert ran, f"quant kernel {name} runs none of the specs of the check at {dtype} on {device}"
    return ran


def _check_bound(kernel: QuantLinearKernel, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor,
                 out: torch.Tensor, case: str) -> None:
    """``kernel.bind``'s functions (with and without the bias) against ``apply``, bit for bit."""
    for b, expected in ((bias, out), (None, kernel.apply(layer, x, None))):
        bound = bound_apply(kernel, layer, b)
        if bound is not None:
            got = bound(x)
            assert torch.equal(got, expected), (
                f"{case}: bind(layer, {'bias' if b is not None else 'None'}) computes other values than apply "
                f"(max difference {float((got.float() - expected.float()).abs().max()):.3g}); it must be apply, bit for bit"
            )
            native = native_result(bound, x)
            assert native is None or torch.equal(native, expected), (
                f"{case}: the NativeCall that bind(layer, {'bias' if b is not None else 'None'})'s function carries "
                f"computes other values than apply (max difference "
                f"{float((native.float() - expected.float()).abs().max()):.3g}); it must be apply, bit for bit"
            )
