"""GGUF kept quantized (``quantization="gguf"``): torch dequantizers equal to the
``gguf`` package's, kernels equal to dequantize-then-matmul, and the embedded
SmolLM2 Q4_1 running from its blocks as the dense conversion does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf import quants as gguf_quants
from gguf.quants import quantize as gguf_quantize

from vframe import LLM, SamplingParams
from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.embedding import TiedLMHead, VocabEmbedding
from vframe.layers.linear import QKVParallelLinear, ReplicatedLinear
from vframe.models.loader.gguf import iterate_gguf_quantized, read_gguf_tensors
from vframe.models.loader.load import quantized_linear_layers, weight_bytes
from vframe.models.loader.resolve import embedded_default_gguf, gguf_cache_path, resolve_model
from vframe.plugins import get_registry
from vframe.quant import gguf_dequant
from vframe.quant.gguf import GGUFConfig, GGUFLinearMethod
from vframe.quant.kernels.builtin import quantize_per_block
from vframe.quant.native_call import native_call
from vframe.quant.onednn_packed import onednn_fp32_available
from vframe.testing.quant import check_quant_method
from defaults import BF16_INT4, BF16_INT6, BF16_INT8, BF16_LUT4, PAIRS, bf16_int4_with_groups
from gguf_files import add_toy_vocabulary, write_out

# Byte offsets of each format's float16 scales (d, m, dmin) inside a block.
_F16_FIELDS = {
    "Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0],
    "Q2_K": [80, 82], "Q3_K": [108], "Q4_K": [0, 2], "Q5_K": [0, 2], "Q6_K": [208], "IQ4_NL": [0], "IQ4_XS": [0],
}
QUANTIZED = list(_F16_FIELDS)
# The embedded SmolLM2's 30 blocks of Q4_1 matrices (20 bytes per 32 weights), hidden 576,
# 3 kv heads of 64, MLP 1536: q, k, v, o, gate, up, down. llama.cpp's own tensor sizes
# (gguf.GGUFReader n_bytes): 207,360 for q and o, 69,120 for k and v, 552,960 for gate, up and down.
SMOLLM_PACKED_LINEAR_BYTES = 30 * 576 * (576 + 192 + 192 + 576 + 3 * 1536) * 20 // 32
assert SMOLLM_PACKED_LINEAR_BYTES == 30 * (2 * 207_360 + 2 * 69_120 + 3 * 552_960)
# Its token embedding (tied to the LM head): Q8_0 [49152, 576], 34 bytes per 32 weights (n_bytes 30,081,024);
# the 61 norm weights of 576 are F32.
SMOLLM_EMBEDDING_BYTES = 49152 * 576 * 34 // 32
assert SMOLLM_EMBEDDING_BYTES == 30_081_024
SMOLLM_NORM_VALUES = (30 * 2 + 1) * 576
# The dense float32 conversion: 134,515,008 weights of 4 bytes.
SMOLLM_DENSE_FP32_BYTES = 4 * (30 * 576 * (576 + 192 + 192 + 576 + 3 * 1536) + 49152 * 576 + SMOLLM_NORM_VALUES)
assert SMOLLM_DENSE_FP32_BYTES == 538_060_032


def random_rows(ggml_type: str, rows: int, in_features: int, seed: int) -> np.ndarray:
    """uint8 [rows, row bytes]: random bits, with finite float16 scales of about 0.01."""
    rng = np.random.default_rng(seed)
    block_size, type_size, _ = gguf_dequant.FORMATS[ggml_type]
    blocks = rng.integers(0, 256, (rows * in_features // block_size, type_size), dtype=np.uint8)
    for offset in _F16_FIELDS[ggml_type]:
        scales = rng.normal(0, 0.01, (blocks.shape[0], 1)).astype(np.float16)
        blocks[:, offset : offset + 2] = scales.view(np.uint8)
    return blocks.reshape(rows, -1)


def gguf_weight(rows: np.ndarray, ggml_type: str) -> torch.Tensor:  # [out, in] float32, by the gguf package
    return torch.from_numpy(gguf_dequantize(rows, GGMLQuantizationType[ggml_type]).astype(np.float32))


def reference_config() -> GGUFConfig:
    """GGUF with quant_kernel="reference": every segment keeps the file's bytes."""
    config = GGUFConfig()
    config.quant_kernel = "reference"
    return config


def load_layer(layer, shards: list[tuple[str | int | None, str, np.ndarray]]) -> None:
    """Load ``(shard id, ggml type, rows)`` through the parameters' own loaders, as a checkpoint does."""
    for shard_id, ggml_type, rows in shards:
        for name, tensor in (
            ("qweight_type", torch.tensor(int(GGMLQuantizationType[ggml_type]))),
            ("qweight", torch.from_numpy(rows)),
        ):
            param = getattr(layer, name)
            param.weight_loader(param, tensor, *([] if shard_id is None else [shard_id]))
    layer.quant_method.process_weights_after_loading(layer)


