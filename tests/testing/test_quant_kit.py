"""vframe.testing.quant: passes the unquantized method and the worked int8
quantizer, and catches the mistakes a quantizer author makes."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vframe.plugins import register_plugin, unregister_plugin
from vframe.quant.base import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod, set_weight_attrs
from vframe.testing.quant import check_quant_method

sys.path.insert(0, str(Path(__file__).parents[1] / "quant"))
from w8_quantizer import W8Config, W8LinearMethod, W8Plugin  # noqa: E402


class Unquantized(QuantizationConfig):
    @classmethod
    def get_name(cls) -> str:
        return "unquantized"

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16]

    @classmethod
    def from_config(cls, hf_quant_config):
        return cls()

    def get_quant_method(self, layer, prefix):
        return UnquantizedLinearMethod()


def test_unquantized_method_passes() -> None:
    check_quant_method(Unquantized)
    check_quant_method(Unquantized, dtype=torch.bfloat16, quick=True)


@pytest.fixture
def w8_registered() -> Iterator[None]:
    register_plugin(W8Plugin, "w8-kit-test")
    yield
    unregister_plugin("w8-kit-test")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_quantizer_passes_by_registry_name(w8_registered: None, dtype: torch.dtype) -> None:
    check_quant_method("w8-test", dtype=dtype)


class TransposedMethod(UnquantizedLinearMethod):
    """A checkpoint format that stores ``W.T`` as ``weight_t`` [in, out]."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype):
        weight_t = torch.empty(input_size_per_partition, sum(output_partition_sizes), dtype=params_dtype)
        weight_t = nn.Parameter(weight_t, requires_grad=False)  # [in, out]
        set_weight_attrs(weight_t, {"output_dim": 1, "input_dim": 0})
        layer.register_parameter("weight_t", weight_t)

    def apply(self, layer, x, bias=None):
        return F.linear(x, layer.weight_t.T, bias)

    def dequantize_weight(self, layer):
        return layer.weight_t.T


class Transposed(Unquantized):
    def get_quant_method(self, layer, prefix):
        return TransposedMethod()


def test_a_checkpoint_format_loads_the_tensors_its_author_supplies() -> None:
    check_quant_method(Transposed, checkpoint_tensors=lambda w: {"weight_t": w.T.contiguous()})


# --------------------------------------------------------------------------- #
# Broken methods the kit must reject
# --------------------------------------------------------------------------- #


class ForgetsBias(W8LinearMethod):
    def apply(self, layer, x, bias=None):
        return super().apply(layer, x, None)


class ScalesOnWrongRows(W8LinearMethod):
    def process_weights_after_loading(self, layer):
        super().process_weights_after_loading(layer)
        layer.weight_scale.data = layer.weight_scale.data.flip(0)


class ReturnsFloat32(W8LinearMethod):
    def apply(self, layer, x, bias=None):
        return super().apply(layer, x.float(), None if bias is None else bias.float())


class FirstTokenOnly(W8LinearMethod):
    def apply(self, layer, x, bias=None):
        return super().apply(layer, x[:1], bias)


class NoOutputDim(W8LinearMethod):
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype):
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype)
        layer.weight.output_dim = None  # the fused shards can no longer be placed


class IgnoresRank(W8LinearMethod):
    """Loads the first rank's slice whatever the rank: right at tp_size 1 only."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype):
        super().create_weights(layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype)
        rank = layer.tp_rank

        def loader(param, loaded_weight, shard_id=None):
            layer.tp_rank = 0
            try:
                layer.weight_loader(param, loaded_weight, shard_id)
            finally:
                layer.tp_rank = rank

        layer.weight.weight_loader = loader


def config_with(method_cls: type[LinearMethodBase]) -> type[QuantizationConfig]:
    return type(f"{method_cls.__name__}Config", (W8Config,), {"get_quant_method": lambda self, layer, prefix: method_cls()})


@pytest.mark.parametrize(
    ("method_cls", "dtype", "message"),
    [
        (ForgetsBias, torch.float32, "apply differs from F.linear"),
        (ScalesOnWrongRows, torch.float32, "dequantized weight row"),
        (ReturnsFloat32, torch.bfloat16, "apply returned torch.float32 for torch.bfloat16 activations"),
        (FirstTokenOnly, torch.float32, r"apply returned shape \(1, \d+\), expected \(7, \d+\)"),
        (NoOutputDim, torch.float32, "loading 'weight' of shard 'q' failed"),
    ],
    ids=lambda v: getattr(v, "__name__", None) or str(v)[:12],
)
def test_broken_methods_fail(method_cls: type[LinearMethodBase], dtype: torch.dtype, message: str) -> None:
    with pytest.raises(AssertionError, match=message):
        check_quant_method(config_with(method_cls), dtype=dtype, quick=True)


def test_a_method_that_ignores_its_rank_fails_only_the_full_check() -> None:
    check_quant_method(config_with(IgnoresRank), quick=True)  # tensor-parallel size 1 only
    with pytest.raises(AssertionError, match=r"tp rank 1 of 2\): dequantized weight row"):
        check_quant_method(config_with(IgnoresRank))


def test_a_config_that_quantizes_nothing_fails() -> None:
    class Declines(W8Config):
        def get_quant_method(self, layer, prefix):
            return None

    with pytest.raises(AssertionError, match="returned None for every layer"):
        check_quant_method(Declines, quick=True)
