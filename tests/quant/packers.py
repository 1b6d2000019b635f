"""Checkpoint tensors written the way the producing tools write them, for the
tests: GPTQ as AutoGPTQ / GPTQModel pack it, AWQ as AutoAWQ packs it.

Written from the tools' packing loops, not from vframe's readers: quantize a
float weight per group (GPTQ's ``Quantizer.find_params``), then OR each
integer into its int32 word. Each packer also returns the integers, scales and
zero points it stored, so a test can compute the weight the checkpoint means.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_llama import save_tiny_llama  # noqa: E402


@dataclass
class Quantized:
    tensors: dict[str, torch.Tensor]  # checkpoint name -> tensor, as the tool saves it
    q: torch.Tensor  # [out, in] int64 in [0, 2**bits)
    zeros: torch.Tensor  # [groups, out] int64
    scales: torch.Tensor  # [groups, out] float16
    g_idx: torch.Tensor  # [in] int64

    def weight(self) -> torch.Tensor:  # [out, in] float64: what the checkpoint means
        g = self.g_idx
        return self.scales.double()[g].T * (self.q - self.zeros[g].T).double()


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) as the int32 a checkpoint stores (numpy's uint32 -> int32)."""
    words = words & 0xFFFFFFFF
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's qweight loop: ``qweight[row] |= intweight[j] << (bits * (j - i))``
    for ``32 // bits`` consecutive rows ``j`` of ``values`` [n, m] -> [n / pack, m];
    at 3 bits its stream loop (``pack_3_bit_rows``)."""
    if bits == 3:
        return pack_3_bit_rows(values)
    pack = 32 // bits
    shifts = torch.arange(pack)[:, None] * bits  # [pack, 1]
    grouped = values.long().view(values.shape[0] // pack, pack, values.shape[1])  # [n / pack, pack, m]
    return (grouped << shifts).sum(dim=1)  # disjoint bits: the sum is the OR


def pack_3_bit_rows(values: torch.Tensor) -> torch.Tensor:
    """AutoGPTQ's (and auto-round's) 3-bit loop over 32 rows of ``values`` [n, m] at a time ->
    3 words [n * 3 / 32, m]: ten values a word, the eleventh split over two words (its low 2
    bits at 30-31, its high bit at bit 0 of the next; the 22nd's low bit at 31, high 2 bits at
    0-1 of the third)."""
    v = values.long()
    words = torch.zeros(v.shape[0] // 32 * 3, v.shape[1], dtype=torch.long)
    i = row = 0
    while row < words.shape[0]:
        for j in range(10):
            words[row] |= v[i + j] << (3 * j)
        words[row] |= v[i + 10] << 30
        words[row + 1] |= (v[i + 10] >> 2) & 1
        for j in range(10):
            words[row + 1] |= v[i + 11 + j] << (3 * j + 1)
        words[row + 1] |= v[i + 21] << 31
        words[row + 2] |= (v[i + 21] >> 1) & 3
        for j in range(10):
            words[row + 2] |= v[i + 22 + j] << (3 * j + 2)
        i, row = i + 32, row + 3
    return words & 0xFFFFFFFF


def pack_columns(values: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """The qzeros loop (and AWQ's, with its ``order``): column ``c`` of the result
    ORs ``values[:, c * pack + order[j]] << (bits * j)`` for ``j`` in ``0 .. pack - 1``
    (3 bits: the stream loop along the columns)."""
    if bits == 3:
        return pack_3_bit_rows(values.T).T.contiguous()
    pack = 32 // bits
    order = order or list(range(pack))
    shifts = torch.arange(pack) * bits  # [pack]
    grouped = values.long().view(values.shape[0], values.shape[1] // pack, pack)[:, :, order]  # slot j: order[j]
    return (grouped << shifts).sum(dim=2)  # disjoint bits: the sum is the OR


def find_params(x: torch.Tensor, bits: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """GPTQ's ``Quantizer.find_params`` for rows ``x`` [out, n]: scale and zero per row."""
    maxq = 2**bits - 1
    xmin = x.min(dim=1).values.clamp(max=0)
    xmax = x.max(dim=1).values.clamp(min=0)
    if sym:
        xmax = torch.maximum(xmin.abs(), xmax)
        xmin = torch.where(xmin < 0, -xmax, xmin)
    both_zero = (xmin == 0) & (xmax == 0)
    xmin, xmax = torch.where(both_zero, -1.0, xmin), torch.where(both_zero, 1.0, xmax)
    scale = (xmax - xmin) / maxq
    zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-xmin / scale)
    return scale, zero


