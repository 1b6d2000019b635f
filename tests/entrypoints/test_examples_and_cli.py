"""The example program and the CLI, run as real processes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VFRAME = str(Path(sys.executable).parent / "vframe")


def run(args, cwd, env_extra=None, timeout=300):
    env = dict(os.environ, **(env_extra or {}))
    return subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # a profiled generation: about 13 s
def test_vllm_profiling_example_runs_and_writes_a_trace(tmp_path):
    proc = run([sys.executable, str(ROOT / "examples" / "offline_profile.py")], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("Generated text: ") == 4
    assert "Prompt: 'The capital of France is'" in proc.stdout
    traces = list((tmp_path / "vframe_profile").glob("vframe_trace_*.json"))
    assert len(traces) == 1
    trace = json.loads(traces[0].read_text())
    # the model's matrix products: aten::mm, or oneDNN's packed linear for bfloat16 on the CPU
    matmuls = ("aten::mm", "mkldnn::_linear_pointwise")
    assert any(m in e.get("name", "") for e in trace["traceEvents"] for m in matmuls)


def test_cli_generate_chat_answer(tmp_path):
    proc = run(
        [VFRAME, "generate", "--message", "What is the capital of France?", "--temperature", "0",
         "--max-tokens", "32", "--json", "--dtype", "float32"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    [out] = json.loads(proc.stdout)
    assert "Paris" in out["outputs"][0]["text"]
    assert out["outputs"][0]["finish_reason"] == "stop"


def test_cli_reports_bad_settings_without_a_traceback(tmp_path):
    proc = run([VFRAME, "generate", "--prompt", "hi", "--max-num-seqs", "0"], cwd=tmp_path)
    assert proc.returncode == 2
    assert "vframe: error: invalid value for 'max_num_seqs': '0'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_plugins_lists_builtins_and_usability(tmp_path):
    proc = run([VFRAME, "plugins"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "attention_backend  torch" in proc.stdout
    assert "vframe.core.sched.scheduler:DefaultScheduler" in proc.stdout


def test_cli_help_explains_each_command(tmp_path):
    proc = run([VFRAME, "--help"], cwd=tmp_path)
    for command in ("generate", "plugins", "bench"):
        assert command in proc.stdout
