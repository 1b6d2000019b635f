"""``vframe bench attention``: every attention backend against the plain-PyTorch one.

Each shape is one attention step of one layer: ``B`` requests with ``C`` tokens
already cached each run ``Q`` new tokens (a decode: ``Q = 1``)::

    request b:  | cached: C (written before timing) | new: Q (timed) |

For each backend (every registered one whose ``check_available()`` is empty, or
``--backends``), the bench goes through the ``AttentionBackend`` interface only:
a cache of ``get_kv_cache_shape(...)`` filled with the ``C`` cached tokens by the
backend's own ``forward`` (a prefill per request, not timed), then the step's
metadata built once by its builder (not timed: a model builds it once for all
layers), then ``forward(query, key, value, kv_cache, meta)`` timed ``--iters``
times: the write of the new tokens' keys and values plus attention. Every backend
sees the same keys, values and queries; its block table is a random permutation
of its own blocks at its own block size. The built-in ``torch`` backend is the
reference: ``speedup = torch time / time``, ``error = max |out - out_torch|``, and
the verdict is whether ``|out - out_torch| <= atol + rtol * |out_torch|`` everywhere
with ``vframe.testing.attention.ATTENTION_TOLERANCES[dtype]``. ``--kv-cache-dtype fp8``
gives every backend (the reference too) a float8 cache, asked of each through
``validate_configuration(..., kv_cache_dtype=...)``: they hold the same rounded
keys and values, so the same tolerance applies.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from vframe.core.interfaces import AttentionBackend, CommonAttentionMetadata

FALLBACK_BLOCK_SIZES = (16, 32, 64, 128, 256, 512)
REFERENCE = "torch"
# flag: (default on a GPU, with --quick and on the CPU, help)
GRID_DEFAULTS: dict[str, tuple[Any, Any, str]] = {
    "decode_batch": ("1,64", "1,16", "comma-separated decode batch sizes"),
    "context": ("512,4096", "256,1024", "comma-separated cached tokens per decoding request"),
    "gqa": ("1,4", "1,4", "comma-separated num_heads / num_kv_heads ratios"),
    "prefill": ("512,2048,1024+512", "128,512,512+128",
                "comma-separated new tokens per prefilling request, C+Q for Q new on C cached ('' for none)"),
    "prefill_batch": (4, 2, "requests per prefill shape"),
    "num_heads": (32, 8, "query heads"),
    "head_size": (128, 64, "head size"),
    "warmup": (3, 1, "untimed calls per shape and backend (Triton compiles here)"),
    "iters": (20, 5, "timed calls per shape and backend; the median is reported"),
}


@dataclass(frozen=True)
class Shape:
    """``num_reqs`` requests, each ``query_len`` new tokens on ``context_len`` cached ones."""

    kind: str  # "decode" or "prefill"
    num_reqs: int
    query_len: int
    context_len: int
    num_heads: int
    num_kv_heads: int
    head_size: int

    @property
    def label(self) -> str:
        tokens = f"ctx{self.context_len}" if self.kind == "decode" else f"q{self.query_len}"
        if self.kind == "prefill" and self.context_len:
            tokens = f"{self.context_len}+{tokens}"
        return f"{self.kind} b{self.num_reqs} {tokens} gqa{self.num_heads // self.num_kv_heads}"


@dataclass
class Row:
    shape: Shape
    backend: str
    block_size: int
    time_ms: float | None = None  # median of --iters calls
    speedup: float | None = None  # torch time / this time
    max_abs_error: float | None = None  # against torch's output
    within_tolerance: bool | None = None
    failure: str | None = None  # why it did not run

    def as_dict(self) -> dict[str, Any]:
        return asdict(self.shape) | {"shape": self.shape.label} | {k: v for k, v in asdict(self).items() if k != "shape"}


def add_bench_attention_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backends", default=None,
                        help="comma-separated registry names (default: every registered backend available here); "
                        "torch always runs: it is the reference")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when visible)")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--block-size", type=int, default=16,
                        help="tokens per KV block, for each backend that accepts it; others take the first of "
                        + ", ".join(map(str, FALLBACK_BLOCK_SIZES)) + " they accept")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3", "fp8_e5m2"], default="auto",
                        help="what the cache holds: the model's dtype (auto) or float8, for every backend (the "
                        "torch reference too), keys and values at scale 1.0")
    parser.add_argument("--quick", action="store_true", help="the small grid (always the default on CPU)")
    for name, (full, quick, help_text) in GRID_DEFAULTS.items():
        parser.add_argument("--" + name.replace("_", "-"), type=type(full), default=None,
                            help=f"{help_text} (default: {full}; --quick and CPU: {quick})")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on CPU (BENCHMARK.md: 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-json", default=None, help="also write the rows to this file")


def run_bench_attention(args: argparse.Namespace) -> int:
    import torch

    from vframe.core.worker.model_runner import resolve_device

    device = resolve_device(args.device or "auto")
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    quick = args.quick or device.type == "cpu"
    grid = {name: getattr(args, name) if getattr(args, name) is not None else defaults[quick]
            for name, defaults in GRID_DEFAULTS.items()}
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    shapes = build_shapes(grid)

    kv_cache_dtype = args.kv_cache_dtype
    backends, skipped = select_backends(args.backends, args.block_size, grid["head_size"], dtype, device,
                                        kv_cache_dtype)
    for name, reasons in skipped.items():
        print(f"skipped {name}: " + "; ".join(reasons))
    if not backends:
        print("no chosen attention backend can run here")
        _write_json(args.output_json, device, dtype, grid, [], skipped, kv_cache_dtype)
        return 1
    print(f"{device.type}, {str(dtype).removeprefix('torch.')}, kv_cache_dtype {kv_cache_dtype}, "
          f"warmup {grid['warmup']}, iters {grid['iters']}; "
          + ", ".join(f"{name} block_size {bs}" for name, (_, bs) in backends.items()))
    print(f"{'shape':<30} {'backend':<12} {'block':>5} {'time ms':>10} {'vs torch':>9} {'max err':>9}  verdict")

    rows: list[Row] = []
    with torch.inference_mode():  # as the model runner calls the model
        for shape in shapes:
            rows += bench_shape(shape, backends, dtype, device, grid["warmup"], grid["iters"], args.seed,
                                kv_cache_dtype)
            for row in rows[-len(backends):]:
                print(format_row(row), flush=True)
    _write_json(args.output_json, device, dtype, grid, rows, skipped, kv_cache_dtype)
    return 0 if any(r.time_ms is not None for r in rows) else 1


def build_shapes(grid: dict[str, Any]) -> list[Shape]:
    from vframe.errors import ConfigError

    num_heads, head_size = grid["num_heads"], grid["head_size"]
    gqas = _ints(grid["gqa"], "--gqa")
    for gqa in gqas:
        if gqa < 1 or num_heads % gqa:
            raise ConfigError(f"--gqa {gqa}: num_heads {num_heads} must be a multiple of it; use a divisor of it")
    shapes = [
        Shape("decode", batch, 1, context, num_heads, num_heads // gqa, head_size)
        for batch in _ints(grid["decode_batch"], "--decode-batch")
        for context in _ints(grid["context"], "--context")
        for gqa in gqas
    ]
    for spec in (s for s in grid["prefill"].split(",") if s):
        cached, _, new = spec.rpartition("+")
        context, query_len = _ints(cached or "0", "--prefill")[0], _ints(new, "--prefill")[0]
        shapes += [Shape("prefill", grid["prefill_batch"], query_len, context, num_heads, num_heads // gqa, head_size)
                   for gqa in gqas]
    return shapes


def _ints(text: str, flag: str) -> list[int]:
    from vframe.errors import ConfigError

    try:
        values = [int(v) for v in text.split(",") if v]
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected comma-separated integers, e.g. 1,64") from None
    if not values or min(values) < 0:
        raise ConfigError(f"{flag} {text!r}: expected non-negative integers, e.g. 1,64")
    return values


def select_backends(
    names: str | None,
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> tuple[dict[str, tuple[type[AttentionBackend], int]], dict[str, list[str]]]:
    """``({name: (class, block_size)}, {name: reasons it is skipped})``, torch first."""
    from vframe.errors import PluginError
    from vframe.plugins import get_registry

    registry = get_registry("attention_backend")
    chosen = [n for n in names.split(",") if n] if names else registry.names()
    chosen = [REFERENCE] + [n for n in chosen if n != REFERENCE]
    backends: dict[str, tuple[type[AttentionBackend], int]] = {}
    skipped: dict[str, list[str]] = {}
    for name in chosen:
        try:
            cls = registry.load(name)
        except PluginError as e:
            skipped[name] = [str(e)]
            continue
        if reasons := cls.check_available():
            skipped[name] = reasons
            continue
        accepted, reasons = pick_block_size(cls, block_size, head_size, dtype, device, kv_cache_dtype)
        if accepted is None:
            skipped[name] = reasons
        else:
            backends[name] = (cls, accepted)
    if REFERENCE not in backends:  # nothing to compare with
        return {}, skipped
    if names and len(backends) == 1 and REFERENCE not in names.split(","):
        return {}, skipped  # only the reference would run: nothing chosen ran
    return backends, skipped


def pick_block_size(
    cls: type[AttentionBackend],
    block_size: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_cache_dtype: str = "auto",
) -> tuple[int | None, list[str]]:
    """``block_size`` if the backend accepts it, else the first of ``FALLBACK_BLOCK_SIZES``
    it accepts; ``None`` and every reason given for ``block_size`` when it accepts none."""
    from vframe.core.kv_cache_spec import kv_cache_dtype_option

    first_reasons: list[str] = []
    options = kv_cache_dtype_option(kv_cache_dtype)  # as the runner asks
    for candidate in (block_size, *FALLBACK_BLOCK_SIZES):
        reasons = cls.validate_configuration(
            head_size=head_size, dtype=dtype, device=device.type, block_size=candidate, **options
        )
        if not reasons:
            return candidate, []
        first_reasons = first_reasons or reasons
    return None, first_reasons


# --------------------------------------------------------------------------- #
# One shape
# --------------------------------------------------------------------------- #


def bench_shape(
    shape: Shape,
    backends: dict[str, tuple[type[AttentionBackend], int]],
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    iters: int,
    seed: int,
    kv_cache_dtype: str = "auto",
) -> list[Row]:
    """One row per backend; the first backend is the reference."""
    import torch

    from vframe.testing.attention import ATTENTION_TOLERANCES

    gen = torch.Generator(device=device).manual_seed(seed)
    num_tokens = shape.num_reqs * shape.query_len
    query = torch.randn(num_tokens, shape.num_heads, shape.head_size, generator=gen, device=device, dtype=dtype)
    key = torch.randn(num_tokens, shape.num_kv_heads, shape.head_size, generator=gen, device=device, dtype=dtype)
    value = torch.randn(num_tokens, shape.num_kv_heads, shape.head_size, generator=gen, device=device, dtype=dtype)

    rows: list[Row] = []
    reference: torch.Tensor | None = None  # [T, H, D]
    for name, (cls, block_size) in backends.items():
        row = Row(shape, name, block_size)
        rows.append(row)
        try:
            out, times = _run_backend(
                cls, shape, block_size, query, key, value, dtype, device, warmup, iters, seed, kv_cache_dtype
            )
        except Exception as e:  # noqa: BLE001 (one backend's failure, OOM included, is that row's result)
            row.failure = f"{type(e).__name__}: {e}"
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        row.time_ms = statistics.median(times)
        if name == REFERENCE:
            reference = out
        if reference is None:  # the reference failed on this shape: nothing to compare with
            continue
        err = (out.float() - reference.float()).abs()
        atol, rtol = ATTENTION_TOLERANCES.get(dtype, (0.0, 0.0))
        row.max_abs_error = err.max().item()
        row.within_tolerance = bool((err <= atol + rtol * reference.float().abs()).all())
        if rows[0].time_ms is not None:
            row.speedup = rows[0].time_ms / row.time_ms
        del out
    return rows


def _run_backend(
    cls: type[AttentionBackend],
    shape: Shape,
    block_size: int,
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, KVH, D]
    value: torch.Tensor,  # [T, KVH, D]
    dtype: torch.dtype,
    device: torch.device,
    warmup: int,
    iters: int,
    seed: int,
    kv_cache_dtype: str = "auto",
) -> tuple[torch.Tensor, list[float]]:  # the step's output [T, H, D], milliseconds per timed call
    import torch

    from vframe.core.config import EngineConfig
    from vframe.core.kv_cache_spec import kv_cache_torch_dtype

    seq_len = shape.context_len + shape.query_len
    blocks_per_req = -(-seq_len // block_size)
    num_blocks = shape.num_reqs * blocks_per_req
    gen = torch.Generator().manual_seed(seed)
    block_table = torch.randperm(num_blocks, generator=gen).view(shape.num_reqs, blocks_per_req).to(device)
    kv_cache = torch.zeros(
        cls.get_kv_cache_shape(num_blocks, block_size, shape.num_kv_heads, shape.head_size),
        dtype=kv_cache_torch_dtype(kv_cache_dtype, dtype),
        device=device,
    )
    config = EngineConfig.from_sources(
        env={}, block_size=block_size, dtype=str(dtype).removeprefix("torch."), device=device.type,
        attention_backend=cls.name, kv_cache_dtype=kv_cache_dtype,
    )
    builder = cls.get_metadata_builder_cls()(config, device)
    impl = cls.get_impl_cls()(shape.num_heads, shape.head_size, shape.head_size**-0.5, shape.num_kv_heads)

    # The cached context: request b's keys and values from a generator seeded by b, the
    # same for every backend, written by a prefill of that request alone.
    for b in range(shape.num_reqs if shape.context_len else 0):
        ctx_gen = torch.Generator(device=device).manual_seed(seed + 1 + b)
        ctx_kv = torch.randn(2, shape.context_len, shape.num_kv_heads, shape.head_size,
                             generator=ctx_gen, device=device, dtype=dtype)
        ctx_query = torch.zeros(shape.context_len, shape.num_heads, shape.head_size, device=device, dtype=dtype)
        meta = builder.build(step_metadata(block_table[b : b + 1], 0, shape.context_len, block_size))
        impl.forward(ctx_query, ctx_kv[0], ctx_kv[1], kv_cache, meta)

    meta = builder.build(step_metadata(block_table, shape.context_len, shape.query_len, block_size))
    out = impl.forward(query, key, value, kv_cache, meta)  # the first call is also a warm-up
    for _ in range(warmup - 1):
        impl.forward(query, key, value, kv_cache, meta)
    times = _time_calls(lambda: impl.forward(query, key, value, kv_cache, meta), iters, device)
    return out, times


def step_metadata(
    block_table: torch.Tensor,  # [B, blocks_per_req] int64, on the device
    context_len: int,
    query_len: int,
    block_size: int,
) -> CommonAttentionMetadata:
    """Every request of ``block_table`` runs ``query_len`` new tokens on ``context_len`` cached ones."""
    import torch

    from vframe.core.interfaces import CommonAttentionMetadata

    num_reqs, device = block_table.shape[0], block_table.device
    seq_len = context_len + query_len
    used = block_table[:, : -(-seq_len // block_size)]  # never hand out more than the request holds
    positions = torch.arange(context_len, seq_len, device=device)  # [Q]
    slot_mapping = used[:, positions // block_size] * block_size + positions % block_size  # [B, Q]
    query_start_loc = [b * query_len for b in range(num_reqs + 1)]
    return CommonAttentionMetadata(
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        seq_lens=torch.full((num_reqs,), seq_len, dtype=torch.int32, device=device),
        context_lens=torch.full((num_reqs,), context_len, dtype=torch.int32, device=device),
        block_table=used.to(torch.int32).contiguous(),
        slot_mapping=slot_mapping.flatten().to(torch.int64),  # [T]
        num_reqs=num_reqs,
        num_actual_tokens=num_reqs * query_len,
        max_query_len=query_len,
        max_seq_len=seq_len,
        block_size=block_size,
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=[seq_len] * num_reqs,
    )


def _time_calls(call: Any, iters: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``iters`` calls: CUDA events on a GPU, the wall clock elsewhere."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for start, end in events:
            start.record()
            call()
            end.record()
        torch.cuda.synchronize(device)
        return [start.elapsed_time(end) for start, end in events]
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# --------------------------------------------------------------------------- #
# Output
# --------------------------------------------------------------------------- #


def format_row(row: Row) -> str:
    head = f"{row.shape.label:<30} {row.backend:<12} {row.block_size:>5}"
    if row.failure is not None:
        return f"{head}  failed: {row.failure}"
    if row.max_abs_error is None:
        return f"{head} {row.time_ms:>10.3f} {'-':>9} {'-':>9}  no reference: torch failed on this shape"
    speedup = "-" if row.speedup is None else f"{row.speedup:.2f}x" if row.speedup >= 0.1 else f"{row.speedup:.2g}x"
    verdict = "ok" if row.within_tolerance else "FAIL (over tolerance)"
    return f"{head} {row.time_ms:>10.3f} {speedup:>9} {row.max_abs_error:>9.2e}  {verdict}"


def _write_json(
    path: str | None,
    device: torch.device,
    dtype: torch.dtype,
    grid: dict[str, Any],
    rows: list[Row],
    skipped: dict[str, list[str]],
    kv_cache_dtype: str = "auto",
) -> None:
    if not path:
        return
    from vframe.testing.attention import ATTENTION_TOLERANCES

    summary = {
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "kv_cache_dtype": kv_cache_dtype,
        "tolerance": ATTENTION_TOLERANCES.get(dtype),
        "grid": grid,
        "rows": [r.as_dict() for r in rows],
        "skipped": [{"backend": name, "reasons": reasons} for name, reasons in skipped.items()],
    }
    with open(path, "w") as f:
        json.dump(summary, f, indent=2)
