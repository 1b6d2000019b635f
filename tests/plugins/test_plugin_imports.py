from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["triton", "flash_attn", "vframe.backends.torch_attn", "vframe.models.llama"]

SCRIPT = f"""
import json, sys
import vframe, vframe.plugins
names = vframe.plugins.get_registry("attention_backend").names()
vframe.plugins.get_registry("model").names()
print(json.dumps({{"names": names, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def test_listing_registries_imports_no_kernels_or_model_code():
    # A fresh interpreter, with every installed plugin loading as in real use.
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "torch" in result["names"]
    assert result["heavy"] == []
