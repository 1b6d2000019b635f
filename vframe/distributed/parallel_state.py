"""Which tensor-parallel rank this process is, and the process group its layers
reduce over (DESIGN.md §7, §11).

A worker started by an executor calls ``init_tensor_parallel`` once, before it
builds the model: the linear layers read ``get_tp_rank`` / ``get_tp_size`` when
they are constructed and take their shard of every weight. A process that never
calls it (the driver, or any engine with ``tensor_parallel_size=1``) is rank 0
of 1 and runs no collective.

The collectives are torch.distributed's: gloo on the CPU, NCCL on CUDA.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class TensorParallelState:
    rank: int
    size: int
    backend: str  # "gloo" or "nccl"


_STATE: TensorParallelState | None = None


def init_tensor_parallel(
    rank: int, size: int, init_method: str, *, backend: str = "gloo", timeout_s: float = 600.0
) -> None:
    """Join the ``size`` ranks of one model as ``rank``; ``init_method`` is a
    ``tcp://host:port`` or ``file://path`` rendezvous every rank was given."""
    global _STATE
    import torch.distributed as dist

    if _STATE is not None:
        raise RuntimeError(f"this process is tensor-parallel rank {_STATE.rank} of {_STATE.size} already")
    dist.init_process_group(
        backend, init_method=init_method, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s)
    )
    _STATE = TensorParallelState(rank, size, backend)


def destroy_tensor_parallel() -> None:
    global _STATE
    if _STATE is None:
        return
    import torch.distributed as dist

    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()


def get_tp_rank() -> int:
    return 0 if _STATE is None else _STATE.rank


def get_tp_size() -> int:
    return 1 if _STATE is None else _STATE.size


def tensor_parallel_state() -> TensorParallelState | None:
    return _STATE


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's helper, as its tests and examples call it between engines: leave
    the process group (if this process joined one), collect garbage and return
    the CUDA caching allocator's free blocks. ``shutdown_ray=True`` also stops a
    Ray runtime this process started (``ray.shutdown()``), when Ray is installed."""
    destroy_tensor_parallel()
    if shutdown_ray:
        try:
            import ray
        except ImportError:
            pass
        else:
            ray.shutdown()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
