"""vframe.lora.peft: reading PEFT adapter directories, and every adapter vframe refuses."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from vframe.backends.torch_attn import TorchAttentionBackend
from vframe.errors import InvalidRequestError, LoRAAdapterError
from vframe.lora.manager import LoRAManager
from vframe.lora.peft import load_peft_adapter
from vframe.lora.request import LoRARequest
from vframe.models.llama import LlamaForCausalLM
from vframe.models.loader import load_model, resolve_model

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_llama import save_tiny_llama  # noqa: E402

Q = "model.layers.0.self_attn.q_proj"
V = "model.layers.0.self_attn.v_proj"
DOWN = "model.layers.1.mlp.down_proj"


def write_adapter(
    path: Path,
    modules: dict[str, tuple[int, int, int]],  # module -> (rank, in, out)
    **config: Any,
) -> Path:
    """A PEFT directory as ``save_pretrained`` writes it, with A = 1 and B = 2 everywhere."""
    path.mkdir(parents=True, exist_ok=True)
    fields: dict[str, Any] = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "modules_to_save": None,
        "fan_in_fan_out": False,
        "use_dora": False,
        "use_rslora": False,
        "rank_pattern": {},
        "alpha_pattern": {},
        "layers_to_transform": None,
        "layers_pattern": None,
    }
    fields.update(config)
    (path / "adapter_config.json").write_text(json.dumps(fields))
    tensors = {}
    for module, (rank, fan_in, fan_out) in modules.items():
        tensors[f"base_model.model.{module}.lora_A.weight"] = torch.ones(rank, fan_in)
        tensors[f"base_model.model.{module}.lora_B.weight"] = torch.full((fan_out, rank), 2.0)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def request(path: Path, name: str = "sql") -> LoRARequest:
    return LoRARequest(name, 1, str(path))


def test_reads_weights_and_scaling(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {Q: (8, 64, 96), V: (8, 64, 48)})

    adapter = load_peft_adapter(request(path), max_lora_rank=16)

    assert adapter.rank == 8
    assert sorted(adapter.modules) == [Q, V]
    q = adapter.modules[Q]
    assert q.lora_a.shape == (8, 64) and q.lora_b.shape == (96, 8)
    assert q.lora_a.device.type == "cpu"
    assert q.scaling == 2.0  # alpha / r = 16 / 8
    assert adapter.request == request(path)


def test_rslora_scaling(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {Q: (16, 64, 96)}, r=16, lora_alpha=8, use_rslora=True)

    adapter = load_peft_adapter(request(path), max_lora_rank=16)

    assert adapter.modules[Q].scaling == 2.0  # alpha / sqrt(r) = 8 / 4


def test_rank_and_alpha_patterns_override_per_module(tmp_path: Path) -> None:
    # PEFT matches a pattern against the end of the module path, as a regex
    path = write_adapter(
        tmp_path / "a",
        {Q: (8, 64, 96), V: (4, 64, 48), DOWN: (2, 112, 64)},
        rank_pattern={"v_proj": 4, r"layers\.1\.mlp\.down_proj": 2},
        alpha_pattern={"down_proj": 6},
    )

    adapter = load_peft_adapter(request(path), max_lora_rank=8)

    assert {m: (w.rank, w.scaling) for m, w in adapter.modules.items()} == {
        Q: (8, 2.0),  # 16 / 8
        V: (4, 4.0),  # 16 / 4
        DOWN: (2, 3.0),  # 6 / 2
    }
    assert adapter.rank == 8


def test_regex_target_modules(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {Q: (8, 64, 96)}, target_modules=r".*\.self_attn\.(q|v)_proj")

    adapter = load_peft_adapter(request(path), max_lora_rank=8)

    assert list(adapter.modules) == [Q]


def test_layers_to_transform_reads_the_layers_present(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {DOWN: (8, 112, 64)}, target_modules=["down_proj"], layers_to_transform=[1])

    assert list(load_peft_adapter(request(path), max_lora_rank=8).modules) == [DOWN]


def test_rank_above_max_lora_rank_refused(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {Q: (32, 64, 96)}, r=32)

    with pytest.raises(LoRAAdapterError) as e:
        load_peft_adapter(request(path), max_lora_rank=16)

    assert str(e.value) == f"adapter 'sql' ({path}) has rank 32 > max_lora_rank=16; raise max_lora_rank"
    assert isinstance(e.value, InvalidRequestError)


def test_bin_only_directory_refused_without_unpickling(tmp_path: Path) -> None:
    path = tmp_path / "a"
    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16}))
    (path / "adapter_model.bin").write_bytes(b"not a pickle: would fail loudly if read")

    with pytest.raises(LoRAAdapterError, match=r"adapter 'sql' \(.*\) has only adapter_model.bin, which vframe "
                       r"does not unpickle; convert it to adapter_model.safetensors"):
        load_peft_adapter(request(path), max_lora_rank=16)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"modules_to_save": ["lm_head"]}, "has modules_to_save=['lm_head']: fully trained modules are not supported"),
        ({"bias": "lora_only"}, "has bias='lora_only': biases trained with the adapter are not supported"),
        ({"fan_in_fan_out": True}, "has fan_in_fan_out=True"),
        ({"use_dora": True}, "DoRA"),
        ({"peft_type": "IA3"}, "is a IA3 adapter; only LoRA"),
        ({"target_modules": ["q_proj", "embed_tokens"]}, "targets embed_tokens; adapters of embed_tokens and lm_head"),
        ({"target_modules": r".*(lm_head|q_proj)"}, "targets lm_head; adapters of embed_tokens and lm_head"),
    ],
    ids=["modules_to_save", "bias", "fan_in_fan_out", "dora", "ia3", "embed_tokens", "lm_head-regex"],
)
def test_unsupported_config_refused(tmp_path: Path, config: dict[str, Any], message: str) -> None:
    path = write_adapter(tmp_path / "a", {Q: (8, 64, 96)}, **config)

    with pytest.raises(LoRAAdapterError) as e:
        load_peft_adapter(request(path), max_lora_rank=16)

    assert str(e.value).startswith(f"adapter 'sql' ({path}) ")
    assert message in str(e.value)


def test_embedding_tensors_refused(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {Q: (8, 64, 96)})
    save_file(
        {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(8, 96)},
        str(path / "adapter_model.safetensors"),
    )

    with pytest.raises(LoRAAdapterError, match="has an embedding adapter"):
        load_peft_adapter(request(path), max_lora_rank=16)


def test_missing_directory_refused(tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterError, match=r"adapter 'sql' \(.*nowhere\) has no adapter_config.json"):
        load_peft_adapter(request(tmp_path / "nowhere"), max_lora_rank=16)


def test_config_rank_disagreeing_with_tensors_refused(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {Q: (4, 64, 96)}, r=8)

    with pytest.raises(LoRAAdapterError, match="has model.layers.0.self_attn.q_proj.lora_A of rank 4, but its "
                       "config says r=8"):
        load_peft_adapter(request(path), max_lora_rank=16)


# --------------------------------------------------------------------------- #
# Adapters made for another model, refused by the manager
# --------------------------------------------------------------------------- #


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> LlamaForCausalLM:
    # hidden 64, 4 heads of 24 (q: 96), 2 kv heads (k, v: 48), intermediate 112, 2 layers
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path)
    return load_model(resolve_model(str(path)), LlamaForCausalLM, TorchAttentionBackend, torch.float32)


@pytest.fixture(scope="module")
def tiny_manager(tiny_model: LlamaForCausalLM) -> LoRAManager:
    return LoRAManager(
        tiny_model, max_loras=1, max_lora_rank=8, max_cpu_loras=1, dtype=torch.float32, device="cpu"
    )


def test_fitting_adapter_accepted(tmp_path: Path, tiny_manager: LoRAManager) -> None:
    path = write_adapter(tmp_path / "a", {Q: (8, 64, 96), V: (8, 64, 48), DOWN: (8, 112, 64)})

    tiny_manager.add_adapter(LoRARequest("fits", 7, str(path)))

    assert tiny_manager.host_ids() == [7]
    assert tiny_manager.remove_adapter(7)


def test_adapter_for_a_larger_model_refused(tmp_path: Path, tiny_manager: LoRAManager) -> None:
    # made for hidden size 128: A of q_proj is [8, 128]
    path = write_adapter(tmp_path / "a", {Q: (8, 128, 96)})

    with pytest.raises(LoRAAdapterError) as e:
        tiny_manager.add_adapter(LoRARequest("big", 2, str(path)))

    assert str(e.value) == (
        f"adapter 'big' ({path}) was trained for a different base model: "
        "model.layers.0.self_attn.q_proj.lora_A has shape [8, 128], this model expects [8, 64]"
    )
    assert tiny_manager.host_ids() == []


def test_adapter_of_a_missing_layer_refused(tmp_path: Path, tiny_manager: LoRAManager) -> None:
    path = write_adapter(tmp_path / "a", {"model.layers.5.self_attn.v_proj": (8, 64, 48)})

    with pytest.raises(LoRAAdapterError, match=r"was trained for a different base model: it adapts "
                       r"model.layers.5.self_attn.v_proj, which is not a layer LoRA can adapt in LlamaForCausalLM"):
        tiny_manager.add_adapter(LoRARequest("deep", 3, str(path)))



def test_tensor_other_than_lora_a_and_b_refused(tmp_path: Path) -> None:
    path = write_adapter(tmp_path / "a", {Q: (8, 64, 96)})
    name = f"base_model.model.{Q}.lora_magnitude_vector"  # DoRA's
    save_file({name: torch.ones(96)}, str(path / "adapter_model.safetensors"))

    with pytest.raises(LoRAAdapterError) as e:
        load_peft_adapter(request(path), max_lora_rank=16)

    assert str(e.value).startswith(f"adapter 'sql' ({path}) has tensor '{name}' in adapter_model.safetensors, which is")
