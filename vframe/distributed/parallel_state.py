"""``cleanup_dist_env_and_memory``, as vLLM's tests and examples call it between engines.

vframe runs one process with no process group (tensor parallelism is not built yet), so
there is no distributed state to tear down: what is left is freeing the memory of engines
that are gone (``del llm`` first)."""

from __future__ import annotations

import gc


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """Collect garbage and return the CUDA caching allocator's free blocks to the
    driver. ``shutdown_ray=True`` is refused: vframe does not use Ray."""
    if shutdown_ray:
        raise ValueError("shutdown_ray=True: vframe does not use Ray")
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()
