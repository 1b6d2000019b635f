"""The kernels vframe chooses by default for bfloat16 weight-only layers on this CPU: the pairs
kernels where the CPU has AVX512-BF16 (priority 35), else torch's int4 kernel (4 bit, priority 30),
woq_cpu (8 bit, GGUF's 5- and 6-bit types as 8 bit, and 4 bit where int4_cpu cannot run) and fp4_cpu (FP4)."""

from __future__ import annotations

from vframe.quant.kernels.builtin import pairs_available

PAIRS = pairs_available() is None
BF16_INT4 = "int4_pairs" if PAIRS else "int4_cpu"
BF16_INT8 = "int8_pairs" if PAIRS else "woq_cpu"
BF16_INT6 = "int6_pairs" if PAIRS else "woq_cpu"  # GGUF's 5- and 6-bit types (held in 8 bits on woq_cpu)
BF16_FP4 = "fp4_pairs" if PAIRS else "fp4_cpu"  # NVFP4 / MXFP4
BF16_FP8 = "fp8_pairs" if PAIRS else "fp8_cpu"  # FP8 (e4m3) weights
BF16_LUT4 = "lut4_pairs" if PAIRS else "lut4_cpu"  # 4-bit codes into a table (NF4, GGUF's IQ4_NL / IQ4_XS)


def bf16_int4_with_groups(group_size: int) -> str:
    """The default kernel of a 4-bit bfloat16 layer in groups of ``group_size`` inputs (int4_cpu
    takes groups of 32 .. 256; woq_cpu any even group; the pairs kernels multiples of 8)."""
    if PAIRS and group_size % 8 == 0:
        return "int4_pairs"
    return "int4_cpu" if group_size % 32 == 0 else "woq_cpu"
