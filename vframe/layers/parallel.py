"""Which shard of a tensor-parallel layer this process holds, and the collectives
the layers run (DESIGN.md §7, §9, §11).

The layers take ``tp_rank`` / ``tp_size`` and default them to the process's
rank in its tensor-parallel group (``vframe/distributed/parallel_state.py``):
rank 0 of 1 unless an executor started this process as a worker of a larger
group. At size 1 every collective here is the identity and imports nothing.
"""

from __future__ import annotations

import torch

from vframe.distributed.parallel_state import get_tp_rank, get_tp_size
from vframe.errors import ConfigError

__all__ = ["all_gather", "all_reduce", "broadcast_from_first", "divide", "get_tp_rank", "get_tp_size"]


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, refusing a remainder: ``what`` names the
    quantity being split (``"num_attention_heads=9"``) for the message."""
    if numerator % denominator:
        raise ConfigError(
            f"{what} does not split evenly over tensor_parallel_size={denominator}; use a "
            f"tensor_parallel_size that divides it"
        )
    return numerator // denominator


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks, in place."""
    if tp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Every rank's ``x`` side by side along the last dimension, in rank order:
    ``[..., N]`` per rank -> ``[..., tp_size * N]`` on every rank."""
    if tp_size == 1:
        return x
    import torch.distributed as dist

    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=-1)


def broadcast_from_first(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Overwrite ``x`` on every rank with rank 0's, in place."""
    if tp_size == 1:
        return x
    import torch.distributed as dist

    dist.broadcast(x, src=0)
    return x
