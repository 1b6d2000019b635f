"""The ``cpu_paged`` backend: its C++ decode and prefill operators against the float32
definition (random block tables, NaN in every slot it must not read, GQA, MQA,
head sizes with and without a compiled-in specialisation, sliding windows), the
conformance kit in three dtypes, greedy tokens against the torch backend on
SmolLM2, and how the build behaves (cached per machine, a missing compiler is a
refusal that names the fix)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from vframe.backends.cpu_paged import build
from vframe.backends.cpu_paged.backend import CpuPagedAttentionBackend
from vframe.testing.attention import ATTENTION_TOLERANCES, check_attention_backend, reference_attention


@pytest.fixture(scope="module", autouse=True)
def ops() -> None:
    build.load_ops()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_conforms(dtype: torch.dtype) -> None:
    # the whole kit: prefills, cached prefixes, mixed steps, MHA/GQA/MQA, windows, head sizes 32-256 and 80
    check_attention_backend("cpu_paged", dtype=dtype)


def test_prefills_past_the_kernel_s_length_take_sdpa_and_conform(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long contexts go to SDPA in layers without a window (the kit's prompts are short: the
    limit is lowered to 8 tokens so that both paths, and windows on the kernel, are run)."""
    from vframe.backends.cpu_paged import backend

    calls = []
    attend = backend.attend_prefills
    monkeypatch.setattr(backend, "kernel_max_seq_len", lambda: 8)
    monkeypatch.setattr(backend, "attend_prefills", lambda *args: calls.append(len(args[-2])) or attend(*args))
    check_attention_backend("cpu_paged", dtype=torch.float32)
    assert calls and min(calls) >= 1


