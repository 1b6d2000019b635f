"""Build the backend's C++ operators once per machine (``vframe.utils.native``).

The shared library lands in ``$VFRAME_CACHE_DIR/cpu_paged/<key>/``; the key
hashes the sources, the torch version, the compiler and the CPU's flags (the code
is built with ``-march=native``). ``$VFRAME_CPU_PAGED_CXXFLAGS`` adds compiler
flags (part of the key; the tests build the portable path with
``-mno-avx512f``). ``make install`` builds it (``python -m
vframe.backends.cpu_paged.build``); otherwise the first engine that selects the
backend does, and logs what it cost.
"""

from __future__ import annotations

import logging
from functools import cache
from pathlib import Path

from vframe.utils.native import BuildError, NativeLibrary, compiler

__all__ = ["BuildError", "LIBRARY", "build", "compiler", "library_path", "load_ops"]

LIBRARY = NativeLibrary(
    "cpu_paged", (Path(__file__).with_name("csrc") / "paged_attention.cpp",), "vframe_cpu_paged.so",
    "cpu_paged attention operators",
)


def library_path() -> Path:
    """Where this machine's build lives (whether or not it exists yet)."""
    return LIBRARY.path()


def build() -> Path:
    """Compile the operators unless this machine's build exists; return the library's path."""
    return LIBRARY.build()


@cache
def load_ops() -> None:
    """Build if needed and load the operators into ``torch.ops.vframe_cpu``."""
    LIBRARY.load()


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(build())
