"""The torch backend's multi-head latent attention against the float32 reference."""

import pytest
import torch

from vframe.backends.torch_attn import TorchAttentionBackend
from vframe.core.kv_cache_spec import FullAttentionSpec, MLAAttentionSpec
from vframe.testing.mla import check_mla_backend


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_torch_mla_matches_reference(dtype: torch.dtype) -> None:
    check_mla_backend("torch", dtype=dtype, quick=dtype != torch.float32)


def test_cache_shape_per_spec() -> None:
    mla = MLAAttentionSpec(block_size=16, dtype=torch.bfloat16, kv_lora_rank=512, qk_rope_head_dim=64)
    assert TorchAttentionBackend.get_kv_cache_shape_for_spec(mla, 10) == (10, 16, 576)
    full = FullAttentionSpec(block_size=16, dtype=torch.bfloat16, num_kv_heads=2, head_size=64)
    assert TorchAttentionBackend.get_kv_cache_shape_for_spec(full, 10) == (2, 10, 16, 2, 64)


def test_mla_swap_blocks_moves_whole_blocks() -> None:
    src = torch.arange(4 * 2 * 3, dtype=torch.float32).view(4, 2, 3)  # [num_blocks, block_size, latent]
    dst = torch.zeros(2, 2, 3)
    TorchAttentionBackend.swap_blocks(src, dst, torch.tensor([[3, 0], [1, 1]]))
    assert dst[0].tolist() == [[18.0, 19.0, 20.0], [21.0, 22.0, 23.0]]
    assert dst[1].tolist() == [[6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]