@pytest.mark.parametrize("ggml_type", QUANTIZED + ["F16", "BF16", "F32"])
def test_torch_dequantizers_equal_the_gguf_package_bit_for_bit(ggml_type: str) -> None:
    if ggml_type in ("F16", "F32"):
        rng = np.random.default_rng(0)
        values = rng.normal(size=(3, 64)).astype(np.float16 if ggml_type == "F16" else np.float32)
        rows, expected = values.view(np.uint8), values.astype(np.float32)
    elif ggml_type == "BF16":
        values = np.random.default_rng(0).normal(size=(3, 64)).astype(np.float32)
        rows = gguf_quantize(values, GGMLQuantizationType.BF16)
        expected = gguf_dequantize(rows, GGMLQuantizationType.BF16)
    else:
        rows = random_rows(ggml_type, 3, 512, seed=len(ggml_type))
        expected = gguf_dequantize(rows, GGMLQuantizationType[ggml_type])

    ours = gguf_dequant.dequantize(torch.from_numpy(rows.copy()), ggml_type)

    assert ours.dtype == torch.float32 and tuple(ours.shape) == expected.shape
    assert np.array_equal(ours.numpy().view(np.uint32), expected.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("ggml_type", QUANTIZED)
def test_reference_kernel_is_dequantize_then_matmul(ggml_type: str) -> None:
    in_features, out_features = 512, 48
    rows = random_rows(ggml_type, out_features, in_features, seed=1)
    layer = ReplicatedLinear(in_features, out_features, bias=True, quant_config=reference_config())
    load_layer(layer, [(None, ggml_type, rows)])
    bias = torch.randn(out_features)
    layer.bias.weight_loader(layer.bias, bias)
    x = torch.randn(5, in_features, generator=torch.Generator().manual_seed(2))

    out = layer(x)

    # the layer keeps the file's bytes, nothing more
    assert torch.equal(layer.qweight, torch.from_numpy(rows).reshape(-1))
    assert weight_bytes(layer) - bias.nbytes - layer.qweight_type.nbytes == rows.nbytes
    reference = F.linear(x.double(), gguf_weight(rows, ggml_type).double(), bias.double())
    assert float((out.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())


def test_fused_shards_of_different_types_land_in_their_rows() -> None:
    # a Q4_K_M file: q and k Q4_K, v Q6_K; 4 heads and 2 kv heads of 64
    layer = QKVParallelLinear(256, 64, 4, 2, bias=False, quant_config=reference_config())
    q, k, v = (random_rows(t, n, 256, seed=i) for i, (t, n) in enumerate([("Q4_K", 256), ("Q4_K", 128), ("Q6_K", 128)]))
    load_layer(layer, [("v", "Q6_K", v), ("q", "Q4_K", q), ("k", "Q4_K", k)])  # any order
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))

    out = layer(x)

    method = layer.quant_method
    assert [(s.ggml_type, s.start, s.stop, s.kernel) for s in method.segments] == [
        ("Q4_K", 0, 384, "reference"), ("Q6_K", 384, 512, "reference")
    ]
    expected_weight = torch.cat([gguf_weight(q, "Q4_K"), gguf_weight(k, "Q4_K"), gguf_weight(v, "Q6_K")])
    assert torch.equal(method.dequantize_weight(layer), expected_weight)
    reference = x.double() @ expected_weight.double().T
    assert float((out.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())
    assert weight_bytes(layer) == q.nbytes + k.nbytes + v.nbytes + layer.qweight_type.nbytes


def test_bfloat16_mixed_fused_layer_runs_as_one_product_in_the_widest_bits() -> None:
    """A Q4_K_M file's qkv (Q4_K q and k, Q6_K v) as one IntWeight (6 bits, groups of 16, the Q4_K
    rows' scales and zeros repeated, the Q6_K rows' zeros 0): one bound product, which the decode
    plan takes (two segments would leave the whole model off the plan)."""
    layer = QKVParallelLinear(256, 64, 4, 2, bias=True, quant_config=GGUFConfig(), params_dtype=torch.bfloat16)
    q, k, v = (random_rows(t, n, 256, seed=i) for i, (t, n) in enumerate([("Q4_K", 256), ("Q4_K", 128), ("Q6_K", 128)]))
    load_layer(layer, [("q", "Q4_K", q), ("k", "Q4_K", k), ("v", "Q6_K", v)])
    bias = torch.randn(512).bfloat16()
    layer.bias.weight_loader(layer.bias, bias)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).bfloat16()

    out = layer(x)

    # without int6_pairs, 8 bits on woq_cpu
    assert [s.kernel for s in layer.quant_method.segments] == [BF16_INT6]
    assert layer.quant_method.segments[0].ggml_type == "Q4_K+Q6_K"
    assert native_call(layer.quant_method.bind(layer, layer.bias)) is not None  # one product, plannable
    assert layer.qweight.numel() == 0  # the blocks are dropped
    expected_weight = torch.cat([gguf_weight(q, "Q4_K"), gguf_weight(k, "Q4_K"), gguf_weight(v, "Q6_K")])
    reference = x.double() @ expected_weight.double().T + bias.double()
    assert out.dtype == torch.bfloat16
    assert float((out.double() - reference).abs().max()) <= 2**-6 * float(reference.abs().max())
    # the file's weights (Q4_K's within a float32 rounding of its zero, as on int4_pairs)
    dequantized = layer.quant_method.dequantize_weight(layer)
    assert float((dequantized - expected_weight).abs().max()) <= 1e-6 * float(expected_weight.abs().max())
    assert torch.equal(dequantized[384:], expected_weight[384:])  # the Q6_K rows exactly
    # every row 6 bits a weight (a byte on woq_cpu) and a float32 scale and zero per 16
    assert weight_bytes(layer) - layer.qweight_type.nbytes - bias.nbytes == 512 * 256 * (20 if PAIRS else 24) // 16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_woq_cpu_a8_named_runs_llama_cpp_s_numerics_where_the_blocks_are_32_wide(dtype: torch.dtype) -> None:
    """quant_kernel="woq_cpu_a8": the 32-wide Q4_K rows multiply activations quantized to int8
    per block of 32 (the reference spelled in PyTorch, quantize_per_block), the Q6_K rows
    (16-wide groups, which it does not run) take the 8-bit kernel by priority, with float activations."""
    config = GGUFConfig()
    config.quant_kernel = "woq_cpu_a8"
    layer = QKVParallelLinear(256, 64, 4, 2, bias=False, quant_config=config, params_dtype=dtype)
    q, k, v = (random_rows(t, n, 256, seed=i) for i, (t, n) in enumerate([("Q4_K", 256), ("Q4_K", 128), ("Q6_K", 128)]))
    load_layer(layer, [("q", "Q4_K", q), ("k", "Q4_K", k), ("v", "Q6_K", v)])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(dtype)

    out = layer(x).double()

    assert [s.kernel for s in layer.quant_method.segments] == ["woq_cpu_a8", BF16_INT6 if dtype == torch.bfloat16 else "woq_cpu"]
    w_qk = torch.cat([gguf_weight(q, "Q4_K"), gguf_weight(k, "Q4_K")]).double()
    w_v = gguf_weight(v, "Q6_K").double()
    x_blocks = quantize_per_block(x).double()
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7
    for got, want in ((out[:, :384], x_blocks @ w_qk.T), (out[:, 384:], x.double() @ w_v.T)):
        assert float((got - want).abs().max()) <= tolerance * float(want.abs().max())
    if dtype == torch.float32:  # the activations are quantized indeed: the float product is further off
        float_product = x.double() @ w_qk.T
        assert float((out[:, :384] - float_product).abs().max()) > 20 * tolerance * float(float_product.abs().max())


