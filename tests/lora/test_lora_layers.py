"""vframe.lora.layers: LoRALinear's slices, slots and tensor-parallel shards, on tiny layers."""

from __future__ import annotations

import torch

from vframe.layers.linear import (
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vframe.lora.layers import LoRALinear, LoRAStepContext
from vframe.lora.ops import LoRASegments, add_lora
from vframe.lora.peft import LoRAWeights

NO_LORA = LoRASegments.from_lists([], [], [])


def wrap(base: LinearBase, segments: LoRASegments = NO_LORA, max_lora_rank: int = 4) -> LoRALinear:
    return LoRALinear(
        base,
        LoRAStepContext(segments),
        max_loras=2,
        max_lora_rank=max_lora_rank,
        dtype=torch.float32,
        device="cpu",
        kernel=add_lora,
    )


def qkv(tp_rank: int = 0, tp_size: int = 1) -> QKVParallelLinear:
    # hidden 8, 4 heads of 2 (q: 8), 2 kv heads (k, v: 4 each)
    return QKVParallelLinear(8, 2, 4, 2, bias=False, params_dtype=torch.float32, tp_rank=tp_rank, tp_size=tp_size)


def randn(*shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def test_qkv_adds_each_slice_delta_to_the_segment_tokens() -> None:
    weight = randn(16, 8)  # [q | k | v] rows
    a_q, b_q, a_k, b_k = randn(2, 8), randn(8, 2), randn(3, 8), randn(4, 3)
    x = randn(4, 8)
    expected = x @ weight.T  # [4, 16]
    expected[:3, :8] += 0.5 * (x[:3] @ a_q.T @ b_q.T)  # tokens 0-2 use the adapter, token 3 none
    expected[:3, 8:12] += 2.0 * (x[:3] @ a_k.T @ b_k.T)  # v: not adapted

    outputs = []
    for tp_rank in (0, 1):  # the two ranks of tensor parallelism 2 give the halves of every slice
        base = qkv(tp_rank, 2)
        base.weight_loader(base.weight, weight)
        layer = wrap(base, LoRASegments.from_lists([0], [3], [1]))
        weights = [LoRAWeights(a_q, b_q, 0.5), LoRAWeights(a_k, b_k, 2.0), None]
        layer.set_slot(1, [layer.shard(i, w) if w else None for i, w in enumerate(weights)])
        with torch.inference_mode():
            outputs.append(layer(x).split([4, 2, 2], dim=-1))  # this rank's q, k, v

    got = torch.cat([torch.cat([rank[i] for rank in outputs], dim=-1) for i in range(3)], dim=-1)
    torch.testing.assert_close(got, expected)


def test_without_segments_the_output_is_the_base_layer_bit_for_bit() -> None:
    base = qkv()
    base.weight_loader(base.weight, randn(16, 8))
    layer = wrap(base)
    layer.set_slot(0, [LoRAWeights(randn(2, 8), randn(8, 2), 1.0), None, None])
    x = randn(3, 8)

    with torch.inference_mode():
        assert torch.equal(layer(x), base(x))


def test_column_parallel_layers_keep_their_rows_of_b() -> None:
    # tp 4 over 2 kv heads of 4: each kv head on 2 ranks; rank 3 holds kv head 1, rows 4-7 of k
    layer = wrap(QKVParallelLinear(16, 4, 8, 2, bias=False, tp_rank=3, tp_size=4))
    b_k = torch.arange(8.0).view(8, 1)  # rank 1
    assert layer.output_slices == [8, 4, 4]
    assert layer.full_shapes(1, 1) == ([1, 16], [8, 1])
    assert layer.shard(1, LoRAWeights(torch.ones(1, 16), b_k, 1.0)).lora_b.flatten().tolist() == [4, 5, 6, 7]
    b_q = torch.arange(32.0).view(32, 1)
    assert layer.shard(0, LoRAWeights(torch.ones(1, 16), b_q, 1.0)).lora_b.flatten().tolist() == list(range(24, 32))

    merged = wrap(MergedColumnParallelLinear(4, [6, 6], bias=False, tp_rank=1, tp_size=2))
    gate_b = torch.arange(6.0).view(6, 1)
    assert merged.full_shapes(0, 1) == ([1, 4], [6, 1])
    assert merged.shard(0, LoRAWeights(torch.ones(1, 4), gate_b, 1.0)).lora_b.flatten().tolist() == [3, 4, 5]


def test_row_parallel_layers_keep_their_columns_of_a() -> None:
    layer = wrap(RowParallelLinear(8, 6, bias=False, tp_rank=1, tp_size=2))
    a = torch.arange(8.0).view(1, 8)
    b = torch.ones(6, 1)

    shard = layer.shard(0, LoRAWeights(a, b, 1.0))

    assert layer.full_shapes(0, 1) == ([1, 8], [6, 1])
    assert shard.lora_a.tolist() == [[4, 5, 6, 7]]
    assert shard.lora_b is b
    assert tuple(layer.lora_a(0).shape) == (2, 4, 4)  # [max_loras, max_rank, in / tp]


def test_a_smaller_adapter_leaves_no_trace_of_the_slot_previous_one() -> None:
    layer = wrap(ReplicatedLinear(4, 3, bias=False))
    layer.set_slot(1, [LoRAWeights(torch.ones(4, 4), torch.ones(3, 4), 1.0)])

    layer.set_slot(1, [LoRAWeights(torch.full((2, 4), 2.0), torch.full((3, 2), 3.0), 0.25)])

    assert layer.lora_a(0)[1].tolist() == [[2.0] * 4, [2.0] * 4, [0.0] * 4, [0.0] * 4]
    assert layer.lora_b(0)[1].tolist() == [[3.0, 3.0, 0.0, 0.0]] * 3
    assert layer.scaling.tolist() == [[0.0, 0.25]]
    layer.clear_slot(1)
    assert not layer.lora_a(0).any() and not layer.lora_b(0).any() and not layer.scaling.any()
