"""Write a SmolLM2-135M-shaped Llama whose heads split by 2 and 4, for
``vframe bench throughput --tensor-parallel-size 2`` on a CPU machine.

SmolLM2's own 9 attention heads and 3 KV heads split only by 3; this model
keeps its size (hidden 576, 30 layers, MLP 1536, vocabulary 49152, tied head)
with 8 heads of 64 and 4 KV heads, so a step does nearly the same arithmetic.
Weights are random (the timing does not depend on them); the tokenizer is
SmolLM2's, so the benchmark's prompts are the usual ones.

    .venv/bin/python benchmarks/tp_model.py /tmp/smollm2-8heads
    .venv/bin/vframe bench throughput --model /tmp/smollm2-8heads --tensor-parallel-size 2 --num-threads 1
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from vframe.models.loader import resolve_model


def main(out: Path) -> None:
    smollm = resolve_model(None).model_dir
    config = LlamaConfig.from_pretrained(smollm)
    config.num_attention_heads, config.num_key_value_heads, config.head_dim = 8, 4, 64
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"):
        if (smollm / name).exists():
            shutil.copy(smollm / name, out / name)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
