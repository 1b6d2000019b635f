"""NativeLibrary's build key and compile command: a header a library includes from vframe
counts as its sources do, so a change to it rebuilds every library that includes it."""

from __future__ import annotations

from pathlib import Path

from vframe.layers.cpu_ops import BF16_TILE, LIBRARY
from vframe.quant.kernels.builtin import woq_library
from vframe.utils.native import NativeLibrary, compiler


def test_a_header_s_bytes_are_in_the_key_and_its_folder_on_the_include_path(tmp_path: Path) -> None:
    source, header = tmp_path / "ops.cpp", tmp_path / "include" / "shared.h"
    header.parent.mkdir()
    source.write_text('#include "shared.h"\n')
    header.write_text("inline int one() { return 1; }\n")
    library = NativeLibrary("test_ops", (source,), "ops.so", "test operators", headers=(header,))
    cxx = compiler()
    before = library._build_key(cxx)
    assert f"-I{header.parent}" in library._compile_command(cxx, tmp_path / "ops.so")
    header.write_text("inline int one() { return 2; }\n")
    assert library._build_key(cxx) != before
    without = NativeLibrary("test_ops", (source,), "ops.so", "test operators")
    assert f"-I{header.parent}" not in without._compile_command(cxx, tmp_path / "ops.so")


def test_bf16_gemm_s_tile_is_one_header_both_libraries_include() -> None:
    assert BF16_TILE in LIBRARY.headers and BF16_TILE in woq_library().headers
    for library in (LIBRARY, woq_library()):
        assert all('#include "bf16_tile.h"' in source.read_text() for source in library.sources)
