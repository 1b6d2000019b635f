"""Tensor-parallel state (``parallel_state``) and vLLM's ``vllm.distributed`` names
that user code calls (``cleanup_dist_env_and_memory``)."""

from vframe.distributed.parallel_state import cleanup_dist_env_and_memory

__all__ = ["cleanup_dist_env_and_memory"]