def test_a_named_kernel_that_takes_no_integer_weights_leaves_gguf_segments_to_the_priority_choice() -> None:
    """quant_kernel="fp8_cpu" names a kernel for FP8 weights only: it is never handed a
    segment's IntWeight (its can_implement does not look at the weight form)."""
    config = GGUFConfig()
    config.quant_kernel = "fp8_cpu"
    layer = ReplicatedLinear(256, 64, bias=False, quant_config=config)
    rows = random_rows("Q4_1", 64, 256, seed=4)
    load_layer(layer, [(None, "Q4_1", rows)])
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(1))

    assert [s.kernel for s in layer.quant_method.segments] == ["woq_cpu"]
    reference = x.double() @ gguf_weight(rows, "Q4_1").double().T
    assert float((layer(x).double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())

@pytest.mark.parametrize("ggml_type", ["Q4_0", "Q4_1", "Q4_K"])
def test_bfloat16_q4_takes_the_4_bit_kernel_in_the_file_s_bytes(ggml_type: str) -> None:
    in_features, out_features = 512, 96
    rows = random_rows(ggml_type, out_features, in_features, seed=3)
    layer = ReplicatedLinear(in_features, out_features, bias=False, quant_config=GGUFConfig(),
                             params_dtype=torch.bfloat16)
    load_layer(layer, [(None, ggml_type, rows)])
    x = torch.randn(7, in_features, generator=torch.Generator().manual_seed(4)).bfloat16()

    out = layer(x)

    assert [s.kernel for s in layer.quant_method.segments] == [BF16_INT4]
    assert layer.qweight.numel() == 0  # the blocks are dropped once repacked
    assert out.dtype == torch.bfloat16
    reference = x.double() @ gguf_weight(rows, ggml_type).double().T
    # bfloat16 scales and zeros (8 bits) and output: a few 2**-8
    assert float((out.double() - reference).abs().max()) <= 2**-6 * float(reference.abs().max())
    # int4_pairs: two a byte and, per 32 inputs, a float16 d (Q4_0: the file's 18 bytes per 32 weights),
    # d and m (Q4_1: the file's 20), or a float32 scale and zero (Q4_K's d sc are no float16s: 24);
    # int4_cpu: bfloat16 (scale, zero) per 32 inputs, 20 bytes per 32 weights
    per_32 = {"Q4_0": 18, "Q4_1": 20, "Q4_K": 24}[ggml_type] if PAIRS else 20
    assert weight_bytes(layer) - layer.qweight_type.nbytes == out_features * in_features * per_32 // 32


@pytest.mark.parametrize(
    ("ggml_type", "dtype"),
    [("Q4_0", torch.float32), ("Q4_1", torch.float32), ("Q8_0", torch.float32), ("Q5_1", torch.float32),
     ("Q4_0", torch.bfloat16), ("Q4_1", torch.bfloat16), ("Q8_0", torch.float16)],
)
def test_conforms_on_every_layer_kind(ggml_type: str, dtype: torch.dtype) -> None:
    def tensors(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        rows = gguf_quantize(weight.float().numpy(), GGMLQuantizationType[ggml_type])
        return {"qweight_type": torch.tensor(int(GGMLQuantizationType[ggml_type])), "qweight": torch.from_numpy(rows)}

    # float32: tensor-parallel ranks 0 and 1 of 2 too (each its rows or inputs of the file's blocks)
    check_quant_method("gguf", dtype=dtype, quick=dtype != torch.float32, checkpoint_tensors=tensors)


def test_a_rank_s_inputs_must_be_whole_blocks_of_their_type() -> None:
    from vframe.layers.linear import RowParallelLinear

    rows = random_rows("Q6_K", 64, 512, seed=3)  # blocks of 256 inputs
    halves = [RowParallelLinear(512, 64, bias=False, quant_config=GGUFConfig(), tp_rank=r, tp_size=2) for r in (0, 1)]
    for half in halves:
        load_layer(half, [(None, "Q6_K", rows)])
    assert torch.equal(torch.cat([h.quant_method.dequantize_weight(h) for h in halves], dim=1),
                       gguf_weight(rows, "Q6_K"))
    quarter = RowParallelLinear(512, 64, bias=False, quant_config=GGUFConfig(), tp_rank=1, tp_size=4,
                                prefix="model.layers.0.mlp.down_proj")
    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.down_proj: tensor parallelism gives each rank 128 of "
                                          r"its 512 inputs, which are not whole Q6_K blocks of 256"):
        load_layer(quarter, [(None, "Q6_K", rows)])


@pytest.mark.parametrize(
    ("ggml_type", "dtype", "kernel", "head"),
    [
        ("Q8_0", torch.float32, None, "woq_cpu"), ("Q8_0", torch.bfloat16, None, BF16_INT8),
        ("Q8_0", torch.bfloat16, "reference", "planes"), ("Q8_0", torch.float32, "reference", "reference"),
        ("Q4_1", torch.bfloat16, None, BF16_INT4), ("Q4_1", torch.bfloat16, "reference", "reference"),
        ("Q4_K", torch.float32, None, "woq_cpu"), ("Q6_K", torch.float32, None, "woq_cpu"),
        ("Q6_K", torch.bfloat16, None, BF16_INT6), ("Q2_K", torch.float32, None, "woq_cpu"),
        ("IQ4_XS", torch.bfloat16, None, BF16_LUT4), ("IQ4_NL", torch.float32, None, "lut4_cpu"),
    ],
)
def test_embedding_looks_up_exact_rows_and_its_tied_head_multiplies_by_them(
    ggml_type: str, dtype: torch.dtype, kernel: str | None, head: str
) -> None:
    vocab, hidden = 192, 256  # K-quant rows are whole blocks of 256
    rows = random_rows(ggml_type, vocab, hidden, seed=11)
    config = GGUFConfig()
    config.quant_kernel = kernel
    embedding = VocabEmbedding(vocab, hidden, config.get_embedding_method("embed"), params_dtype=dtype)
    load_layer(embedding, [(None, ggml_type, rows)])
    head_module = TiedLMHead(embedding)
    ids = torch.tensor([0, 31, 32, 63, 64, 100, 191, 31])  # both nibble halves of the int4 layout's 64-row tiles
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(12)).to(dtype)

    looked_up, logits = embedding(ids), head_module(x)

    weight = gguf_weight(rows, ggml_type)  # [vocab, hidden]
    method = embedding.quant_method
    assert ("planes" if method.q8_planes else method.segments[0].kernel) == head
    assert looked_up.dtype == dtype
    if head == "woq_cpu" and ggml_type in ("Q4_1", "Q4_K"):
        # scale (q - 8) + zero, the zero 8 d + m (Q4_K: 8 d sc - dmin m): the file's d q + m up to
        # a float32 rounding, and the rows looked up as the head multiplies them
        assert float((method.dequantize_weight(embedding) - weight).abs().max()) <= 1e-6 * float(weight.abs().max())
        weight = method.dequantize_weight(embedding)
    assert torch.equal(looked_up, weight[ids].to(dtype))  # the rows, bit for bit
    assert torch.equal(method.dequantize_weight(embedding), weight)
    reference = x.double() @ weight.double().T
    # float32: float32 noise; bfloat16: its outputs (two, for the planes) and the planes' bfloat16 scales
    tolerance = 1e-5 if dtype == torch.float32 else 2**-6
    assert logits.dtype == dtype
    assert float((logits.double() - reference).abs().max()) <= tolerance * float(reference.abs().max())
    expected_bytes = {
        "planes": vocab * hidden * (32 + 2 * 4 + 2) // 32,  # 1 byte per weight, 2 x (scale, zero) bf16, d f16
        # woq_cpu's integers (a byte each at 8 bit, two per byte at 4) and float32 scales (and offsets)
        "woq_cpu": vocab * hidden * {"Q8_0": (32 + 4) / 32, "Q4_K": (16 + 8) / 32, "Q6_K": (16 + 4) / 16,
                                     "Q2_K": (8 + 8) / 16}.get(ggml_type, 0),
        # torch's int4 layout and a bfloat16 (scale, zero) per 32, beside the file's blocks for lookups
        "int4_cpu": vocab * hidden * (16 + 4) // 32 + rows.nbytes,
        # a byte per weight and a float16 d per 32 (Q8_0: the file's bytes), a float32 scale per 16 (Q6_K)
        "int8_pairs": vocab * hidden * {"Q8_0": (32 + 2) / 32, "Q6_K": (16 + 4) / 16}.get(ggml_type, 0),
        # 6 bits per weight (Q6_K) and a float32 scale per 16
        "int6_pairs": vocab * hidden * (12 + 4) // 16,
        # two a byte and a float16 d and m per 32 (Q4_1: the file's bytes)
        "int4_pairs": vocab * hidden * (16 + 4) // 32,
        # two codes a byte, a float32 scale per 32 and the table; lut4_cpu looks rows up in the file's blocks
        "lut4_pairs": vocab * hidden * (16 + 4) // 32 + 16 * 4,
        "lut4_cpu": vocab * hidden * (16 + 4) // 32 + 16 * 4 + rows.nbytes,
        "reference": rows.nbytes,  # the file's blocks
    }[head]
    assert weight_bytes(embedding) - embedding.qweight_type.nbytes == expected_bytes


