"""check_mla_backend fails the MLA implementations that are wrong."""

import pytest
import torch

from vframe.backends.torch_attn import TorchAttentionBackend
from vframe.backends.torch_mla import TorchMLAImpl
from vframe.testing.mla import check_mla_backend


class _WrongScale(TorchMLAImpl):
    def __init__(self, num_heads: int, kv_lora_rank: int, qk_rope_head_dim: int, scale: float) -> None:
        super().__init__(num_heads, kv_lora_rank, qk_rope_head_dim, scale * 1.05)


class _CacheNotWritten(TorchMLAImpl):
    """Attends right but forgets to write the cache: decodes read stale NaN."""

    def forward(self, query, latent, kv_cache, attn_metadata):
        saved = kv_cache.clone()
        out = super().forward(query, latent, kv_cache, attn_metadata)
        kv_cache.copy_(saved)
        return out


def _backend(impl: type[TorchMLAImpl]) -> type[TorchAttentionBackend]:
    class Broken(TorchAttentionBackend):
        name = "broken-mla"

        @classmethod
        def get_mla_impl_cls(cls):
            return impl

    return Broken


def test_a_wrong_scale_fails() -> None:
    with pytest.raises(AssertionError, match="differs from the float32 reference"):
        check_mla_backend(_backend(_WrongScale), quick=True)


def test_a_cache_not_written_fails() -> None:
    with pytest.raises(AssertionError, match="NaN/inf"):
        check_mla_backend(_backend(_CacheNotWritten), quick=True)


def test_a_backend_refusing_mla_fails() -> None:
    class NoMLA(TorchAttentionBackend):
        name = "no-mla"

        @classmethod
        def validate_configuration(cls, *, use_mla: bool = False, **kwargs) -> list[str]:
            return ["no MLA here"] if use_mla else []

    with pytest.raises(AssertionError, match="refuses MLA for torch.float32: block_size=16: no MLA here"):
        check_mla_backend(NoMLA, dtype=torch.float32, quick=True)
