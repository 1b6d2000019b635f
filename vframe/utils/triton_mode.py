"""Whether Triton kernels run compiled on an NVIDIA GPU or under Triton's interpreter on CPU
tensors (``TRITON_INTERPRET=1``: how the tests run them), for the modules that launch them
(the ``triton`` attention backend, the ``triton`` quant kernel). Nothing here imports Triton
unless it is installed and asked about."""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType

import torch


def interpreted() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for Triton's interpreter (CPU tensors)."""
    if importlib.util.find_spec("triton") is None:
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)


def unavailable(what: str) -> list[str]:
    """Why ``what`` (its Triton kernels) cannot run on this machine, or ``[]``: what a
    ``check_available`` says."""
    if importlib.util.find_spec("triton") is None:
        return ["the triton package is not installed; pip install 'vframe[triton]'"]
    if not torch.cuda.is_available() and not interpreted():
        return [f"needs an NVIDIA GPU (CUDA); TRITON_INTERPRET=1 runs {what} on the CPU through Triton's "
                "interpreter, for tests only"]
    return []


def load_kernels(module: str) -> ModuleType:
    """The kernel module ``module`` (importing Triton). Triton reads ``TRITON_INTERPRET`` once,
    when it is imported (its own library functions are decorated then): the mode cannot
    change within a process; the module's ``INTERPRETED`` records it."""
    kernels = importlib.import_module(module)
    if kernels.INTERPRETED != interpreted():
        raise RuntimeError(
            f"TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')!r}, but Triton was imported "
            f"{'with' if kernels.INTERPRETED else 'without'} its interpreter; set the variable "
            "before the process imports Triton"
        )
    return kernels