def test_an_unsupported_ggml_type_is_refused_by_name() -> None:
    layer = ReplicatedLinear(256, 64, bias=False, quant_config=GGUFConfig(), prefix="model.layers.0.mlp.down_proj")
    with pytest.raises(ModelLoadError, match=r"is of GGUF type IQ2_XXS \(16\), which quantization='gguf' does not run"):
        layer.qweight_type.weight_loader(layer.qweight_type, torch.tensor(16))


def test_gguf_is_a_builtin_quantizer_that_refuses_what_it_cannot_run() -> None:
    assert get_registry("quantizer").load("gguf") is GGUFConfig
    assert isinstance(GGUFConfig().get_quant_method(ReplicatedLinear(64, 64), "x"), GGUFLinearMethod)
    with pytest.raises(ConfigError, match=r"this checkpoint is already quantized as 'gptq'"):
        GGUFConfig.from_config({"quant_method": "gptq"})
    reasons = GGUFConfig.validate_configuration(dtype=torch.bfloat16, device=torch.device("cuda"))
    assert "dtype='bfloat16' runs GGUF on the CPU only; on cuda use dtype='float16'" in reasons


def test_the_iq4_tables_are_llama_cpp_s_and_a_bad_type_is_no_table() -> None:
    assert gguf_dequant.IQ4_VALUES == gguf_quants.IQ4_NL.kvalues
    rows = torch.from_numpy(random_rows("IQ4_XS", 2, 256, seed=9))
    q, scales, table, group = gguf_dequant.lut4_groups(rows, "IQ4_XS")
    assert (q.shape, scales.shape, group) == ((2, 256), (2, 8), 32) and int(q.max()) < 16
    with pytest.raises(ValueError, match=r"Q4_0 is not one of \('IQ4_NL', 'IQ4_XS'\)"):
        gguf_dequant.lut4_groups(rows, "Q4_0")


# --------------------------------------------------------------------------- #
# The embedded SmolLM2-135M-Instruct Q4_1, kept quantized
# --------------------------------------------------------------------------- #

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "Water boils at"]


GREEDY = SamplingParams(temperature=0.0, max_tokens=6)


@pytest.fixture(scope="module")
def gguf_fp32() -> LLM:
    return LLM(dtype="float32", quantization="gguf", max_model_len=256, num_threads=1)


@pytest.fixture(scope="module")
def dense_greedy(llm_fp32: LLM) -> list[list[int]]:
    """The dense float32 conversion's greedy tokens for ``PROMPTS``."""
    return [list(o.outputs[0].token_ids) for o in llm_fp32.generate(PROMPTS, GREEDY, use_tqdm=False)]


