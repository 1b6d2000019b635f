"""Session fixtures: the embedded SmolLM2 GGUF converted once, its transformers reference, one engine."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vframe.models.loader import ResolvedModel, resolve_model


@pytest.fixture(scope="session")
def vframe_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vframe-cache")


@pytest.fixture(scope="session")
def smollm(vframe_cache_dir: Path) -> ResolvedModel:
    """The embedded SmolLM2-135M-Instruct, converted into a fresh cache."""
    return resolve_model(None, cache_dir=vframe_cache_dir)


@pytest.fixture(scope="session")
def hf_smollm(smollm: ResolvedModel) -> torch.nn.Module:
    """transformers' own reading of the same GGUF file, in float32."""
    from transformers import AutoModelForCausalLM

    gguf_file = smollm.gguf_file
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_file.parent), gguf_file=gguf_file.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def llm_fp32():
    """One float32 engine on the embedded model, shared by the end-to-end tests."""
    from vframe import LLM

    return LLM(dtype="float32", max_model_len=1024, num_threads=2)


@pytest.fixture(scope="session")
def tokenizer(llm_fp32):
    return llm_fp32.get_tokenizer()
