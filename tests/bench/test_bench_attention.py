"""``vframe bench attention``: rows for every shape and backend, errors against torch, skipped backends."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from vframe.backends.torch_attn import TorchAttentionBackend, TorchAttentionImpl
from vframe.core.interfaces import AttentionImpl
from vframe.entrypoints.cli import main
from vframe.plugins import hookimpl, register_plugin, unregister_plugin

TINY = ["bench", "attention", "--device", "cpu", "--decode-batch", "1,3", "--context", "5,40", "--gqa", "1,2",
        "--prefill", "17,20+9", "--prefill-batch", "2", "--num-heads", "4", "--head-size", "16",
        "--warmup", "1", "--iters", "2"]


class ScaledImpl(TorchAttentionImpl):
    """Right everywhere but for a factor: what a wrong softmax scale in a kernel looks like."""

    def forward(self, query, key, value, kv_cache, attn_metadata) -> torch.Tensor:
        return 1.5 * super().forward(query, key, value, kv_cache, attn_metadata)


class ScaledBackend(TorchAttentionBackend):
    name = "scaled_attn"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return ScaledImpl

    @classmethod
    def validate_configuration(cls, *, block_size: int, **kwargs: Any) -> list[str]:
        return [] if block_size % 32 == 0 else [f"block_size {block_size}: use a multiple of 32"]


class AbsentBackend(TorchAttentionBackend):
    name = "absent_attn"

    @classmethod
    def check_available(cls) -> list[str]:
        return ["the absent package is not installed"]


class RaisingImpl(TorchAttentionImpl):
    def forward(self, query, key, value, kv_cache, attn_metadata) -> torch.Tensor:
        raise RuntimeError("kernel launch failed")


class RaisingBackend(TorchAttentionBackend):
    name = "raising_attn"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return RaisingImpl


class TestPlugin:
    @hookimpl
    def vframe_register_attention_backends(self, register):
        register("scaled_attn", ScaledBackend)
        register("absent_attn", AbsentBackend)
        register("raising_attn", RaisingBackend)


@pytest.fixture
def test_backends() -> Iterator[None]:
    register_plugin(TestPlugin(), "bench-attention-test")
    yield
    unregister_plugin("bench-attention-test")


def _run(argv: list[str], tmp_path: Path) -> tuple[int, dict[str, Any]]:
    out_json = tmp_path / "attention.json"
    code = main(TINY + argv + ["--output-json", str(out_json)])
    return code, json.loads(out_json.read_text())


def test_torch_rows_cover_every_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = _run(["--backends", "torch"], tmp_path)
    assert code == 0
    assert (summary["device"], summary["dtype"], summary["tolerance"]) == ("cpu", "float32", [1e-5, 1e-5])
    shapes = [(r["kind"], r["num_reqs"], r["context_len"], r["query_len"], r["num_kv_heads"]) for r in summary["rows"]]
    assert shapes == [
        ("decode", 1, 5, 1, 4), ("decode", 1, 5, 1, 2), ("decode", 1, 40, 1, 4), ("decode", 1, 40, 1, 2),
        ("decode", 3, 5, 1, 4), ("decode", 3, 5, 1, 2), ("decode", 3, 40, 1, 4), ("decode", 3, 40, 1, 2),
        ("prefill", 2, 0, 17, 4), ("prefill", 2, 0, 17, 2), ("prefill", 2, 20, 9, 4), ("prefill", 2, 20, 9, 2),
    ]
    for row in summary["rows"]:
        assert (row["backend"], row["block_size"], row["num_heads"], row["head_size"]) == ("torch", 16, 4, 16)
        assert row["time_ms"] > 0 and row["speedup"] == 1.0
        assert (row["max_abs_error"], row["within_tolerance"], row["failure"]) == (0.0, True, None)
    assert summary["rows"][-1]["shape"] == "prefill b2 20+q9 gqa2"
    lines = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert lines[1] == ["shape", "backend", "block", "time", "ms", "vs", "torch", "max", "err", "verdict"]
    assert [line[:5] + line[7:] for line in lines[2:]][7] == ["decode", "b3", "ctx40", "gqa2", "torch", "1.00x",
                                                             "0.00e+00", "ok"]


def test_a_wrong_backend_shows_a_large_error(
    test_backends: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, summary = _run(["--backends", "torch,scaled_attn", "--decode-batch", "2", "--context", "40", "--gqa", "2",
                          "--prefill", "20+9"], tmp_path)
    assert code == 0
    rows = {(r["shape"], r["backend"]): r for r in summary["rows"]}
    assert sorted(rows) == [
        ("decode b2 ctx40 gqa2", "scaled_attn"), ("decode b2 ctx40 gqa2", "torch"),
        ("prefill b2 20+q9 gqa2", "scaled_attn"), ("prefill b2 20+q9 gqa2", "torch"),
    ]
    for shape in ("decode b2 ctx40 gqa2", "prefill b2 20+q9 gqa2"):
        torch_row, scaled = rows[shape, "torch"], rows[shape, "scaled_attn"]
        assert (torch_row["block_size"], torch_row["max_abs_error"], torch_row["within_tolerance"]) == (16, 0.0, True)
        # 16 refused: the first accepted of 16, 32, ...; a block table of its own, the same logical data
        assert scaled["block_size"] == 32
        assert scaled["max_abs_error"] > 0.05 and scaled["within_tolerance"] is False
    out = capsys.readouterr().out
    assert "torch block_size 16, scaled_attn block_size 32" in out
    assert "FAIL (over tolerance)" in out


def test_an_unavailable_backend_is_reported_and_skipped(
    test_backends: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, summary = _run(["--backends", "torch,absent_attn,no_such_attn", "--decode-batch", "1", "--context", "5",
                          "--gqa", "1", "--prefill", ""], tmp_path)
    assert code == 0
    assert [(r["shape"], r["backend"]) for r in summary["rows"]] == [("decode b1 ctx5 gqa1", "torch")]
    skipped = {s["backend"]: s["reasons"] for s in summary["skipped"]}
    assert skipped["absent_attn"] == ["the absent package is not installed"]
    assert skipped["no_such_attn"][0].startswith("unknown attention backend 'no_such_attn'")
    out = capsys.readouterr().out
    assert "skipped absent_attn: the absent package is not installed" in out


def test_a_backend_that_raises_is_a_failed_row(
    test_backends: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, summary = _run(["--backends", "raising_attn", "--decode-batch", "1", "--context", "5", "--gqa", "1",
                          "--prefill", ""], tmp_path)
    assert code == 0  # torch ran
    torch_row, raising = summary["rows"]
    assert (torch_row["backend"], torch_row["failure"]) == ("torch", None)
    assert (raising["backend"], raising["time_ms"], raising["max_abs_error"]) == ("raising_attn", None, None)
    assert raising["failure"] == "RuntimeError: kernel launch failed"
    assert "failed: RuntimeError: kernel launch failed" in capsys.readouterr().out


def test_nothing_chosen_can_run(test_backends: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, summary = _run(["--backends", "absent_attn"], tmp_path)
    assert code == 1
    assert summary["rows"] == []
    assert "no chosen attention backend can run here" in capsys.readouterr().out


def test_a_float8_cache_for_every_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    seen: set[torch.dtype] = set()
    forward = TorchAttentionImpl.forward

    def recording(self, query, key, value, kv_cache, attn_metadata) -> torch.Tensor:  # noqa: ANN001
        seen.add(kv_cache.dtype)
        return forward(self, query, key, value, kv_cache, attn_metadata)

    monkeypatch.setattr(TorchAttentionImpl, "forward", recording)
    code, summary = _run(["--backends", "torch,cpu_paged,flex", "--kv-cache-dtype", "fp8", "--head-size", "64",
                          "--decode-batch", "3", "--context", "40", "--gqa", "2", "--prefill", "20+9"], tmp_path)
    assert code == 0
    assert summary["kv_cache_dtype"] == "fp8"
    assert seen == {torch.float8_e4m3fn}  # what the torch reference was given
    rows = {(r["shape"], r["backend"]): r for r in summary["rows"]}
    assert sorted(rows) == [("decode b3 ctx40 gqa2", "cpu_paged"), ("decode b3 ctx40 gqa2", "torch"),
                            ("prefill b2 20+q9 gqa2", "cpu_paged"), ("prefill b2 20+q9 gqa2", "torch")]
    assert all(r["within_tolerance"] for r in rows.values())  # the same rounded keys and values on both
    assert summary["skipped"] == [{"backend": "flex", "reasons": [
        "the flex backend has no FP8 KV cache (kv_cache_dtype='fp8'); use kv_cache_dtype='auto', or "
        "attention_backend='triton' (NVIDIA GPUs) or 'torch', which serve it"]}]
    assert "cpu, float32, kv_cache_dtype fp8," in capsys.readouterr().out