def greedy(llm: LLM) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


def test_smollm2_float32_from_its_blocks_matches_the_dense_conversion(
    gguf_fp32: LLM, llm_fp32: LLM, tokenizer, dense_greedy: list[list[int]]
) -> None:
    ids = tokenizer(PROMPTS[0]).input_ids
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    [dense] = llm_fp32.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    [ours] = gguf_fp32.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
    # the dense path holds exactly the dequantized weights: float32 noise only
    for pos in range(1, len(ids)):
        assert ours.prompt_logprobs[pos][ids[pos]].logprob == pytest.approx(
            dense.prompt_logprobs[pos][ids[pos]].logprob, abs=1e-4
        )
    assert greedy(gguf_fp32) == dense_greedy


def type_bytes(model) -> int:  # the ggml type numbers, one int32 per fused shard
    return sum(m.qweight_type.nbytes for m in quantized_linear_layers(model))


def test_smollm2_weights_take_the_file_s_packed_bytes() -> None:
    """With the reference kernel the linear layers keep the file's blocks, nothing more."""
    llm = LLM(dtype="float32", quantization="gguf", quant_kernel="reference", max_model_len=256, num_threads=1)
    model = llm.llm_engine.model_runner.model
    layers = quantized_linear_layers(model)
    assert len(layers) == 30 * 4 + 1  # qkv, o, gate_up, down; the embedding
    embedding = model.model.embed_tokens
    assert isinstance(embedding, VocabEmbedding) and isinstance(model.lm_head, TiedLMHead)
    assert model.lm_head.embedding is embedding  # one quantized tensor serves both
    linears = [m for m in layers if m is not embedding]
    assert {s.kernel for m in linears for s in m.quant_method.segments} == {"reference"}
    assert sum(weight_bytes(m) - m.qweight_type.nbytes for m in linears) == SMOLLM_PACKED_LINEAR_BYTES
    assert weight_bytes(embedding) - embedding.qweight_type.nbytes == SMOLLM_EMBEDDING_BYTES
    # the file's bytes plus the float32 norms: 96,576,768 bytes, 17.9% of the dense float32 weights
    total = weight_bytes(model) - type_bytes(model)
    assert total == SMOLLM_PACKED_LINEAR_BYTES + SMOLLM_EMBEDDING_BYTES + 4 * SMOLLM_NORM_VALUES == 96_576_768
    assert total <= 0.18 * SMOLLM_DENSE_FP32_BYTES


def test_smollm2_float32_q4_1_runs_on_woq_cpu_in_a_fifth_of_the_dense_bytes(gguf_fp32: LLM) -> None:
    """By default float32 Q4_1 layers take the woq_cpu kernel: the 4-bit values two per
    byte, a float32 scale and offset per 32 (0.75 bytes per weight against the file's 0.625);
    the Q8_0 embedding / tied head too (1.125 bytes per weight against 1.0625)."""
    model = gguf_fp32.llm_engine.model_runner.model
    embedding = model.model.embed_tokens
    linears = [m for m in quantized_linear_layers(model) if m is not embedding]
    assert {s.kernel for m in linears for s in m.quant_method.segments} == {"woq_cpu"}
    linear_bytes = sum(weight_bytes(m) - m.qweight_type.nbytes for m in linears)
    assert linear_bytes == SMOLLM_PACKED_LINEAR_BYTES * 24 // 20  # 24 bytes per 32 weights
    total = weight_bytes(model) - type_bytes(model)
    assert embedding.quant_method.segments[0].kernel == "woq_cpu"
    assert total == linear_bytes + 49152 * 576 * 36 // 32 + 4 * SMOLLM_NORM_VALUES
    assert total <= 0.21 * SMOLLM_DENSE_FP32_BYTES


A8_TEXT = (
    "Once upon a time, the city of Nova Haven was a thriving metropolis, with towering skyscrapers and "
    "bustling streets. But as the years went by, the water that boils at 100 degrees became scarce."
)


def test_smollm2_with_woq_cpu_a8_stays_near_the_dense_logprobs(llm_fp32: LLM, tokenizer) -> None:
    """llama.cpp's numerics on request: every Q4_1 layer and the Q8_0 head on woq_cpu_a8. Its
    logprobs of a fixed text move from the dense model's by about what llama.cpp's own do
    (docs/quantization.md): more than float32 noise, far less than a wrong kernel would."""
    llm = LLM(dtype="float32", quantization="gguf", quant_kernel="woq_cpu_a8", max_model_len=256, num_threads=1)
    model = llm.llm_engine.model_runner.model
    assert {s.kernel for m in quantized_linear_layers(model) for s in m.quant_method.segments} == {"woq_cpu_a8"}
    ids = tokenizer(A8_TEXT).input_ids
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs(engine: LLM) -> np.ndarray:
        [out] = engine.generate({"prompt_token_ids": ids}, params, use_tqdm=False)
        return np.array([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])

    moved = np.abs(logprobs(llm) - logprobs(llm_fp32))
    assert len(moved) == 41
    # measured: mean 0.075, max 0.51 (llama.cpp 0.3.36 on the same file: mean 0.046, max 0.34)
    assert 1e-2 < moved.max() < 1.0 and moved.mean() < 0.15, (moved.mean(), moved.max())


