"""Model building blocks shared by architectures: the linear layers that carry
quantization and tensor parallelism (``linear``) and which shard a process holds
(``parallel``). See DESIGN.md §9."""

from vframe.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)

__all__ = [
    "ColumnParallelLinear",
    "LinearBase",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "ReplicatedLinear",
    "RowParallelLinear",
]
