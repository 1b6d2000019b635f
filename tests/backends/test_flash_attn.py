"""The FlashAttention backend (the ``flash-attn`` package's paged kernels).

On a machine without an NVIDIA GPU or without flash-attn the backend is listed
and refused with its reasons; the ``gpu`` tests run the conformance kit and
long-context decodes where flash-attn is installed (tests/test_gpu.py runs
SmolLM2 with it against transformers).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

from vframe.backends.flash_attn.backend import FlashAttentionBackend
from vframe.errors import ConfigError
from vframe.testing.attention import accepted_configurations, check_attention_backend

flash_attn_runs = pytest.mark.skipif(
    bool(FlashAttentionBackend.check_available()),
    reason="; ".join(FlashAttentionBackend.check_available()) or "available",
)


def test_validate_configuration_lists_every_reason() -> None:
    assert FlashAttentionBackend.validate_configuration(
        head_size=100, dtype=torch.float32, device="cpu", block_size=16
    ) == [
        "the flash_attn backend runs on device 'cuda', not 'cpu'",
        "flash-attn supports float16 and bfloat16, not torch.float32",
        "head_size 100 is not supported by flash-attn; use a multiple of 8 up to 256",
        "block_size 16: flash-attn's paged KV cache needs a multiple of 256; set block_size=256",
    ]
    assert FlashAttentionBackend.validate_configuration(
        head_size=64, dtype=torch.bfloat16, device="cuda", block_size=256
    ) == []
    assert FlashAttentionBackend.validate_configuration(
        head_size=576, dtype=torch.bfloat16, device="cuda", block_size=256, use_mla=True
    ) == ["the flash_attn backend has no multi-head latent attention path; use triton or torch"]


def test_conformance_kit_runs_it_with_large_blocks() -> None:
    # BLOCK_SIZES (4, 16, 32) are all refused: the kit falls back to 256-token blocks
    configs, _ = accepted_configurations(FlashAttentionBackend, torch.bfloat16, torch.device("cuda"))
    assert configs == [(64, 256), (128, 256), (32, 256), (256, 256), (80, 256)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is a CPU machine's")
def test_explicit_choice_on_cpu_fails_with_every_reason() -> None:
    from vframe import LLM

    with pytest.raises(ConfigError) as err:
        LLM(attention_backend="flash_attn", dtype="float32")
    message = str(err.value)
    assert message.startswith("attention_backend='flash_attn' cannot serve this configuration: ")
    assert "needs an NVIDIA GPU of compute capability >= 8.0; no CUDA device is visible" in message
    if importlib.util.find_spec("flash_attn") is None:
        assert "package flash-attn not installed" in message
    assert "the flash_attn backend runs on device 'cuda', not 'cpu'" in message
    assert "flash-attn supports float16 and bfloat16, not torch.float32" in message
    assert "block_size 16: flash-attn's paged KV cache needs a multiple of 256; set block_size=256" in message


def test_listing_the_backend_imports_no_flash_attn() -> None:
    code = (
        "import sys, torch, vframe\n"
        "from vframe.plugins import get_registry\n"
        "cls = get_registry('attention_backend').load('flash_attn')\n"
        "cls.check_available()\n"
        "cls.validate_configuration(head_size=64, dtype=torch.bfloat16, device='cuda', block_size=256)\n"
        "assert not any(m.startswith('flash_attn') for m in sys.modules), 'flash_attn imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --------------------------------------------------------------------------- #
# GPU with flash-attn installed
# --------------------------------------------------------------------------- #


@pytest.mark.gpu
@flash_attn_runs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_conforms_on_gpu(dtype: torch.dtype) -> None:
    check_attention_backend("flash_attn", dtype=dtype, device="cuda")


@pytest.mark.gpu
@flash_attn_runs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_long_context_decodes_match_the_reference_on_gpu(dtype: torch.dtype) -> None:
    """Decodes over contexts up to 4,096 tokens (flash-attn's split-KV path, 16 pages
    of 256) in a NaN-filled cache, against the float32 reference."""
    from vframe.testing.attention import reference_attention

    gen = torch.Generator(device="cuda").manual_seed(0)
    block_size, num_heads, num_kv_heads, head_size = 256, 32, 8, 128
    seq_lens = [4000, 4096, 17, 2500]
    blocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks) + 2
    perm = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(blocks), dtype=torch.int32, device="cuda")
    start = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[start : start + n]
        start += n
    shape = (2, num_blocks, block_size, num_kv_heads, head_size)
    kv_cache = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    keys = [torch.randn(n, num_kv_heads, head_size, device="cuda", dtype=dtype, generator=gen) for n in seq_lens]
    values = [torch.randn(n, num_kv_heads, head_size, device="cuda", dtype=dtype, generator=gen) for n in seq_lens]
    for b, n in enumerate(seq_lens):  # the context: every position but the last
        pos = torch.arange(n - 1, device="cuda")
        slots = table[b, pos // block_size].long() * block_size + pos % block_size
        kv_cache[0].view(-1, num_kv_heads, head_size)[slots] = keys[b][:-1]
        kv_cache[1].view(-1, num_kv_heads, head_size)[slots] = values[b][:-1]
    from vframe.core.interfaces import CommonAttentionMetadata

    last = torch.tensor([n - 1 for n in seq_lens], device="cuda")
    common = CommonAttentionMetadata(
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
        context_lens=torch.tensor([n - 1 for n in seq_lens], dtype=torch.int32, device="cuda"),
        block_table=table,
        slot_mapping=table[torch.arange(len(seq_lens), device="cuda"), last // block_size].long() * block_size
        + last % block_size,
        num_reqs=len(seq_lens),
        num_actual_tokens=len(seq_lens),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        block_size=block_size,
        query_start_loc_cpu=list(range(len(seq_lens) + 1)),
        seq_lens_cpu=seq_lens,
    )
    query = torch.randn(len(seq_lens), num_heads, head_size, device="cuda", dtype=dtype, generator=gen)
    key = torch.stack([k[-1] for k in keys])
    value = torch.stack([v[-1] for v in values])
    meta = FlashAttentionBackend.get_metadata_builder_cls()(None, torch.device("cuda")).build(common)
    impl = FlashAttentionBackend.get_impl_cls()(num_heads, head_size, head_size**-0.5, num_kv_heads)
    out = impl.forward(query, key, value, kv_cache, meta)
    for b in range(len(seq_lens)):
        expected = reference_attention(query[b : b + 1], keys[b], values[b], head_size**-0.5)
        torch.testing.assert_close(out[b : b + 1].float().cpu(), expected, atol=3e-2, rtol=2e-2)

