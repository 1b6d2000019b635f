"""The C allocator's settings for a process that runs a model on the CPU.

Tensors of a forward come and go in megabytes (a 4,096-token prefill of SmolLM2 makes a
25 MB SwiGLU input in every layer). glibc's ``malloc`` serves blocks above its mmap
threshold with fresh ``mmap`` pages and returns freed memory at the top of its heap to the
system above its trim threshold; both thresholds move at run time, so how often a forward
writes into new pages depends on the order its earlier blocks were freed in. Every first
write to such a page is a page fault (the kernel zeroes 4 KiB): a GEMM writing its output
into fresh pages ran at 320 GFLOP/s against 425 into reused ones, and the prefill steps of
the offline benchmark took 115,000 to 820,000 faults from run to run (80,000 with these
settings: the KV cache's first writes).

``tune_allocator()`` fixes both thresholds, as a caching allocator would behave: blocks up to
32 MiB (glibc's largest mmap threshold) come from the heap and freed memory stays in the
process up to 1 GiB. ``VFRAME_MALLOC_TUNING=0`` leaves the allocator as it is; other
allocators (tcmalloc or jemalloc preloaded, musl) are left alone.
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from functools import cache

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc refuses more than HEAP_MAX_SIZE / 2 (32 MiB on 64-bit)
TRIM_THRESHOLD = 1 << 30


@cache
def tune_allocator() -> bool:
    """Set glibc's thresholds once per process; whether they were set."""
    if os.environ.get("VFRAME_MALLOC_TUNING", "1") == "0" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only: musl's mallopt does nothing
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if done:
        logger.debug("malloc: blocks up to %d MiB from the heap, up to %d MiB kept after free",
                     MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20)
    else:
        logger.info("malloc: mallopt refused the thresholds; the allocator keeps its own")
    return done
