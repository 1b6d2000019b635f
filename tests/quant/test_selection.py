"""Which quantization config a run gets: the setting, or the checkpoint's own quant_method."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from vframe.errors import ConfigError, PluginError
from vframe.models.config import ModelConfig
from vframe.plugins import get_registry, hookimpl, register_plugin, unregister_plugin
from vframe.quant.base import QuantizationConfig
from vframe.quant.selection import build_quant_config
from w8_quantizer import W8Config

CPU = torch.device("cpu")


class FakeGPTQ(W8Config):
    """Stands in for a checkpoint-format quantizer: keeps the config it was given."""

    @classmethod
    def get_name(cls) -> str:
        return "fake-gptq"

    @classmethod
    def get_min_capability(cls) -> int | None:
        return 80

    @classmethod
    def from_config(cls, hf_quant_config):
        config = cls()
        config.hf_quant_config = hf_quant_config
        return config


class NotAConfig:
    pass


class Plugin:
    @staticmethod
    @hookimpl
    def vframe_register_quantizers(register) -> None:
        register("w8-test", W8Config)
        register("fake-gptq", FakeGPTQ)
        register("not-a-config", NotAConfig)


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    register_plugin(Plugin, "selection-test-plugin")
    yield
    unregister_plugin("selection-test-plugin")


def hf_config(**fields: object) -> ModelConfig:
    return ModelConfig({"model_type": "llama", **fields})


def test_no_setting_and_a_float_checkpoint_run_unquantized() -> None:
    assert build_quant_config(None, hf_config(), dtype=torch.float32, device=CPU) is None


def test_the_setting_builds_its_config_from_none_for_a_float_checkpoint() -> None:
    config = build_quant_config("w8-test", hf_config(), dtype=torch.bfloat16, device=CPU)
    assert type(config) is W8Config


def test_a_quantized_checkpoint_picks_the_quantizer_it_names(monkeypatch: pytest.MonkeyPatch) -> None:
    quant = {"quant_method": "fake-gptq", "bits": 4, "group_size": 128}
    with pytest.raises(ConfigError, match=r"quantization='fake-gptq' cannot serve this configuration: "
                       r"needs a CUDA GPU of compute capability >= 8.0; the device is cpu"):
        build_quant_config(None, hf_config(quantization_config=quant), dtype=torch.float32, device=CPU)

    monkeypatch.setattr(FakeGPTQ, "get_min_capability", classmethod(lambda cls: None))
    config = build_quant_config(None, hf_config(quantization_config=quant), dtype=torch.float32, device=CPU)
    assert config.hf_quant_config == quant


def test_auto_is_the_checkpoint_s_own_method() -> None:
    assert build_quant_config("auto", hf_config(), dtype=torch.float32, device=CPU) is None
    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}
    config = build_quant_config("auto", hf_config(quantization_config=gptq), dtype=torch.float32, device=CPU)
    assert (type(config).__name__, config.bits, config.group_size, config.desc_act) == ("GPTQConfig", 4, 32, True)


def test_a_quantized_checkpoint_without_its_quantizer_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"quant_method='hqq'\) and no quantizer of that name is registered "
                       r"\(known: awq, bitsandbytes, compressed-tensors, fake-gptq, fp8, gguf, gptq, modelopt, "
                       r"modelopt_fp4, modelopt_mxfp8, not-a-config, w8-test\)"):
        build_quant_config(None, hf_config(quantization_config={"quant_method": "hqq"}), dtype=torch.float32, device=CPU)


def test_a_quantize_on_load_method_refuses_a_quantized_checkpoint() -> None:
    with pytest.raises(ConfigError, match="quantizes float checkpoints while loading; this checkpoint is already quantized"):
        build_quant_config(
            "w8-test", hf_config(quantization_config={"quant_method": "fake-gptq"}), dtype=torch.float32, device=CPU
        )


def test_registry_entries_must_be_quantization_configs() -> None:
    assert issubclass(get_registry("quantizer").load("w8-test"), QuantizationConfig)
    with pytest.raises(PluginError, match=r"is not a subclass of vframe.quant.base:QuantizationConfig"):
        get_registry("quantizer").load("not-a-config")
