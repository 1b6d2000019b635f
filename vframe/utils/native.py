"""Build vframe's C++ operator libraries once per machine, with the system's C++ compiler.

A ``NativeLibrary`` lands in ``$VFRAME_CACHE_DIR/<name>/<key>/`` where the key
hashes the sources, the torch version, the compiler and the CPU's instruction-set
flags (the code is built with ``-march=native``); later loads reuse it. Nothing
is downloaded. ``$VFRAME_CPU_PAGED_CXXFLAGS`` adds compiler flags to every library
(part of the key; the tests build the portable paths with ``-mno-avx512f``).
``make install`` builds them; otherwise the first run that needs one does, and
logs what it cost.
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
from dataclasses import dataclass
from pathlib import Path

import torch

from vframe.models.loader.resolve import default_cache_dir

logger = logging.getLogger(__name__)

CXXFLAGS_ENV = "VFRAME_CPU_PAGED_CXXFLAGS"


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
    raise BuildError("no C++ compiler found (looked for $CXX, g++ and c++); install g++ to build vframe's CPU operators")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@dataclass(frozen=True)
class NativeLibrary:
    """One shared library of torch operators: ``name`` (its cache folder), its
    C++ ``sources``, the file name it builds to and what it holds (for messages);
    ``headers`` it includes from vframe (their folders on the include path, their
    bytes in the build key, as the sources')."""

    name: str
    sources: tuple[Path, ...]
    file_name: str
    what: str
    flags: tuple[str, ...] = ()  # compiler flags of this library's own
    headers: tuple[Path, ...] = ()

    def _compile_command(self, cxx: str, output: Path) -> list[str]:
        from torch.utils import cpp_extension

        abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
        lib_dirs = cpp_extension.library_paths()
        return [
            cxx, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++20",
            *self.flags, *os.environ.get(CXXFLAGS_ENV, "").split(),
            f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
            *(f"-I{p}" for p in dict.fromkeys(h.parent for h in self.headers)),
            *(f"-I{p}" for p in cpp_extension.include_paths()),
            *(str(s) for s in self.sources),
            *(f"-L{p}" for p in lib_dirs), *(f"-Wl,-rpath,{p}" for p in lib_dirs),
            "-lc10", "-ltorch_cpu", "-o", str(output),
        ]  # fmt: skip

    def _build_key(self, cxx: str) -> str:
        h = hashlib.sha256()
        for source in (*self.sources, *self.headers):
            h.update(source.read_bytes())
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
        command = " ".join(self._compile_command(cxx, Path(self.file_name)))
        for part in (command, torch.__version__, version, _cpu_flags(), platform.machine(), sys.version):
            h.update(part.encode())
        return h.hexdigest()[:16]

    def path(self) -> Path:
        """Where this machine's build lives (whether or not it exists yet)."""
        return default_cache_dir() / self.name / self._build_key(compiler()) / self.file_name

    def build(self) -> Path:
        """Compile unless this machine's build exists; return the library's path."""
        target = self.path()
        if target.exists():
            return target
        cxx = compiler()
        target.parent.mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        # Build beside the target and rename: a concurrent build never sees half a file.
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            partial = Path(tmp) / self.file_name
            result = subprocess.run(self._compile_command(cxx, partial), capture_output=True, text=True)
            if result.returncode != 0:
                raise BuildError(f"building the {self.what} failed ({cxx}):\n{result.stderr[-4000:]}")
            os.replace(partial, target)
        logger.warning("built the %s in %.1f s (once per machine): %s",
                       self.what, time.perf_counter() - start, target)
        return target

    def load(self) -> None:
        """Build if needed and load the operators into ``torch.ops``."""
        torch.ops.load_library(str(self.build()))
