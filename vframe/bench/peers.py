"""The engines a ``vframe bench`` workload runs on (``--backend``), and vLLM as a peer.

``--backend`` takes a comma-separated list of ``vframe``, ``hf`` (transformers, in this
process) and ``vllm`` (vLLM, in another Python: ``--peer-python``), run in that order;
``both`` means ``vframe,hf``. vframe's ratio to each peer is printed last.

vLLM is never a dependency of vframe. ``--peer-python`` names a Python that has it (for
example a virtual environment made with docs/benchmarks.md's recipe); vframe hands it
the Hugging Face directory of the model (a GGUF's conversion, the one vframe loads), the
workload's prompt token ids and output length in a JSON file, and runs
``vframe/bench/vllm_peer.py`` there, by path, which writes its result to another.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from vframe.errors import VFrameError

BACKENDS = ("vframe", "hf", "vllm")
PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")
_LOG_TAIL_LINES = 40
R = TypeVar("R")  # a workload's result


class PeerError(VFrameError):
    """A peer engine that cannot be run: no ``--peer-python``, or vLLM missing or failing there."""


def parse_backends(value: str) -> list[str]:
    """``--backend``'s value as the list of engines to run, in order."""
    names = ["vframe", "hf"] if value == "both" else [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in BACKENDS]
    if unknown or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected a comma-separated list of distinct names from {', '.join(BACKENDS)} "
            "(e.g. vframe,vllm), or 'both' for vframe,hf"
        )
    return names


def add_backend_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", type=parse_backends, default=["vframe"],
        help="engines to run, comma-separated, in order: vframe, hf (transformers), vllm (needs --peer-python); "
        "'both' = vframe,hf; vframe's ratio to each peer is printed last",
    )
    parser.add_argument(
        "--peer-python", default=None, metavar="PATH",
        help="a Python with vLLM installed, for --backend vllm (e.g. /work/vllm-venv/bin/python; "
        "docs/benchmarks.md says how to make one)",
    )
    parser.add_argument(
        "--peer-ld-preload", default=None, metavar="PATHS",
        help="LD_PRELOAD for vLLM alone, as its CPU docs advise, e.g. "
        "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4:/work/vllm-venv/lib/libiomp5.so",
    )


def check_peer_python(peer_python: str | None) -> str:
    """The path of a Python that imports vLLM; raises ``PeerError`` saying what is wrong."""
    if not peer_python:
        raise PeerError(
            "--backend vllm needs --peer-python PATH: a Python with vLLM installed (vLLM is not a "
            "dependency of vframe; docs/benchmarks.md, 'vLLM CPU as a peer', says how to make one)"
        )
    path = Path(peer_python).expanduser()
    if not (path.is_file() and os.access(path, os.X_OK)):
        raise PeerError(f"--peer-python {peer_python!r}: no executable file there; pass the python of a vLLM venv")
    proc = subprocess.run(
        [str(path), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True, timeout=300
    )
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["(no error output)"])[-1]
        raise PeerError(
            f"--peer-python {peer_python!r}: `import vllm` fails there ({last}); pass a Python with vLLM "
            "installed (docs/benchmarks.md, 'vLLM CPU as a peer')"
        )
    return str(path)


def check_peer(args: argparse.Namespace) -> str:
    """``check_peer_python`` and ``--peer-ld-preload``'s files, before any engine runs."""
    peer_env(args.threads, args.peer_ld_preload)
    return check_peer_python(args.peer_python)


def peer_device_dtype(engine_kwargs: dict[str, Any]) -> tuple[str, str]:
    """The device and dtype a peer runs in: those vframe runs in (``--device``, ``--dtype``,
    else its defaults)."""
    import torch

    from vframe.core.worker.model_runner import default_dtype_name

    device = engine_kwargs.get("device") or "auto"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return device, engine_kwargs.get("dtype") or default_dtype_name(device)


def run_backends(
    args: argparse.Namespace,
    engine_kwargs: dict[str, Any],
    run_vframe: Callable[[argparse.Namespace, dict[str, Any]], R],
    run_hf: Callable[[argparse.Namespace, str, str], R],
    run_vllm: Callable[[argparse.Namespace, str, str], R],
    print_result: Callable[[R], None],
) -> list[R]:
    """Run the workload on each ``--backend`` in order with its runner, printing each
    result as it comes; the peers run in vframe's device and dtype."""
    # Checked first: a missing vLLM is found before minutes of the other engines.
    peer_python = check_peer(args) if "vllm" in args.backend else ""
    device, dtype = peer_device_dtype(engine_kwargs)
    results: list[R] = []
    for backend in args.backend:
        if backend == "vframe":
            results.append(run_vframe(args, dict(engine_kwargs)))
        elif backend == "hf":
            results.append(run_hf(args, dtype, device))
        else:
            results.append(run_vllm(args, peer_python, dtype))
        print_result(results[-1])
    return results


def peer_env(threads: int, ld_preload: str | None = None) -> dict[str, str]:
    """vLLM CPU on ``threads`` cores, none reserved for its front end (BENCHMARK.md); a
    variable already set in the environment wins. ``ld_preload``: its LD_PRELOAD."""
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    }
    env = defaults | dict(os.environ)
    if ld_preload:
        missing = [p for p in ld_preload.split(":") if p and not Path(p).is_file()]
        if missing:
            raise PeerError(f"--peer-ld-preload {ld_preload!r}: no such file {missing[0]!r}")
        env["LD_PRELOAD"] = ld_preload
    return env


def run_vllm_peer(
    peer_python: str, model: str | None, workload: str, prompts: list[list[int]], warmup_prompt: list[int],
    output_len: int, dtype: str, threads: int, num_iters: int = 1, ld_preload: str | None = None,
) -> dict[str, Any]:
    """Run ``workload`` ("throughput" or "latency") on vLLM in ``peer_python``; its result dict
    (see vllm_peer.py). vLLM's log goes to ``$TMPDIR/vframe-bench-vllm.log`` (replaced by the
    next run), whose tail is in the error if it fails."""
    from vframe.models.loader import resolve_model

    env = peer_env(threads, ld_preload)
    spec = {
        "workload": workload,
        "model_dir": str(resolve_model(model).model_dir),  # a GGUF's conversion is the HF directory vLLM needs
        "dtype": dtype,
        "prompts": prompts,
        "warmup_prompt": warmup_prompt,
        "output_len": output_len,
        "num_iters": num_iters,
        "max_model_len": max(2048, max(map(len, prompts)) + output_len),
    }
    with tempfile.TemporaryDirectory(prefix="vframe-bench-vllm-") as tmp:
        spec_path, result_path = Path(tmp) / "spec.json", Path(tmp) / "result.json"
        log_path = Path(tempfile.gettempdir()) / "vframe-bench-vllm.log"
        spec_path.write_text(json.dumps(spec))
        print(f"   vllm: starting vLLM in {peer_python}, about a minute; its log: {log_path}", flush=True)
        with open(log_path, "w") as log:
            proc = subprocess.run(
                [peer_python, str(PEER_SCRIPT), str(spec_path), str(result_path)],
                stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp,
            )
        if proc.returncode != 0 or not result_path.exists():
            tail = "\n".join(log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:])
            raise PeerError(f"vLLM ({peer_python}) failed with exit status {proc.returncode}; its log ends:\n{tail}")
        result = json.loads(result_path.read_text())
    settings = " ".join(f"{k}={env[k]}" for k in sorted(env) if k.startswith("VLLM_CPU_") or k == "LD_PRELOAD")
    print(f"   vllm: vLLM {result['vllm_version']}, {settings}", flush=True)
    return result