def test_smollm2_bfloat16_int4_kernel_keeps_the_dense_greedy_tokens(dense_greedy: list[list[int]]) -> None:
    llm = LLM(dtype="bfloat16", quantization="gguf", max_model_len=256, num_threads=1)

    model = llm.llm_engine.model_runner.model
    embedding = model.model.embed_tokens
    layers = [m for m in quantized_linear_layers(model) if m is not embedding]
    assert {s.kernel for layer in layers for s in layer.quant_method.segments} == {BF16_INT4}
    # Q4_1's 20 bytes per 32 weights on either kernel (int4_pairs: the file's float16 d and m)
    assert sum(weight_bytes(layer) - layer.qweight_type.nbytes for layer in layers) == SMOLLM_PACKED_LINEAR_BYTES
    # the Q8_0 embedding / head: the int8 values (1 byte per weight) and per 32 weights the file's
    # float16 d (int8_pairs: the file's 30,081,024 bytes) or a float32 scale (woq_cpu: 31,850,496)
    assert embedding.quant_method.segments[0].kernel == BF16_INT8 and embedding.qweight.numel() == 0
    table = 49152 * 576 + 49152 * 18 * (2 if PAIRS else 4)
    assert weight_bytes(embedding) - embedding.qweight_type.nbytes == table == (30_081_024 if PAIRS else 31_850_496)
    # with the bfloat16 norms 96,506,496 bytes (int8_pairs) or 98,275,968: 17.9% or 18.3% of the
    # dense float32 weights, 35.9% or 36.5% of bfloat16
    total = weight_bytes(model) - type_bytes(model)
    assert total == SMOLLM_PACKED_LINEAR_BYTES + table + 2 * SMOLLM_NORM_VALUES == (96_506_496 if PAIRS else 98_275_968)
    assert total <= 0.30 * SMOLLM_DENSE_FP32_BYTES
    # bfloat16 activations, scales and zeros move a logit a little: most prompts keep every token
    ours = greedy(llm)
    assert sum(a == b for a, b in zip(ours, dense_greedy)) >= 3, (ours, dense_greedy)


def test_the_dense_path_keeps_an_unquantized_tied_embedding(llm_fp32: LLM) -> None:
    model = llm_fp32.llm_engine.model_runner.model
    assert type(model.model.embed_tokens) is torch.nn.Embedding
    assert type(model.lm_head) is ReplicatedLinear
    embedding, head = model.model.embed_tokens.weight, model.lm_head.weight
    if onednn_fp32_available():  # the head multiplies by a oneDNN-packed copy of the embedding's rows
        assert head.is_mkldnn and torch.equal(head.to_dense(), embedding)
    else:
        assert head is embedding


def test_a_quantized_run_converts_only_config_and_tokenizer(tmp_path) -> None:
    resolved = resolve_model(None, cache_dir=tmp_path, convert_weights=False)

    dense_dir = gguf_cache_path(embedded_default_gguf(), tmp_path)
    assert resolved.model_dir == dense_dir.with_name(dense_dir.name + "-config") and resolved.weight_files == ()
    assert sorted(p.name for p in resolved.model_dir.iterdir()) == [
        "chat_template.jinja", "config.json", "tokenizer.json", "tokenizer_config.json"
    ]
    assert not dense_dir.exists()


def test_a_hugging_face_directory_is_refused(llm_fp32: LLM) -> None:
    converted = llm_fp32.llm_engine.model_runner.resolved.model_dir  # the dense conversion of the GGUF
    with pytest.raises(ConfigError, match=r"quantization='gguf' reads a .gguf file; model=.* is a Hugging Face"):
        LLM(model=str(converted), quantization="gguf", dtype="float32", num_threads=1)


