"""The C allocator's thresholds (vframe/utils/cpu_memory.py): a forward's large blocks reuse
the process's pages instead of faulting fresh ones in, and the setting can be turned off."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")

# The allocations of a 4,096-token prefill layer of SmolLM2 in bfloat16 (hidden 576, q/k/v 960,
# gate/up 3,072), freed in the order a forward frees them; the page faults of 30 such layers.
SCRIPT = """
import resource, sys, torch
from vframe.utils.cpu_memory import tune_allocator
print(tune_allocator())
def layer():
    x = torch.empty(4096, 576, dtype=torch.bfloat16).fill_(1)
    qkv = torch.empty(4096, 960, dtype=torch.bfloat16).fill_(1)
    o = torch.empty(4096, 576, dtype=torch.bfloat16).fill_(1); del qkv
    h = x + o; del x, o
    gate_up = torch.empty(4096, 3072, dtype=torch.bfloat16).fill_(1)
    act = torch.empty(4096, 1536, dtype=torch.bfloat16).fill_(1); del gate_up
    down = torch.empty(4096, 576, dtype=torch.bfloat16).fill_(1); del act
    return h + down
for _ in range(3):
    layer()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):
    layer()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""
PAGES_WRITTEN = 30 * 4096 * (576 * 5 + 960 + 3072 + 1536) * 2 // 4096  # 506,880




def run(env_value: str) -> tuple[str, int]:
    """The script in a fresh process, glibc starting from its documented fixed thresholds
    (every block above 128 KiB its own mmap) rather than from wherever the import of
    torch and vframe left its moving ones."""
    env = dict(os.environ, VFRAME_MALLOC_TUNING=env_value, MALLOC_MMAP_THRESHOLD_="131072")
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, check=True)
    tuned, faults = out.stdout.split()
    return tuned, int(faults)


def test_tuned_allocator_reuses_pages_across_layers():
    tuned, faults = run("1")
    assert tuned == "True"
    assert faults < PAGES_WRITTEN // 50, f"{faults} page faults for {PAGES_WRITTEN} pages written"


def test_tuning_can_be_turned_off():
    tuned, faults = run("0")
    assert tuned == "False"
    # glibc's fixed start thresholds: every block a fresh mmap, written page by page.
    assert faults > PAGES_WRITTEN // 4, f"{faults} page faults for {PAGES_WRITTEN} pages written"
