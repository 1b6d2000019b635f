"""``vframe serve`` refuses what it cannot do before loading a model, without a traceback."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path


def serve(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vframe.entrypoints.cli", "serve", *args],
        capture_output=True, text=True, timeout=120, cwd=cwd,
    )


def test_a_taken_port_is_a_clear_error(tmp_path: Path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = serve("--port", str(port), cwd=tmp_path)
    assert proc.returncode == 2
    assert f"vframe: error: cannot listen on 127.0.0.1:{port}" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_bad_settings_are_clear_errors(tmp_path: Path):
    proc = serve("--skip-tokenizer-init", cwd=tmp_path)
    assert proc.returncode == 2
    assert "vframe: error: vframe serve needs the tokenizer" in proc.stderr
    proc = serve("--max-num-seqs", "0", cwd=tmp_path)
    assert proc.returncode == 2
    assert "vframe: error: invalid value for 'max_num_seqs': '0'" in proc.stderr
    proc = serve("a.gguf", "--model", "b.gguf", cwd=tmp_path)
    assert proc.returncode == 2
    assert "vframe: error: the model is given twice: 'a.gguf' and --model 'b.gguf'" in proc.stderr