SHAPE_NAMES = ("num_heads", "num_kv_heads", "head_size", "block_size", "window")
SHAPES = [
    (9, 3, 64, 16, None),  # SmolLM2's shape
    (8, 1, 128, 16, None),  # MQA, a specialised head size
    (4, 4, 48, 8, None),  # MHA, a head size taken at run time
    (6, 2, 64, 16, 7),  # sliding window
]


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize(SHAPE_NAMES, SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
# AVX2 splits few requests (under 4 per thread) by KV head and takes many whole: one thread
# and these six requests take the second path, two or more threads the first.
@pytest.mark.parametrize("threads", [1, max(2, torch.get_num_threads())])
def test_decode_operator_against_the_definition(
    num_heads: int, num_kv_heads: int, head_size: int, block_size: int, window: int | None, dtype: torch.dtype,
    threads: int,
) -> None:
    with torch_threads(threads):
        _check_decode_operator(num_heads, num_kv_heads, head_size, block_size, window, dtype)


def _paged_requests(seq_lens: list[int], num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype):
    """A cache of NaN where each request owns a random set of blocks and only its first
    seq_len slots are written; its block table, and each request's keys and values."""
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    # each request owns a random set of blocks; only its first seq_len slots are written
    order = torch.randperm(num_blocks).tolist()
    tables, keys, values = [], [], []
    for n in seq_lens:
        own = [order.pop() for _ in range(-(-n // block_size))]
        tables.append(own)
        k = torch.randn(n, num_kv_heads, head_size, dtype=dtype)
        v = torch.randn(n, num_kv_heads, head_size, dtype=dtype)
        for p in range(n):
            cache[0, own[p // block_size], p % block_size] = k[p]
            cache[1, own[p // block_size], p % block_size] = v[p]
        keys.append(k)
        values.append(v)
    width = max(len(t) for t in tables)
    block_table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return cache, block_table, keys, values


def _check_decode_operator(
    num_heads: int, num_kv_heads: int, head_size: int, block_size: int, window: int | None, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    seq_lens = [1, 5, block_size, block_size + 1, 3 * block_size - 2, 70]
    cache, block_table, keys, values = _paged_requests(seq_lens, num_kv_heads, head_size, block_size, dtype)
    # the decodes sit at rows 2, 0, 5, ... of a step whose other rows the operator must leave alone
    rows = torch.tensor([2, 0, 5, 1, 7, 3])
    query = torch.randn(8, num_heads, head_size, dtype=dtype)
    out = torch.full_like(query, 7.0)
    scale = head_size**-0.5
    torch.ops.vframe_cpu.paged_decode_attention(
        out, query, cache[0], cache[1], block_table, torch.tensor(seq_lens, dtype=torch.int32),
        torch.arange(len(seq_lens)), rows, scale, window or 0,
    )  # fmt: skip
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    for b, row in enumerate(rows.tolist()):
        want = reference_attention(query[row : row + 1], keys[b], values[b], scale, window)
        torch.testing.assert_close(out[row : row + 1].float(), want, atol=atol, rtol=rtol)
    untouched = [r for r in range(8) if r not in rows.tolist()]
    assert (out[untouched] == 7.0).all()


# and a window longer than some requests, a head size of ten vectors
@pytest.mark.parametrize(SHAPE_NAMES, [*SHAPES, (4, 2, 80, 16, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, max(2, torch.get_num_threads())])
def test_prefill_operator_against_the_definition(
    num_heads: int, num_kv_heads: int, head_size: int, block_size: int, window: int | None, dtype: torch.dtype,
    threads: int,
) -> None:
    """Whole prompts and chunks over a cached prefix (the query is the last Q positions of
    the request's keys), tiles of 16 query tokens with a shorter last one, more keys than
    one block of 64: against the float32 definition, nothing read past a request's own
    slots (NaN there), no other row of the step written."""
    torch.manual_seed(1)
    # (seq_len, query_len)
    requests = [(5, 5), (40, 40), (70, 3), (300, 37), (block_size, 2), (2 * block_size + 1, 17)]
    cache, block_table, keys, values = _paged_requests([n for n, _ in requests], num_kv_heads, head_size,
                                                       block_size, dtype)
    starts, row = [], 1  # row 0 and one row between requests belong to no request
    for _, q_len in requests:
        starts.append(row)
        row += q_len + 1
    query = torch.randn(row, num_heads, head_size, dtype=dtype)
    out = torch.full_like(query, 7.0)
    scale = head_size**-0.5
    with torch_threads(threads):
        torch.ops.vframe_cpu.paged_prefill_attention(
            out, query, cache[0], cache[1], block_table, torch.tensor([n for n, _ in requests], dtype=torch.int32),
            torch.arange(len(requests)), torch.tensor(starts), torch.tensor([q for _, q in requests]), scale, window or 0,
        )  # fmt: skip
    atol, rtol = ATTENTION_TOLERANCES[dtype]
    written = []
    for b, ((_, q_len), start) in enumerate(zip(requests, starts)):
        want = reference_attention(query[start : start + q_len], keys[b], values[b], scale, window)
        torch.testing.assert_close(out[start : start + q_len].float(), want, atol=atol, rtol=rtol)
        written += range(start, start + q_len)
    untouched = [r for r in range(row) if r not in written]
    assert (out[untouched] == 7.0).all()


def test_bad_arguments_are_refused_by_name() -> None:
    q = torch.randn(2, 4, 64)
    cache = torch.zeros(3, 16, 2, 64)
    args = (cache, cache, torch.zeros(2, 1, dtype=torch.int32), torch.ones(2, dtype=torch.int32),
            torch.arange(2), torch.arange(2), 0.125, 0)  # fmt: skip
    with pytest.raises(RuntimeError, match="must share a dtype"):
        torch.ops.vframe_cpu.paged_decode_attention(torch.empty_like(q), q.bfloat16(), *args)
    with pytest.raises(RuntimeError, match="block_table and seq_lens must be int32"):
        torch.ops.vframe_cpu.paged_decode_attention(
            torch.empty_like(q), q, cache, cache, torch.zeros(2, 1, dtype=torch.int64), *args[3:]
        )
    prefill = torch.ops.vframe_cpu.paged_prefill_attention
    one_each = torch.ones(2, dtype=torch.int32)  # seq_lens: one token per request
    with pytest.raises(RuntimeError, match="paged_prefill_attention: request 1 has 2 query tokens of 1"):
        prefill(torch.empty_like(q), q, cache, cache, args[2], one_each, torch.tensor([1]), torch.tensor([0]),
                torch.tensor([2]), 0.125, 0)
    with pytest.raises(RuntimeError, match="request 0's query rows 1 .. 3 are not rows of the 2-row query"):
        prefill(torch.empty_like(q), q, cache, cache, args[2], one_each + 1, torch.tensor([0]), torch.tensor([1]),
                torch.tensor([2]), 0.125, 0)
    with pytest.raises(RuntimeError, match="paged_prefill_attention: the request vectors must be contiguous int64"):
        prefill(torch.empty_like(q), q, cache, cache, args[2], one_each, torch.arange(2), torch.tensor([0]),
                torch.tensor([1, 1]), 0.125, 0)


def test_greedy_tokens_equal_the_torch_backend() -> None:
    from vframe import LLM, SamplingParams

    prompts = ["The capital of France is", "def add(a, b):", "Once upon a time, in a land far away,"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    tokens = {}
    for backend in ("cpu_paged", "torch"):
        llm = LLM(attention_backend=backend, dtype="float32", num_threads=2)
        tokens[backend] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert tokens["cpu_paged"] == tokens["torch"]


def test_refusals_say_why() -> None:
    reasons = CpuPagedAttentionBackend.validate_configuration(
        head_size=64, dtype=torch.float32, device="cuda", block_size=16, use_mla=True
    )
    assert reasons == [
        "the cpu_paged backend runs on the CPU only, not on cuda",
        "the cpu_paged backend has no multi-head latent attention path (the torch backend has)",
    ]
    assert CpuPagedAttentionBackend.check_available() == []


def test_a_missing_compiler_is_a_refusal_naming_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    with pytest.raises(build.BuildError, match=r"CXX='/nonexistent/g\+\+' is not an executable"):
        build.build()
    monkeypatch.delenv("CXX")
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(build.BuildError, match="no C\\+\\+ compiler found"):
        build.library_path()


@pytest.mark.slow  # two compilations into a fresh cache: about a minute
def test_the_portable_path_conforms_and_its_build_is_reused(tmp_path) -> None:
    # What CPUs without AVX-512 run: the operator built with -mno-avx512f into a fresh
    # cache by one process; a second process finds that build, does not rebuild it,
    # and passes the conformance kit with it.
    env = {**os.environ, "VFRAME_CACHE_DIR": str(tmp_path), "VFRAME_CPU_PAGED_CXXFLAGS": "-mno-avx512f"}
    code = "from vframe.backends.cpu_paged import build; print(build.build())"
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "built the cpu_paged attention operators in" in first.stderr
    path = first.stdout.strip()
    assert path.startswith(str(tmp_path / "cpu_paged"))
    mtime = os.stat(path).st_mtime_ns
    code = (
        "import torch\n"
        "from vframe.backends.cpu_paged import build\n"
        "from vframe.testing.attention import check_attention_backend\n"
        "for dtype in (torch.float32, torch.bfloat16):\n"
        "    check_attention_backend('cpu_paged', dtype=dtype)\n"
        "print(build.library_path())\n"
    )
    second = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr[-3000:]
    # (the fused KV write, vframe.layers.cpu_ops, is a library of its own, built there once)
    assert second.stdout.strip() == path and "built the cpu_paged" not in second.stderr
    assert os.stat(path).st_mtime_ns == mtime


def test_prefills_take_sdpa_past_1024_tokens_only_without_the_avx512_tiles() -> None:
    from vframe.backends.cpu_paged import backend

    avx512 = "avx512f" in open("/proc/cpuinfo").read()  # -march=native: the build has what the CPU has
    assert torch.ops.vframe_cpu.prefill_tiles() is avx512
    assert backend.kernel_max_seq_len() == (sys.maxsize if avx512 else 1024)


@pytest.mark.skipif("avx512_bf16" in open("/proc/cpuinfo").read(), reason="this machine builds the AVX-512 paths itself")
@pytest.mark.parametrize("library", ["cpu_paged", "cpu_ops"])
def test_the_avx512_paths_compile_on_a_machine_without_them(tmp_path, library: str) -> None:
    """A machine without AVX-512 (or without its bfloat16 instructions) never builds those
    paths (-march=native), and a CPU with them may not be at hand: their intrinsics (the
    float8 widening, vdpbf16ps, SLEEF's 16-float exp among them) are at least compiled here,
    every template instantiated. Cooper Lake: AVX-512 with BF16."""
    from vframe.layers import cpu_ops

    native = build.LIBRARY if library == "cpu_paged" else cpu_ops.LIBRARY
    command = native._compile_command(build.compiler(), tmp_path / "unused.so")
    command[command.index("-march=native")] = "-march=cooperlake"
    result = subprocess.run([*command, "-fsyntax-only"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