def test_a_truncated_gguf_is_refused_naming_the_tensor(tmp_path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(embedded_default_gguf().read_bytes()[: 40 << 20])  # the first 40 MiB
    with pytest.raises(ModelLoadError, match=r"truncated GGUF file \(tensor 'blk\.\d+\..*' ends past the end"):
        list(read_gguf_tensors(truncated))


def test_the_tensor_table_reader_hands_over_blocks_rows_un_permuted(tmp_path) -> None:
    """A GGUF written by the ``gguf`` package: Q4_K q / k (rows permuted for rotary as
    llama.cpp's converter does), a Q6_K down projection, float tensors; an odd
    alignment and array metadata in between."""
    from gguf import GGUFWriter

    heads, kv_heads, head_dim, hidden = 2, 1, 64, 256
    q = random_rows("Q4_K", heads * head_dim, hidden, seed=5)
    k = random_rows("Q4_K", kv_heads * head_dim, hidden, seed=6)
    down = random_rows("Q6_K", hidden, 512, seed=7)
    norm = np.random.default_rng(8).normal(size=hidden).astype(np.float32)
    embed = np.random.default_rng(9).normal(size=(10, hidden)).astype(np.float16)
    path = tmp_path / "tiny.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "déf"])
    permute = lambda rows, n: rows.reshape(n, 2, -1, rows.shape[1]).swapaxes(1, 2).reshape(rows.shape)  # noqa: E731
    writer.add_tensor("blk.0.attn_q.weight", permute(q, heads), raw_dtype=GGMLQuantizationType.Q4_K)  # rows of bytes
    writer.add_tensor("blk.0.attn_k.weight", permute(k, kv_heads), raw_dtype=GGMLQuantizationType.Q4_K)
    writer.add_tensor("blk.0.ffn_down.weight", down, raw_dtype=GGMLQuantizationType.Q6_K)
    writer.add_tensor("blk.0.attn_norm.weight", norm)
    writer.add_tensor("token_embd.weight", embed)
    write_out(writer)

    config = type("Config", (), {"model_type": "llama", "num_attention_heads": heads, "num_key_value_heads": kv_heads})()
    tensors = list(iterate_gguf_quantized(path, config))

    names = [name for name, _ in tensors]
    assert names == [
        "model.layers.0.self_attn.q_proj.qweight_type", "model.layers.0.self_attn.q_proj.qweight",
        "model.layers.0.self_attn.k_proj.qweight_type", "model.layers.0.self_attn.k_proj.qweight",
        "model.layers.0.mlp.down_proj.qweight_type", "model.layers.0.mlp.down_proj.qweight",
        "model.layers.0.input_layernorm.weight",
        "model.embed_tokens.qweight_type", "model.embed_tokens.qweight",
    ]
    got = dict(tensors)
    modules = ("self_attn.q_proj", "self_attn.k_proj", "mlp.down_proj")
    assert [int(got[f"model.layers.0.{m}.qweight_type"]) for m in modules] == [12, 12, 14]  # Q4_K, Q4_K, Q6_K
    assert np.array_equal(got["model.layers.0.self_attn.q_proj.qweight"].numpy(), q)
    assert np.array_equal(got["model.layers.0.self_attn.k_proj.qweight"].numpy(), k)
    assert np.array_equal(got["model.layers.0.mlp.down_proj.qweight"].numpy(), down)
    assert torch.equal(got["model.layers.0.input_layernorm.weight"], torch.from_numpy(norm))
    assert int(got["model.embed_tokens.qweight_type"]) == 1  # F16
    assert np.array_equal(got["model.embed_tokens.qweight"].numpy(), embed.view(np.uint8))


# --------------------------------------------------------------------------- #
# A tiny random Llama GGUF with K-quants and mixed types in fused layers
# --------------------------------------------------------------------------- #

Q4_K_M = {"attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
          "ffn_gate": "Q4_K", "ffn_up": "Q4_K", "ffn_down": "Q6_K"}  # as llama.cpp's Q4_K_M mixes them
OTHERS = {"attn_q": "Q5_K", "attn_k": "Q5_K", "attn_v": "Q8_0", "attn_output": "Q3_K",
          "ffn_gate": "Q2_K", "ffn_up": "Q2_K", "ffn_down": "Q5_0"}


def write_tiny_llama(path, layer_types: list[dict[str, str]], vocab: int = 96, output_type: str | None = None,
                     embedding_type: str | None = None) -> None:
    """A 2-layer Llama GGUF of random blocks (hidden 256, 4 heads and 2 kv heads of 64,
    MLP 512) with a byte-level toy vocabulary, written by the ``gguf`` package; its LM
    head tied to the embedding (float16, or random blocks of ``embedding_type``), or an
    ``output.weight`` of ``output_type``."""
    from gguf import GGUFWriter

    hidden, heads, kv_heads, head_dim, inter = 256, 4, 2, 64, 512
    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(len(layer_types))
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    add_toy_vocabulary(writer, vocab)
    rng = np.random.default_rng(0)
    if embedding_type is None:
        writer.add_tensor("token_embd.weight", rng.normal(0, 1, (vocab, hidden)).astype(np.float16))
    else:
        rows = random_rows(embedding_type, vocab, hidden, seed=98)
        writer.add_tensor("token_embd.weight", rows, raw_dtype=GGMLQuantizationType[embedding_type])
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    if output_type is not None:
        rows = random_rows(output_type, vocab, hidden, seed=99)
        writer.add_tensor("output.weight", rows, raw_dtype=GGMLQuantizationType[output_type])
    shapes = {"attn_q": (heads * head_dim, hidden), "attn_k": (kv_heads * head_dim, hidden),
              "attn_v": (kv_heads * head_dim, hidden), "attn_output": (hidden, hidden),
              "ffn_gate": (inter, hidden), "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
    for i, types in enumerate(layer_types):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
        for j, (name, (out, inp)) in enumerate(shapes.items()):
            rows = random_rows(types[name], out, inp, seed=100 * i + j)
            writer.add_tensor(f"blk.{i}.{name}.weight", rows, raw_dtype=GGMLQuantizationType[types[name]])
    write_out(writer)


def test_a_k_quant_llama_runs_from_its_blocks_as_its_dense_conversion(tmp_path, gguf_cache) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, [Q4_K_M, OTHERS])
    prompts = [{"prompt_token_ids": ids} for ids in ([0, 5, 17, 33, 2], [0, 40, 41, 42, 43, 44, 45, 46])]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=0, ignore_eos=True)
    kw = dict(model=str(path), max_model_len=128, num_threads=1, attention_backend="torch")

    def run(**more) -> list:
        return [o.outputs[0] for o in LLM(**kw, **more).generate(prompts, params, use_tqdm=False)]

    dense = run(dtype="float32")
    ours = run(dtype="float32", quantization="gguf")
    for a, b in zip(ours, dense):
        assert a.token_ids == b.token_ids
        assert [lp[t].logprob for t, lp in zip(a.token_ids, a.logprobs)] == pytest.approx(
            [lp[t].logprob for t, lp in zip(b.token_ids, b.logprobs)], abs=1e-4
        )
    # bfloat16: Q4_K through the 4-bit kernel (q and k of the [Q4_K | Q4_K | Q6_K] qkv), Q5 / Q6_K
    # through the 6-bit one, Q8_0 through the 8-bit one, Q3_K and Q2_K (4 bit, groups of 16) through
    # int4_pairs or woq_cpu
    llm = LLM(**kw, dtype="bfloat16", quantization="gguf")
    layers = llm.llm_engine.model_runner.model.model.layers
    kernels = [[s.kernel for s in layer.quant_method.segments] for layer in quantized_linear_layers(layers)]
    assert kernels == [
        # qkv (Q4_K | Q6_K: one product in 6 bits), o, gate_up, down (Q6_K)
        [BF16_INT6], [BF16_INT4], [BF16_INT4], [BF16_INT6],
        # qkv (Q5_K | Q8_0: in 8 bits), o (Q3_K), gate_up (Q2_K), down (Q5_0)
        [BF16_INT8], [bf16_int4_with_groups(16)], [bf16_int4_with_groups(16)], [BF16_INT6],
    ]
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert ours == [b.token_ids for b in dense]


def _gguf_engine_equal_to_its_dense_conversion(path) -> LLM:
    """The GGUF at ``path`` kept quantized, in float32, after asserting that its greedy
    tokens equal its dense conversion's and their logprobs are within 1e-4."""
    prompts = [{"prompt_token_ids": [0, 5, 17, 33, 2]}]
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=0, ignore_eos=True)
    kw = dict(model=str(path), max_model_len=128, num_threads=1, attention_backend="torch", dtype="float32")

    dense = LLM(**kw).generate(prompts, params, use_tqdm=False)[0].outputs[0]
    llm = LLM(**kw, quantization="gguf")
    ours = llm.generate(prompts, params, use_tqdm=False)[0].outputs[0]
    assert ours.token_ids == dense.token_ids
    assert [lp[t].logprob for t, lp in zip(ours.token_ids, ours.logprobs)] == pytest.approx(
        [lp[t].logprob for t, lp in zip(dense.token_ids, dense.logprobs)], abs=1e-4
    )
    return llm