def gptq_quantize(
    w: torch.Tensor,  # [out, in]
    *,
    bits: int,
    group_size: int,
    sym: bool,
    desc_act: bool,
    checkpoint_format: str = "gptq",
    generator: torch.Generator | None = None,
) -> Quantized:
    """A GPTQ checkpoint's tensors for ``w`` (round to nearest; GPTQ's error
    feedback changes the integers, not the layout)."""
    out_features, in_features = w.shape
    maxq = 2**bits - 1
    size = in_features if group_size == -1 else group_size
    num_groups = math.ceil(in_features / size)
    if desc_act:
        # Columns are quantized in activation order; the k-th of that order joins group k // size.
        perm = torch.randperm(in_features, generator=generator)
        g_idx = torch.empty(in_features, dtype=torch.int64)
        g_idx[perm] = torch.arange(in_features) // size
    else:
        g_idx = torch.arange(in_features) // size
    scales = torch.empty(num_groups, out_features, dtype=torch.float16)
    zeros = torch.empty(num_groups, out_features, dtype=torch.int64)
    for g in range(num_groups):
        scale, zero = find_params(w[:, g_idx == g].float(), bits, sym)
        scales[g], zeros[g] = scale.half(), zero.long()
    s, z = scales.float()[g_idx].T, zeros[g_idx].T  # [out, in]
    q = torch.clamp(torch.round(w.float() / s) + z, 0, maxq).long()

    if checkpoint_format == "gptq" and bits == 3:
        zero_words = pack_columns(zeros - 1, bits)  # v1 at 3 bits: one taken from each value before packing
    else:
        zero_words = pack_columns(zeros, bits)
    if checkpoint_format == "gptq" and bits != 3:
        # v1: GPTQModel subtracts one from every packed value, as a whole-word subtraction.
        zero_words = zero_words - sum(1 << shift for shift in range(0, 32, bits))
    tensors = {
        "qweight": to_int32(pack_rows(q.T, bits)),
        "qzeros": to_int32(zero_words),
        "scales": scales,
        "g_idx": g_idx.to(torch.int32),
    }
    return Quantized(tensors, q, zeros, scales, g_idx)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_quantize(w: torch.Tensor, *, group_size: int) -> Quantized:
    """An AWQ (GEMM) checkpoint's tensors for ``w`` [out, in]: asymmetric 4-bit
    groups of consecutive inputs, packed along the outputs in AWQ's order."""
    out_features, in_features = w.shape
    g_idx = torch.arange(in_features) // group_size
    groups = w.float().view(out_features, in_features // group_size, group_size)
    wmax, wmin = groups.amax(dim=2), groups.amin(dim=2)  # [out, groups]
    scale = ((wmax - wmin).clamp(min=1e-5) / 15).half()
    zero = torch.clamp(-torch.round(wmin / scale.float()), 0, 15).long()
    scales, zeros = scale.T.contiguous(), zero.T.contiguous()  # [groups, out]
    q = torch.clamp(torch.round(w.float() / scales.float()[g_idx].T) + zeros[g_idx].T, 0, 15).long()
    tensors = {
        "qweight": to_int32(pack_columns(q.T, 4, AWQ_ORDER)),  # [in, out / 8]
        "qzeros": to_int32(pack_columns(zeros, 4, AWQ_ORDER)),  # [groups, out / 8]
        "scales": scales,
    }
    return Quantized(tensors, q, zeros, scales, g_idx)


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_quantized_llama(
    path: Path, quant: dict[str, Any], quantize: Callable[[torch.Tensor, torch.Generator], Quantized],
    *, modules: tuple[str, ...] = PROJECTIONS,
    by_module: Callable[[str], Callable[[torch.Tensor, torch.Generator], Quantized] | None] | None = None,
    **config: object,
) -> torch.nn.Module:
    """A tiny random Llama (hidden 64, intermediate 112, 4 heads and 2 kv heads of
    24, vocabulary 96, head untied) whose linear ``modules`` (the decoder's
    projections; add ``"lm_head"`` for a quantized head) ``quantize`` packs into
    ``path`` as a quantizing tool saves a checkpoint: one safetensors file,
    ``quantization_config`` in config.json; ``by_module`` instead gives each linear
    module's own function from its name (``None``: kept float). Returns transformers'
    model holding the weights the checkpoint means."""
    hf_model = save_tiny_llama(path, **config)  # config: LlamaConfig fields other than the tiny ones
    for old in [*path.glob("*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    with torch.no_grad():
        for name, param in hf_model.state_dict().items():
            module = name.rpartition(".")[0]
            if name == "lm_head.weight" and hf_model.config.tie_word_embeddings:
                continue  # the embedding's tensor: a tied checkpoint holds it once
            leaf = module.rpartition(".")[2]
            if by_module is not None:
                how = by_module(module) if leaf in (*PROJECTIONS, "lm_head") else None
            else:
                how = quantize if leaf in modules else None
            if how is None:
                tensors[name] = param.contiguous()
                continue
            packed = how(param, generator)
            tensors |= {f"{module}.{key}": value for key, value in packed.tensors.items()}
            param.copy_(packed.weight())  # exact in float32
    save_file(tensors, str(path / "model.safetensors"))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return hf_model


def generates_like_transformers(path: Path, hf_model: torch.nn.Module) -> Any:
    """vframe (float32) serving ``write_quantized_llama``'s checkpoint at ``path``
    generates transformers' greedy tokens for three prompts; returns the ``LLM``."""
    from vframe import LLM
    from vframe.testing.models import assert_matches_transformers

    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype="float32", num_threads=2)
    prompts = [torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (5, 17, 40)]
    assert_matches_transformers(None, prompts, hf_model=hf_model, llm=llm, max_tokens=12)
    return llm


def assert_head_quantized(llm: Any, method_class: type) -> None:
    """The tiny Llama's LM head is a linear layer of ``method_class`` holding 4-bit codes
    (with their scales and zeros: under a quarter of its float32 bytes)."""
    from vframe.layers.linear import ReplicatedLinear
    from vframe.models.loader.load import weight_bytes

    head = llm.llm_engine.model_runner.model.lm_head
    assert isinstance(head, ReplicatedLinear) and isinstance(head.quant_method, method_class), head
    assert weight_bytes(head) < 96 * 64 * 4 / 4


# --------------------------------------------------------------------------- #
# compressed-tensors (llm-compressor): calculate_qparams, quantize, pack_to_int32
# --------------------------------------------------------------------------- #

@dataclass
class CTQuantized:
    tensors: dict[str, torch.Tensor]  # checkpoint name -> tensor, as compressed-tensors saves it
    q: torch.Tensor  # [out, in] int64, signed: [-2**(bits-1), 2**(bits-1)) or e4m3 values as float
    zeros: torch.Tensor  # [out, groups] int64, signed (0 when symmetric)
    scales: torch.Tensor  # [out, groups] as stored
    group_size: int

    def weight(self) -> torch.Tensor:  # [out, in] float64: what the checkpoint means
        g = torch.arange(self.q.shape[1]) // self.group_size
        return self.scales.double()[:, g] * (self.q.double() - self.zeros[:, g].double())


def pack_to_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors' ``pack_to_int32`` along the last dim of signed ``values``
    [rows, n]: add ``2**(bits - 1)``, then element ``j`` fills bits ``j * bits ..``
    of the stream, word ``j * bits // 32``, lowest bits first -> [rows, ceil(n * bits / 32)] int32."""
    unsigned = values.long() + (1 << (bits - 1))
    n = values.shape[1]
    words = torch.zeros(values.shape[0], -(-n * bits // 32), dtype=torch.int64)
    for j in range(n):  # 4 and 8 bits never straddle a word
        words[:, j * bits // 32] |= unsigned[:, j] << (j * bits % 32)
    return to_int32(words)


def ct_int_quantize(
    w: torch.Tensor, *, bits: int, strategy: str, group_size: int | None = None, symmetric: bool = True,
    packed: bool = True, scale_dtype: torch.dtype = torch.bfloat16,
) -> CTQuantized:
    """Integer weights as llm-compressor computes and saves them: per output row
    (channel) or per group of inputs, ``calculate_qparams`` (symmetric scale
    ``max |w| / ((q_max - q_min) / 2)``; asymmetric ``(max - min) / (q_max - q_min)``,
    zero ``q_min - min / scale``), ``q = clamp(round(w / scale + zero))``. Packed
    (pack-quantized) or int8 ``weight`` (int-quantized)."""
    out_features, in_features = w.shape
    size = in_features if strategy == "channel" else group_size
    num_groups = -(-in_features // size)
    q_min, q_max = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    g = torch.arange(in_features) // size
    w = w.float()
    mins = torch.stack([w[:, g == i].amin(dim=1) for i in range(num_groups)], dim=1).clamp(max=0)  # [out, groups]
    maxs = torch.stack([w[:, g == i].amax(dim=1) for i in range(num_groups)], dim=1).clamp(min=0)
    if symmetric:
        scales = (torch.maximum(mins.abs(), maxs) / ((q_max - q_min) / 2)).to(scale_dtype)
        zeros = torch.zeros_like(scales, dtype=torch.int64)
    else:
        scales = ((maxs - mins) / (q_max - q_min)).to(scale_dtype)
        zeros = torch.round((q_min - mins / scales.float()).clamp(q_min, q_max)).long()
    scales = torch.where(scales == 0, torch.finfo(scale_dtype).eps, scales)
    q = torch.clamp(torch.round(w / scales.float()[:, g] + zeros[:, g]), q_min, q_max).long()
    if packed:
        tensors = {"weight_packed": pack_to_int32(q, bits), "weight_scale": scales,
                   "weight_shape": torch.tensor([out_features, in_features])}
        if not symmetric:  # packed along the outputs: pack_to_int32(zero_point, packed_dim=0)
            tensors["weight_zero_point"] = pack_to_int32(zeros.T, bits).T.contiguous()
    else:
        tensors = {"weight": q.to(torch.int8), "weight_scale": scales}
    return CTQuantized(tensors, q, zeros, scales, size)


def ct_fp8_quantize(w: torch.Tensor, *, strategy: str, static_input: bool = False) -> CTQuantized:
    """float-quantized FP8: scale ``max |w| / 448`` per tensor ([1]) or per output row ([out, 1])."""
    w = w.float()
    absmax = w.abs().amax().reshape(1) if strategy == "tensor" else w.abs().amax(dim=1, keepdim=True)
    scales = (absmax / 448).to(torch.bfloat16)
    q = (w / scales.float()).clamp(-448, 448).to(torch.float8_e4m3fn)
    tensors = {"weight": q, "weight_scale": scales}
    if static_input:
        tensors["input_scale"] = torch.tensor([0.02])
    per_row = scales.reshape(-1, 1).expand(w.shape[0], 1)
    return CTQuantized(tensors, q.float(), torch.zeros(w.shape[0], 1, dtype=torch.int64), per_row, w.shape[1])


E2M1_STEPS = (  # compressed-tensors' cast_to_fp4: |x| at or below / under each bound rounds down to its value
    (0.25, True, 0.0), (0.75, False, 0.5), (1.25, True, 1.0), (1.75, False, 1.5), (2.5, True, 2.0),
    (3.5, False, 3.0), (5.0, True, 4.0),
)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def cast_to_fp4(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``cast_to_fp4``: the nearest e2m1 value, ties to the even
    mantissa (0.25 -> 0, 0.75 -> 1, 2.5 -> 2, 5 -> 4), above 5 -> 6, the sign kept."""
    magnitude = torch.full_like(x, 6.0)
    for bound, inclusive, value in reversed(E2M1_STEPS):
        below = x.abs() <= bound if inclusive else x.abs() < bound
        magnitude = torch.where(below, value, magnitude)
    return torch.where(x < 0, -magnitude, magnitude)


def pack_fp4_to_uint8(values: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' ``pack_fp4_to_uint8``: each e2m1 value's code (bit 3 the sign,
    bits 0-2 its index in 0, 0.5, 1, 1.5, 2, 3, 4, 6), two a byte, element ``2j`` low."""
    index = torch.bucketize(values.abs(), torch.tensor(E2M1))  # exact values: their index
    codes = index | torch.where(torch.signbit(values), 8, 0)
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


@dataclass
class NVFP4Quantized:
    tensors: dict[str, torch.Tensor]  # as compressed-tensors saves them
    values: torch.Tensor  # [out, in] float32, the e2m1 values
    scales: torch.Tensor  # [out, in / group] float32 on e4m3's grid (MXFP4: powers of two)
    global_scale: torch.Tensor  # [1] float32 (MXFP4: 1)
    group_size: int = 16

    def weight(self) -> torch.Tensor:  # [out, in] float64: what the checkpoint means, in float32 as ct dequantizes
        return (self.values * (self.scales / self.global_scale).repeat_interleave(self.group_size, dim=1)).double()


def ct_nvfp4_quantize(w: torch.Tensor, *, input_global_scale: bool = False) -> NVFP4Quantized:
    """NVFP4 as llm-compressor computes and compressed-tensors saves it: global scale
    ``448 * 6 / max |w|`` (``generate_gparam``), each group of 16's scale ``max |w_g| / 6``
    times it, rounded to e4m3; ``q = cast_to_fp4(w / (scale / global))``."""
    w = w.float()
    global_scale = (448.0 * 6.0 / w.abs().amax().clamp(min=torch.finfo(torch.float32).tiny)).reshape(1)
    group_max = w.view(w.shape[0], -1, 16).abs().amax(dim=-1)  # [out, in / 16]
    scales = (global_scale * (group_max / 6.0)).clamp(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.where(scales.float() == 0, torch.tensor(0.125).to(torch.float8_e4m3fn), scales)
    effective = (scales.float() / global_scale).repeat_interleave(16, dim=1)
    values = cast_to_fp4(w / effective)
    tensors = {"weight_packed": pack_fp4_to_uint8(values), "weight_scale": scales, "weight_global_scale": global_scale}
    if input_global_scale:
        tensors["input_global_scale"] = torch.tensor([1234.5])
    return NVFP4Quantized(tensors, values, scales.float(), global_scale)


def ct_mxfp4_quantize(w: torch.Tensor) -> NVFP4Quantized:
    """MXFP4 as llm-compressor computes and compressed-tensors saves it: each group of
    32's ``max |w|`` rounded to a power of two (``round_to_power_2``: up from 1.75 of one,
    else down), its e8m0 scale that power over 4 (``generate_mx_scales``: exponent
    ``127 + log2(p) - 2``), ``q = cast_to_fp4(w / scale)``."""
    w = w.float()
    group_max = w.view(w.shape[0], -1, 32).abs().amax(dim=-1)  # [out, in / 32]
    power = ((group_max.view(torch.int32) + (1 << 21)) & 0x7F800000).view(torch.float32)
    exponent = (127 + torch.floor(torch.log2(power)) - 2).clamp(0, 254).to(torch.uint8)
    scales = torch.exp2(exponent.float() - 127)
    values = cast_to_fp4(w / scales.repeat_interleave(32, dim=1))
    tensors = {"weight_packed": pack_fp4_to_uint8(values), "weight_scale": exponent}
    return NVFP4Quantized(tensors, values, scales, torch.ones(1), group_size=32)


@dataclass
class MXFP8Quantized:
    tensors: dict[str, torch.Tensor]  # as compressed-tensors (and ModelOpt) save them
    values: torch.Tensor  # [out, in] float32, the e4m3 values
    scales: torch.Tensor  # [out, in / 32] float32 powers of two

    def weight(self) -> torch.Tensor:  # [out, in] float64: what the checkpoint means
        return (self.values * self.scales.repeat_interleave(32, dim=1)).double()


def mxfp8_quantize(w: torch.Tensor) -> MXFP8Quantized:
    """MXFP8: each group of 32 inputs a power-of-two scale, the smallest that puts the group's
    ``max |w|`` at or below e4m3's 448, stored as its e8m0 byte (``127 + exponent``); ``weight``
    e4m3 ``w / scale``."""
    w = w.float()
    group_max = w.view(w.shape[0], -1, 32).abs().amax(dim=-1).clamp(min=2.0**-100)  # [out, in / 32]
    exponent = torch.ceil(torch.log2(group_max / 448)).clamp(-127, 127)
    scales = torch.exp2(exponent)
    q = (w / scales.repeat_interleave(32, dim=1)).clamp(-448, 448).to(torch.float8_e4m3fn)
    return MXFP8Quantized({"weight": q, "weight_scale": (exponent + 127).to(torch.uint8)}, q.float(), scales)


def random_weight(out_features: int, in_features: int, seed: int) -> torch.Tensor:
    w = torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed)) / in_features**0.5
    w[0] = w[0].abs()  # row 0 all positive: asymmetric zero points at q_min
    return w


def load_tensors(layer: torch.nn.Module, tensors: dict[str, torch.Tensor], shard_id: Any = None) -> None:
    """Checkpoint ``tensors`` into ``layer``'s parameters of those names, as the model loader
    hands them (through each parameter's ``weight_loader``; ``shard_id``: a fused layer's shard)."""
    for name, tensor in tensors.items():
        param = getattr(layer, name)
        param.weight_loader(param, tensor) if shard_id is None else param.weight_loader(param, tensor, shard_id)
