"""``vframe bench serve`` runs end to end (on a tiny slice of the workload)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from openai_server import server_env


def test_bench_serve_starts_a_server_measures_each_level_and_stops_it(tmp_path: Path):
    out_json = tmp_path / "serve.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vframe.entrypoints.cli", "bench", "serve", "--num-prompts", "3",
         "--output-len", "4", "--max-input-len", "48", "--concurrency", "1,3", "--dtype", "float32",
         "--output-json", str(out_json)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=server_env(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "concurrency   1: 3 requests" in proc.stdout
    assert "concurrency   3: 3 requests" in proc.stdout
    levels = json.loads(out_json.read_text())
    assert [(r["concurrency"], r["num_requests"], r["num_failed"], r["output_tokens"]) for r in levels] == [
        (1, 3, 0, 12),
        (3, 3, 0, 12),
    ]
    for r in levels:
        assert 0 < r["ttft_ms"]["p50"] <= r["ttft_ms"]["p99"]
        assert r["tpot_ms"]["mean"] > 0 and r["itl_ms"]["mean"] > 0
        assert r["output_tps"] > 0
