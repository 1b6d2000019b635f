"""``vframe bench lora`` runs end to end (on a tiny slice of the workload) and writes its results."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from vframe.bench.lora import write_random_adapter


@pytest.mark.slow  # about 12 s
def test_bench_lora_times_base_lora_enabled_and_adapters(tmp_path: Path) -> None:
    out_json = tmp_path / "lora.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vframe.entrypoints.cli", "bench", "lora", "--num-prompts", "4", "--output-len", "4",
         "--min-input-len", "16", "--max-input-len", "48", "--num-adapters", "2", "--rank", "4",
         "--targets", "q_proj,v_proj,down_proj", "--output-json", str(out_json)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "loss 1 - lora / base" in proc.stdout
    summary = json.loads(out_json.read_text())
    assert [r["backend"] for r in summary["results"]] == ["base", "lora-base", "lora-2x4"]
    for r in summary["results"]:
        assert (r["num_requests"], r["output_tokens"]) == (4, 16)
        assert r["wall_s"] > 0 and r["output_tps"] > 0 and r["total_tps"] > 0
    assert (summary["num_adapters"], summary["rank"]) == (2, 4)
    assert summary["targets"] == ["down_proj", "q_proj", "v_proj"]
    base, _, lora = (r["output_tps"] for r in summary["results"])
    assert summary["loss"] == 1 - lora / base
    assert "enable_lora_loss" in summary


def test_random_adapter_is_a_peft_directory(tmp_path: Path) -> None:
    shapes = {"model.layers.0.self_attn.q_proj": ([8, 64], [64, 8]), "model.layers.0.mlp.down_proj": ([8, 96], [64, 8])}
    path = write_random_adapter(tmp_path / "a", shapes, 8, seed=1)

    config = json.loads((path / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"], config["bias"]) == ("LORA", 8, 16, "none")
    assert config["target_modules"] == ["down_proj", "q_proj"]
    with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == [
            "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight",
            "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight",
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight",
        ]
        assert list(f.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_A.weight").shape) == [8, 96]
        assert list(f.get_tensor("base_model.model.model.layers.0.mlp.down_proj.lora_B.weight").shape) == [64, 8]
