"""``vframe bench latency`` and the ``--backend`` list with vLLM as a peer (vLLM itself only
in the slow test, with ``VFRAME_PEER_PYTHON`` naming a Python that has it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from vframe.bench.latency import Timing
from vframe.bench.peers import PeerError, peer_env
from vframe.entrypoints.cli import main

PEER_PYTHON = os.environ.get("VFRAME_PEER_PYTHON")


def _bench(argv: list[str], tmp_path: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess, list]:
    out_json = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vframe.entrypoints.cli", "bench", *argv, "--output-json", str(out_json)],
        capture_output=True, text=True, timeout=timeout, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return proc, json.loads(out_json.read_text())


def test_bench_latency_reports_ttft_and_tpot_of_each_run(tmp_path: Path) -> None:
    proc, results = _bench(["latency", "--input-len", "20", "--output-len", "5", "--num-iters", "2"], tmp_path)

    [r] = results
    assert (r["backend"], r["prompt_tokens"], r["output_tokens"]) == ("vframe", 20, 5)
    assert r["dtype"] in ("bfloat16", "float32")
    assert [run["output_tokens"] for run in r["runs"]] == [5, 5]
    assert all(run["ttft_ms"] > 0 and run["tpot_ms"] > 0 for run in r["runs"])
    assert r["ttft_ms"] == min(run["ttft_ms"] for run in r["runs"])
    assert r["tpot_ms"] == min(run["tpot_ms"] for run in r["runs"])
    assert r["startup_s"] > 0
    assert "vframe [" in proc.stdout and "20 prompt + 5 output tokens" in proc.stdout
    assert "best of 2" in proc.stdout


def test_timing_from_token_times() -> None:
    t = Timing.from_token_times([0.05, 0.08, 0.11, 0.17])
    assert t.output_tokens == 4
    assert t.ttft_ms == pytest.approx(50.0)
    assert t.tpot_ms == pytest.approx(40.0)  # (170 - 50) / 3


@pytest.mark.parametrize("workload", ["throughput", "latency"])
def test_backend_vllm_without_peer_python_is_refused(workload: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", workload, "--backend", "vframe,vllm"]) == 2
    err = capsys.readouterr().err
    assert "--backend vllm needs --peer-python PATH" in err
    assert "docs/benchmarks.md" in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="this Python has vLLM")
@pytest.mark.parametrize("workload", ["throughput", "latency"])
def test_peer_python_without_vllm_is_refused(workload: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", workload, "--backend", "vllm", "--peer-python", sys.executable]) == 2
    err = capsys.readouterr().err
    assert f"--peer-python {sys.executable!r}: `import vllm` fails there" in err
    assert "No module named 'vllm'" in err


def test_peer_python_that_is_not_a_file_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "venv" / "bin" / "python")
    assert main(["bench", "latency", "--backend", "vllm", "--peer-python", missing]) == 2
    assert f"--peer-python {missing!r}: no executable file there" in capsys.readouterr().err


@pytest.mark.parametrize("value", ["vframe,llamacpp", "vframe,vframe", ""])
def test_unknown_backend_lists_the_choices(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "latency", "--backend", value])
    assert exc.value.code == 2
    assert "comma-separated list of distinct names from vframe, hf, vllm" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not PEER_PYTHON, reason="VFRAME_PEER_PYTHON names no Python with vLLM")
def test_vllm_peer_runs_the_same_workloads(tmp_path: Path) -> None:
    proc, results = _bench(
        ["throughput", "--backend", "vframe,vllm", "--peer-python", PEER_PYTHON, "--num-prompts", "3",
         "--min-input-len", "16", "--max-input-len", "40", "--output-len", "6"], tmp_path, timeout=900,
    )
    assert [r["backend"] for r in results] == ["vframe", "vllm"]
    assert {(r["num_requests"], r["prompt_tokens"], r["output_tokens"]) for r in results} == {
        (3, results[0]["prompt_tokens"], 18)
    }
    assert proc.stdout.strip().splitlines()[-1].startswith("vframe / vllm output tokens/s: ")

    proc, results = _bench(
        ["latency", "--backend", "vframe,vllm", "--peer-python", PEER_PYTHON, "--input-len", "24",
         "--output-len", "5", "--num-iters", "2"], tmp_path, timeout=900,
    )
    assert [(r["backend"], r["prompt_tokens"], r["output_tokens"]) for r in results] == [
        ("vframe", 24, 5), ("vllm", 24, 5)
    ]
    assert all(run["ttft_ms"] > 0 and run["tpot_ms"] > 0 for r in results for run in r["runs"])
    assert proc.stdout.strip().splitlines()[-1].startswith("vframe / vllm time: TTFT ")


def test_peer_env_gives_vllm_the_benchmark_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_CPU_NUM_OF_RESERVED_CPU"):
        monkeypatch.delenv(name, raising=False)
    env = peer_env(2)
    assert (env["VLLM_CPU_OMP_THREADS_BIND"], env["VLLM_CPU_NUM_OF_RESERVED_CPU"]) == ("0-1", "0")
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "4"
    assert peer_env(1)["VLLM_CPU_OMP_THREADS_BIND"] == "0"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert peer_env(2)["VLLM_CPU_OMP_THREADS_BIND"] == "1"  # the user's setting wins
    assert peer_env(2, ld_preload=sys.executable)["LD_PRELOAD"] == sys.executable


def test_peer_ld_preload_of_a_missing_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PeerError, match=r"--peer-ld-preload .*: no such file '.*libiomp5.so'"):
        peer_env(2, ld_preload=f"{sys.executable}:{tmp_path}/libiomp5.so")


def test_bench_throughput_reports_the_best_of_its_runs(tmp_path: Path) -> None:
    proc, results = _bench(["throughput", "--num-prompts", "3", "--min-input-len", "8", "--max-input-len", "20",
                            "--output-len", "4", "--num-iters", "2"], tmp_path)
    [r] = results
    assert (r["backend"], r["num_requests"], r["output_tokens"]) == ("vframe", 3, 12)
    assert len(r["walls_s"]) == 2 and r["wall_s"] == min(r["walls_s"]) > 0
    assert r["output_tps"] == pytest.approx(12 / r["wall_s"])
    assert "(best of 2; each run's s: " in proc.stdout


@pytest.mark.parametrize("value", ["0", "-1"])
def test_bench_throughput_refuses_fewer_than_one_run(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "throughput", "--num-iters", value])
    assert exc.value.code == 2
    assert f"--num-iters: {value} must be at least 1" in capsys.readouterr().err
