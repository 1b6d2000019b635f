"""vframe's linear layers: where each checkpoint tensor lands, shard by shard and rank by rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vframe.quant.base import LinearMethodBase, QuantizationConfig, UnquantizedLinearMethod, set_weight_attrs


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def load(layer: LinearBase, name: str, tensor: torch.Tensor, shard_id: str | int | None = None) -> None:
    param = getattr(layer, name)
    if shard_id is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


def test_qkv_shards_land_side_by_side_with_gqa_sizes() -> None:
    # 4 query heads and 2 kv heads of size 3 over hidden 5: [q 12 | k 6 | v 6] rows.
    layer = QKVParallelLinear(5, 3, 4, 2, bias=True)
    q, k, v = randn(12, 5), randn(6, 5), randn(6, 5)
    for shard_id, w in (("q", q), ("k", k), ("v", v)):
        load(layer, "weight", w, shard_id)
        load(layer, "bias", w[:, 0], shard_id)

    assert (layer.q_size, layer.kv_size, layer.output_partition_sizes) == (12, 6, [12, 6, 6])
    assert torch.equal(layer.weight, torch.cat([q, k, v]))
    assert torch.equal(layer.bias, torch.cat([q, k, v])[:, 0])
    x = randn(7, 5)
    assert torch.equal(layer(x), F.linear(x, torch.cat([q, k, v]), torch.cat([q, k, v])[:, 0]))


def test_a_fused_checkpoint_tensor_loads_like_its_shards() -> None:
    fused, separate = QKVParallelLinear(5, 3, 4, 2, bias=False), QKVParallelLinear(5, 3, 4, 2, bias=False)
    w = randn(24, 5)
    load(fused, "weight", w)
    for shard_id, part in zip("qkv", w.split([12, 6, 6]), strict=True):
        load(separate, "weight", part, shard_id)

    assert torch.equal(fused.weight, w)
    assert torch.equal(separate.weight, w)


def test_merged_gate_up_and_unfused_layers_hold_their_checkpoint_weights() -> None:
    gate, up, down = randn(8, 4), randn(8, 4), randn(4, 8)
    merged = MergedColumnParallelLinear(4, [8, 8], bias=False)
    load(merged, "weight", gate, 0)
    load(merged, "weight", up, 1)
    row, column, replicated = RowParallelLinear(8, 4, bias=False), ColumnParallelLinear(4, 8), ReplicatedLinear(8, 4)
    load(row, "weight", down)
    load(column, "weight", gate)
    load(column, "bias", up[:, 0])
    load(replicated, "weight", down)

    assert merged.shard_ids == (0, 1)
    assert torch.equal(merged.weight, torch.cat([gate, up]))
    assert torch.equal(row.weight, down) and torch.equal(column.weight, gate) and torch.equal(replicated.weight, down)
    assert row.bias is None and torch.equal(column.bias, up[:, 0])


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (4, 1)], ids=["kv-split", "kv-replicated"])
def test_column_parallel_ranks_concatenate_to_the_whole_output(num_heads: int, num_kv_heads: int) -> None:
    head, hidden, tp = 2, 6, 2
    q, k, v = randn(num_heads * head, hidden), randn(num_kv_heads * head, hidden), randn(num_kv_heads * head, hidden)
    x = randn(3, hidden)
    outs = []
    for rank in range(tp):
        layer = QKVParallelLinear(hidden, head, num_heads, num_kv_heads, bias=False, tp_rank=rank, tp_size=tp)
        for shard_id, w in (("q", q), ("k", k), ("v", v)):
            load(layer, "weight", w, shard_id)
        outs.append(layer(x).split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1))

    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)  # noqa: E731: matmul blocking differs
    close(torch.cat([o[0] for o in outs], dim=-1), F.linear(x, q))  # query heads split over ranks
    for i, w in ((1, k), (2, v)):
        if num_kv_heads == tp:
            close(torch.cat([o[i] for o in outs], dim=-1), F.linear(x, w))
        else:  # one kv head, replicated on both ranks
            close(outs[0][i], F.linear(x, w))
            close(outs[1][i], F.linear(x, w))


def test_row_parallel_partial_sums_add_up_to_the_whole_output() -> None:
    w, x = randn(4, 8).double(), randn(3, 8).double()
    partial = []
    for rank in range(2):
        layer = RowParallelLinear(8, 4, bias=False, params_dtype=torch.float64, tp_rank=rank, tp_size=2)
        load(layer, "weight", w)
        assert torch.equal(layer.weight, w[:, 4 * rank : 4 * rank + 4])
        partial.append(layer.quant_method.apply(layer, x[:, 4 * rank : 4 * rank + 4]))

    torch.testing.assert_close(partial[0] + partial[1], F.linear(x, w), rtol=1e-12, atol=1e-12)


class PackedMethod(LinearMethodBase):
    """Two output features per stored row, plus one scale per fused shard: a stand-in
    for packed formats, to check where the loader puts such parameters."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size, params_dtype):
        packed = nn.Parameter(torch.empty(sum(output_partition_sizes) // 2, input_size_per_partition), requires_grad=False)
        set_weight_attrs(packed, {"output_dim": 0, "input_dim": 1})
        layer.register_parameter("packed", packed)
        scale = nn.Parameter(torch.empty(len(output_partition_sizes)), requires_grad=False)
        set_weight_attrs(scale, {"output_dim": None})
        layer.register_parameter("scale", scale)

    def apply(self, layer, x, bias=None):
        raise NotImplementedError


class PackedConfig(QuantizationConfig):
    @classmethod
    def get_name(cls) -> str:
        return "packed-test"

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32]

    @classmethod
    def from_config(cls, hf_quant_config):
        return cls()

    def get_quant_method(self, layer, prefix):
        self.asked = (type(layer).__name__, prefix, layer.output_partition_sizes, layer.tp_size)
        return PackedMethod()


def test_packed_and_per_shard_parameters_are_placed_in_proportion() -> None:
    config = PackedConfig()
    layer = QKVParallelLinear(5, 4, 2, 1, bias=False, quant_config=config, prefix="layers.0.qkv_proj")
    q, k, v = randn(4, 5), randn(2, 5), randn(2, 5)  # packed: 8, 4 and 4 output features
    for shard_id, w, s in (("q", q, 1.0), ("k", k, 2.0), ("v", v, 3.0)):
        load(layer, "packed", w, shard_id)
        load(layer, "scale", torch.tensor(s), shard_id)

    assert config.asked == ("QKVParallelLinear", "layers.0.qkv_proj", [8, 4, 4], 1)
    assert isinstance(layer.quant_method, PackedMethod)
    assert torch.equal(layer.packed, torch.cat([q, k, v]))
    assert layer.scale.tolist() == [1.0, 2.0, 3.0]


def test_a_config_returning_none_leaves_the_layer_unquantized() -> None:
    class Nothing(PackedConfig):
        def get_quant_method(self, layer, prefix):
            return None

    layer = RowParallelLinear(6, 4, quant_config=Nothing())
    assert type(layer.quant_method) is UnquantizedLinearMethod
    assert [n for n, _ in layer.named_parameters()] == ["weight", "bias"]


def test_wrong_checkpoint_shape_names_both_shapes() -> None:
    layer = QKVParallelLinear(5, 3, 4, 2)
    with pytest.raises(ModelLoadError, match=r"has shape \(7, 5\), the model expects size 6 along dimension 0"):
        load(layer, "weight", randn(7, 5), "k")
    with pytest.raises(ModelLoadError, match=r"has shape \(6, 4\), the model expects \(6, 5\)"):
        load(layer, "weight", randn(6, 4), "k")


def test_shard_ids_are_checked() -> None:
    with pytest.raises(ValueError, match=r"shard id 'x' is not one of \('q', 'k', 'v'\)"):
        load(QKVParallelLinear(5, 3, 4, 2), "weight", randn(6, 5), "x")
    with pytest.raises(ValueError, match=r"shard id 2 is not one of \(0, 1\)"):
        load(MergedColumnParallelLinear(4, [8, 8]), "weight", randn(8, 4), 2)
    with pytest.raises(ValueError, match="has no fused shards"):
        load(RowParallelLinear(8, 4), "weight", randn(4, 8), 0)


def test_heads_that_do_not_split_over_ranks_are_a_config_error() -> None:
    with pytest.raises(ConfigError, match="num_attention_heads=9 does not split evenly over tensor_parallel_size=2"):
        QKVParallelLinear(576, 64, 9, 3, tp_size=2)
    with pytest.raises(ConfigError, match="num_key_value_heads=3: replicas of does not split evenly"):
        QKVParallelLinear(576, 64, 12, 3, tp_size=4)
