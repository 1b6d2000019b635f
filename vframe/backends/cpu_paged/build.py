"""Build the backend's C++ operators once per machine, with the system's C++ compiler.

The shared library lands in ``$VFRAME_CACHE_DIR/cpu_paged/<key>/`` where the key
hashes the sources, the torch version, the compiler and the CPU's instruction-set
flags (the code is built with ``-march=native``); later loads reuse it. Nothing
is downloaded. ``$VFRAME_CPU_PAGED_CXXFLAGS`` adds compiler flags (part of the
key; the tests build the portable path with ``-mno-avx512f``). ``make install``
builds it (``python -m vframe.backends.cpu_paged.build``); otherwise the first
engine that selects the backend does, and logs what it cost.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from functools import cache
from pathlib import Path

import torch

from vframe.models.loader.resolve import default_cache_dir

logger = logging.getLogger(__name__)

SOURCES = [Path(__file__).with_name("csrc") / "paged_attention.cpp"]
LIBRARY_NAME = "vframe_cpu_paged.so"


class BuildError(RuntimeError):
    """The operators could not be compiled here (no compiler, or it failed)."""


def compiler() -> str:
    """``$CXX``, else ``g++``, else ``c++``, as an executable path."""
    if cxx := os.environ.get("CXX"):
        if found := shutil.which(cxx):
            return found
        raise BuildError(f"CXX={cxx!r} is not an executable; unset it or point it at a C++ compiler")
    if found := shutil.which("g++") or shutil.which("c++"):
        return found
    raise BuildError("no C++ compiler found (looked for $CXX, g++ and c++); install g++ to build the cpu_paged backend")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile_command(cxx: str, sources: list[Path], output: Path) -> list[str]:
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib_dirs = cpp_extension.library_paths()
    return [
        cxx, "-O3", "-march=native", "-fopenmp-simd", "-shared", "-fPIC", "-std=c++20",
        *os.environ.get("VFRAME_CPU_PAGED_CXXFLAGS", "").split(),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        *(f"-I{p}" for p in cpp_extension.include_paths()),
        *(str(s) for s in sources),
        *(f"-L{p}" for p in lib_dirs), *(f"-Wl,-rpath,{p}" for p in lib_dirs),
        "-lc10", "-ltorch_cpu", "-o", str(output),
    ]  # fmt: skip


def _build_key(cxx: str) -> str:
    h = hashlib.sha256()
    for source in SOURCES:
        h.update(source.read_bytes())
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    command = " ".join(_compile_command(cxx, SOURCES, Path(LIBRARY_NAME)))
    for part in (command, torch.__version__, version, _cpu_flags(), platform.machine(), sys.version):
        h.update(part.encode())
    return h.hexdigest()[:16]


def library_path() -> Path:
    """Where this machine's build lives (whether or not it exists yet)."""
    return default_cache_dir() / "cpu_paged" / _build_key(compiler()) / LIBRARY_NAME


def build() -> Path:
    """Compile the operators unless this machine's build exists; return the library's path."""
    target = library_path()
    if target.exists():
        return target
    cxx = compiler()
    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    # Build beside the target and rename: a concurrent build never sees half a file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        partial = Path(tmp) / LIBRARY_NAME
        result = subprocess.run(_compile_command(cxx, SOURCES, partial), capture_output=True, text=True)
        if result.returncode != 0:
            raise BuildError(f"building the cpu_paged operators failed ({cxx}):\n{result.stderr[-4000:]}")
        os.replace(partial, target)
    logger.warning("built the cpu_paged attention operators in %.1f s (once per machine): %s",
                   time.perf_counter() - start, target)
    return target


@cache
def load_ops() -> None:
    """Build if needed and load the operators into ``torch.ops.vframe_cpu``."""
    torch.ops.load_library(str(build()))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(build())