def test_an_untied_q8_0_head_runs_on_woq_cpu_as_its_dense_conversion(tmp_path, gguf_cache) -> None:
    path = tmp_path / "untied.gguf"
    write_tiny_llama(path, [Q4_K_M], output_type="Q8_0")

    llm = _gguf_engine_equal_to_its_dense_conversion(path)

    model = llm.llm_engine.model_runner.model
    assert isinstance(model.lm_head, ReplicatedLinear) and isinstance(model.lm_head.quant_method, GGUFLinearMethod)
    # the head's Q8_0 on woq_cpu: the file's int8 values, a float32 scale per 32 (the file: float16)
    assert [s.kernel for s in model.lm_head.quant_method.segments] == ["woq_cpu"]
    assert weight_bytes(model.lm_head) - model.lm_head.qweight_type.nbytes == 96 * 256 + 96 * 256 // 32 * 4
    assert isinstance(model.model.embed_tokens, VocabEmbedding)


def test_a_tied_q6_k_embedding_runs_its_head_on_woq_cpu_as_its_dense_conversion(tmp_path, gguf_cache) -> None:
    """Llama 3.2's Q4_K_M files tie a Q6_K token_embd to the head: without a kernel the
    head dequantized the whole table every step."""
    path = tmp_path / "tied.gguf"
    write_tiny_llama(path, [Q4_K_M], embedding_type="Q6_K")

    llm = _gguf_engine_equal_to_its_dense_conversion(path)

    embedding = llm.llm_engine.model_runner.model.model.embed_tokens
    assert [s.kernel for s in embedding.quant_method.segments] == ["woq_cpu"]
    # held once: woq_cpu's int8 values and a float32 scale per 16 (the file: 210 bytes per 256)
    assert weight_bytes(embedding) - embedding.qweight_type.nbytes == 96 * 256 + 96 * 256 // 16 * 4


@pytest.mark.parametrize(
    "ggml_type", ["Q4_0", "Q4_1", "Q4_K", "Q2_K", "Q3_K", "Q5_0", "Q5_1", "Q5_K", "Q6_K", "Q8_0", "IQ4_NL", "IQ4_XS"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_segments_with_an_integer_form_run_on_quant_kernels_as_dequantize_then_matmul(
    ggml_type: str, dtype: torch.dtype
) -> None:
    """The segment's IntWeight (GGUF's scale and offset per 32 inputs; IQ4_NL / IQ4_XS: a
    Lut4Weight, the codes into llama.cpp's 16 values, a scale per 32, IQ4_XS's sub-block's
    ``d * (ls - 32)``) on the kernel chosen by priority: the same weight as the file's blocks,
    the product within the kernel's rounding."""
    in_features, out_features = 512, 96
    rows = random_rows(ggml_type, out_features, in_features, seed=5)
    layer = ReplicatedLinear(in_features, out_features, bias=False, quant_config=GGUFConfig(), params_dtype=dtype)
    load_layer(layer, [(None, ggml_type, rows)])
    x = torch.randn(9, in_features, generator=torch.Generator().manual_seed(6)).to(dtype)

    out = layer(x)

    if ggml_type in ("IQ4_NL", "IQ4_XS"):
        expected = "lut4_cpu" if dtype == torch.float32 else BF16_LUT4
    elif dtype == torch.float32:
        expected = "woq_cpu"
    elif ggml_type in ("Q4_0", "Q4_1", "Q4_K"):
        expected = BF16_INT4
    elif ggml_type in ("Q2_K", "Q3_K"):  # 4 bit in groups of 16
        expected = bf16_int4_with_groups(16)
    else:  # 5 and 6 bit in 6 bits where int6_pairs runs; Q8_0 8 bit
        expected = BF16_INT8 if ggml_type == "Q8_0" else BF16_INT6
    assert [s.kernel for s in layer.quant_method.segments] == [expected]
    assert layer.qweight.numel() == 0  # the file's blocks are dropped
    weight = gguf_weight(rows, ggml_type)
    # float32: IntWeight's scale * (q - 8) + offset is the file's d q + m up to a float32 rounding
    dequantized = layer.quant_method.dequantize_weight(layer)
    weight_tolerance = 1e-6 if dtype == torch.float32 else 2**-8
    assert float((dequantized - weight).abs().max()) <= weight_tolerance * float(weight.abs().max())
    if dtype == torch.float32 and ggml_type not in ("Q4_0", "Q4_1", "Q4_K"):
        # the K-quants' and 8-bit types' scale * (q - mid) + offset are the dequantizers' own products
        assert torch.equal(dequantized, weight)
    if expected == "int6_pairs":  # scale q + zero: the file's d (q - 16), d q + m, (d sc) q; Q5_K's zero
        # -dmin m after adding and taking away 32 scales, within a float32 rounding
        assert torch.equal(dequantized, weight) if ggml_type != "Q5_K" else (
            float((dequantized - weight).abs().max()) <= 2**-22 * float(weight.abs().max()))
        assert weight_bytes(layer) - layer.qweight_type.nbytes == out_features * in_features * {
            "Q5_0": 26, "Q5_1": 28, "Q5_K": 32, "Q6_K": 32}[ggml_type] // 32  # 6 bits, scales (and zeros)
    if ggml_type in ("IQ4_NL", "IQ4_XS"):  # table[q] * scale: the dequantizer's own product
        assert torch.equal(dequantized, weight)
        # two codes a byte, a scale per 32 and the table: lut4_pairs holds IQ4_NL's d in float16, the
        # file's 18 bytes per 32 weights; IQ4_XS's d (ls - 32) (the file: 6 bits a sub-block and a d per
        # 256) and lut4_cpu's scales in float32
        per_32 = 18 if (ggml_type, expected) == ("IQ4_NL", "lut4_pairs") else 20
        assert weight_bytes(layer) - layer.qweight_type.nbytes == out_features * in_features * per_32 // 32 + 16 * 4
        many = torch.randn(100, in_features, generator=torch.Generator().manual_seed(7)).to(dtype)  # past in place
        reference = many.double() @ weight.double().T
        error = float((layer(many).double() - reference).abs().max())
        assert error <= (1e-5 if dtype == torch.float32 else 2**-6) * float(reference.abs().max())
    reference = x.double() @ weight.double().T
    tolerance = 1e-5 if dtype == torch.float32 else 2**-6
    assert float((out.double() - reference).abs().max()) <= tolerance * float(reference.abs().max())
