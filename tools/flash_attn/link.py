"""On the GPU machine: build flash-attn's Python module from ``build_objects.sh``'s archive.

    python3 tools/flash_attn/link.py fa.tar.xz DIR

compiles ``flash_api.cpp`` against this machine's torch and Python, links it with the
carried CUDA objects (about 20 s), checks a causal attention against PyTorch's, and prints
the ``PYTHONPATH`` entries that make ``import flash_attn`` work.
"""

from __future__ import annotations

import sys
import tarfile
import time
from pathlib import Path


def main(archive: str, out: str) -> None:
    import torch
    from torch.utils.cpp_extension import load

    root = Path(out).resolve()
    (root / "build").mkdir(parents=True, exist_ok=True)
    with tarfile.open(archive) as tar:
        tar.extractall(root, filter="data")
    src = root / "src"
    start = time.time()
    load(
        name="flash_attn_2_cuda",
        sources=[str(src / "csrc/flash_attn/flash_api.cpp")],
        extra_include_paths=[str(src / p) for p in ("csrc/flash_attn", "csrc/flash_attn/src", "csrc/cutlass/include")],
        extra_cflags=["-O3", "-std=c++17"]
        + [f"-DFLASHATTENTION_DISABLE_{x}" for x in ("BACKWARD", "DROPOUT", "ALIBI", "SOFTCAP")],
        extra_ldflags=sorted(str(p) for p in (root / "obj").glob("*.o")),
        with_cuda=True,
        build_directory=str(root / "build"),
    )
    print(f"flash_attn_2_cuda built in {time.time() - start:.1f} s")
    sys.path[:0] = [str(root / "build"), str(src)]
    from flash_attn import flash_attn_func

    q, k, v = (torch.randn(2, 300, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    got = flash_attn_func(q, k, v, causal=True).float()
    want = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2).float() for t in (q, k, v)), is_causal=True
    ).transpose(1, 2)
    err = (got - want).abs().max().item()
    print(f"causal attention, bfloat16: max |flash_attn - torch| = {err:.2e}")
    if err > 3e-2:
        raise SystemExit("flash_attn disagrees with PyTorch")
    print(f"PYTHONPATH={root / 'build'}:{src}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
