"""Which shard of a tensor-parallel layer this process holds, and the one collective.

Tensor parallelism (DESIGN.md §7, §11) is not wired yet: every process is rank 0
of 1, and ``EngineConfig`` refuses ``tensor_parallel_size > 1``. The layers take
``tp_rank`` / ``tp_size`` already, defaulting to these functions, so that when
workers hold real ranks only this module learns to read the process group.
"""

from __future__ import annotations

import torch

from vframe.errors import ConfigError


def get_tp_rank() -> int:
    return 0


def get_tp_size() -> int:
    return 1


def divide(numerator: int, denominator: int, what: str) -> int:
    """``numerator // denominator``, refusing a remainder: ``what`` names the
    quantity being split (``"num_attention_heads=9"``) for the message."""
    if numerator % denominator:
        raise ConfigError(f"{what} does not split evenly over tensor_parallel_size={denominator}")
    return numerator // denominator


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum ``x`` over the tensor-parallel ranks, in place."""
    if tp_size == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x)
    return x
