"""dtype='auto' and the CPU: bfloat16 only where the CPU multiplies it natively."""

from __future__ import annotations

import logging

import pytest
import torch

from vframe.core.worker import model_runner
from vframe.core.worker.model_runner import default_dtype_name, resolve_dtype
from vframe.errors import ConfigError

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(params=[True, False], ids=["native-bf16", "no-native-bf16"])
def native_bf16(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setattr(model_runner, "cpu_has_fast_bf16", lambda: request.param)
    return request.param


@pytest.mark.parametrize("checkpoint", [None, torch.bfloat16, torch.float16])
def test_auto_on_cpu_is_bfloat16_only_with_native_support(native_bf16: bool, checkpoint: torch.dtype | None) -> None:
    # GGUF (None), a bfloat16 and a float16 checkpoint
    assert resolve_dtype("auto", checkpoint, CPU) == (torch.bfloat16 if native_bf16 else torch.float32)


def test_auto_keeps_a_float32_checkpoint(native_bf16: bool) -> None:
    assert resolve_dtype("auto", torch.float32, CPU) == torch.float32


def test_auto_on_cuda_is_bfloat16_whatever_the_cpu(native_bf16: bool) -> None:
    assert resolve_dtype("auto", None, CUDA) == torch.bfloat16
    assert default_dtype_name("cuda") == "bfloat16"


def test_explicit_bfloat16_is_kept_and_warned_about_without_native_support(
    native_bf16: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger=model_runner.__name__):
        assert resolve_dtype("bfloat16", None, CPU) == torch.bfloat16
    warned = [r.getMessage() for r in caplog.records if "without native bfloat16" in r.getMessage()]
    assert len(warned) == (0 if native_bf16 else 1)


def test_benchmarks_default_to_what_is_fast(native_bf16: bool) -> None:
    assert default_dtype_name("cpu") == ("bfloat16" if native_bf16 else "float32")


def test_float16_is_refused_on_cpu() -> None:
    with pytest.raises(ConfigError, match=r"^dtype='float16' is not supported on CPU; use 'bfloat16' or 'float32'$"):
        resolve_dtype("float16", None, CPU)

