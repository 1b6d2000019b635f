"""Write the random Mixtral checkpoint the MoE throughput benchmark runs on.

    .venv/bin/python benchmarks/tiny_mixtral.py /tmp/mixtral-bench [--experts 8]
    .venv/bin/vframe bench throughput --model /tmp/mixtral-bench --backend both --dtype bfloat16

8 layers, hidden 512, ``--experts`` experts of 1024 (top-2), 8 query / 2 kv heads,
random weights in bfloat16 (156M parameters with 8 experts), and the embedded
SmolLM2's tokenizer (vocabulary 49152) so that the benchmark's text prompts work.
Nothing is downloaded: the tokenizer comes from the GGUF vframe ships with.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    args = parser.parse_args()

    from transformers import MixtralConfig, MixtralForCausalLM

    from vframe.models.loader import resolve_model

    config = MixtralConfig(
        vocab_size=49152, hidden_size=512, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, num_local_experts=args.experts,
        num_experts_per_tok=args.top_k, max_position_embeddings=2048, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    MixtralForCausalLM(config).to(torch.bfloat16).save_pretrained(args.output_dir)
    tokenizer_dir = resolve_model(None).model_dir  # the embedded SmolLM2, converted from its GGUF
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, args.output_dir / name)
    print(f"wrote {args.output_dir}")


if __name__ == "__main__":
    main()
