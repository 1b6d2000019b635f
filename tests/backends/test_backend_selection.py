"""Choosing the attention backend: explicit names, ``auto``, and refusals with every reason."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch

from vframe.backends.cpu_paged import build
from vframe.backends.cpu_paged.backend import CpuPagedAttentionBackend
from vframe.backends.torch_attn import TorchAttentionBackend
from vframe.core.config import EngineConfig
from vframe.core.worker import model_runner
from vframe.core.worker.model_runner import TorchModelRunner
from vframe.errors import ConfigError
from vframe.plugins import hookimpl, register_plugin, unregister_plugin


class Accepting(TorchAttentionBackend):
    name = "acme_attn"


class Refusing(TorchAttentionBackend):
    name = "acme_attn"

    @classmethod
    def check_available(cls) -> list[str]:
        return ["the acme package is not installed"]

    @classmethod
    def validate_configuration(cls, **kwargs: object) -> list[str]:
        return ["head_size 64 is not supported"]


def _plugin(backend: type | str) -> object:
    class Plugin:
        @hookimpl
        def vframe_register_attention_backends(self, register):
            register("acme_attn", backend)

    return Plugin()


@pytest.fixture
def acme_attn(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A plugin backend ``acme_attn``, first in line for ``auto`` on CUDA."""
    monkeypatch.setitem(model_runner.AUTO_ATTENTION_BACKENDS, "cuda", ["acme_attn", "flash_attn", "triton", "torch"])
    register_plugin(_plugin(request.param), "acme-attn")
    yield
    unregister_plugin("acme-attn")


@pytest.fixture(autouse=True)
def not_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def _runner(device: str = "cpu", **settings: object) -> TorchModelRunner:
    """A runner as ``load_model`` leaves it just before choosing the backend (SmolLM2's shapes)."""
    runner = TorchModelRunner(EngineConfig.from_sources(env={}, device="cpu", **settings))
    runner.device = torch.device(device)  # validate_configuration is asked about this device type
    runner.hf_config = SimpleNamespace(num_attention_heads=9, hidden_size=576, num_key_value_heads=3)
    runner.dtype = torch.float32
    return runner


def test_auto_is_the_same_as_unset() -> None:
    assert EngineConfig.from_sources(env={}).attention.attention_backend is None
    assert EngineConfig.from_sources(env={}, attention_backend="auto").attention.attention_backend is None
    assert EngineConfig.from_sources(env={"VFRAME_ATTENTION_BACKEND": "auto"}).attention.attention_backend is None


def test_auto_on_cpu_is_cpu_paged() -> None:
    assert model_runner.AUTO_ATTENTION_BACKENDS["cpu"] == ["cpu_paged", "torch"]
    assert _runner()._select_attention_backend() is CpuPagedAttentionBackend


def test_auto_on_cpu_is_torch_where_cpu_paged_cannot_be_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setattr(build, "load_ops", build.load_ops.__wrapped__)  # no cached success
    assert _runner()._select_attention_backend() is TorchAttentionBackend


def test_explicit_choice() -> None:
    assert _runner(attention_backend="torch")._select_attention_backend() is TorchAttentionBackend


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_explicit_triton_on_cpu_fails_with_every_reason() -> None:
    pytest.importorskip("triton")
    with pytest.raises(ConfigError) as err:
        _runner(attention_backend="triton", block_size=2)._select_attention_backend()
    message = str(err.value)
    assert message.startswith("attention_backend='triton' cannot serve this configuration: ")
    assert "needs an NVIDIA GPU (CUDA); TRITON_INTERPRET=1 runs its kernels on the CPU" in message
    assert "block_size 2 is not supported by the triton backend; use one of 4, 8, 16, 32, 64, 128, 256" in message
    assert "the triton backend runs on NVIDIA GPUs (device='cuda'); on the CPU only under TRITON_INTERPRET=1" in message
    assert "attention_backend='auto' takes the first usable backend" in message


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where triton cannot run")
def test_auto_on_cuda_passes_over_refusing_backends() -> None:
    # flash_attn and triton have no GPU here: torch is next in line
    assert model_runner.AUTO_ATTENTION_BACKENDS["cuda"] == ["flash_attn", "triton", "torch"]
    assert _runner("cuda")._select_attention_backend() is TorchAttentionBackend


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where triton cannot run")
@pytest.mark.parametrize("acme_attn", ["vframe_no_such_module:AcmeAttentionBackend"], indirect=True)
def test_auto_passes_over_a_backend_that_cannot_be_imported(acme_attn: None) -> None:
    assert _runner("cuda")._select_attention_backend() is TorchAttentionBackend


@pytest.mark.parametrize("acme_attn", [Accepting], indirect=True)
def test_auto_on_cuda_takes_the_first_in_line(acme_attn: None) -> None:
    assert _runner("cuda")._select_attention_backend() is Accepting


@pytest.mark.parametrize("acme_attn", [Refusing], indirect=True)
def test_auto_that_finds_nothing_lists_every_candidate_and_reason(
    acme_attn: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(model_runner.AUTO_ATTENTION_BACKENDS, "cuda", ["acme_attn", "not_registered"])
    with pytest.raises(ConfigError) as err:
        _runner("cuda")._select_attention_backend()
    assert str(err.value) == (
        "attention_backend='auto' found no usable backend on cuda among acme_attn: acme_attn: "
        "the acme package is not installed; head_size 64 is not supported"
    )


def test_triton_validate_configuration_lists_every_reason() -> None:
    from vframe.backends.triton.backend import TritonAttentionBackend

    reasons = TritonAttentionBackend.validate_configuration(
        head_size=512, dtype=torch.float64, device="cuda", block_size=2
    )
    assert reasons == [
        "the triton backend supports float32, bfloat16 and float16, not torch.float64",
        "head_size 512 is not supported by the triton backend; use 16 to 256",
        "block_size 2 is not supported by the triton backend; use one of 4, 8, 16, 32, 64, 128, 256",
    ]
    # MLA (plugin API 1.3): head_size is the latent's kv_lora_rank + qk_rope_head_dim
    mla = dict(dtype=torch.bfloat16, device="cuda", block_size=16, use_mla=True)
    assert TritonAttentionBackend.validate_configuration(head_size=576, **mla) == []
    assert TritonAttentionBackend.validate_configuration(head_size=2048, **mla) == [
        "an MLA latent of 2048 (kv_lora_rank + qk_rope_head_dim) is not supported by the triton backend; "
        "use 16 to 1024"
    ]
    # head sizes that are no power of two are padded inside the kernels
    accepted = dict(head_size=80, dtype=torch.float16, device="cuda", block_size=16)
    assert TritonAttentionBackend.validate_configuration(**accepted) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is the CPU's")
def test_vframe_plugins_says_why_triton_is_not_usable_here() -> None:
    pytest.importorskip("triton")
    from vframe.plugins.report import describe_plugins

    (row,) = [r for r in describe_plugins() if r.kind == "attention_backend" and r.name == "triton"]
    assert not row.usable
    assert row.reasons == [
        "needs an NVIDIA GPU (CUDA); TRITON_INTERPRET=1 runs its kernels on the CPU "
        "through Triton's interpreter, for tests only"
    ]
