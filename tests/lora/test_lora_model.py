"""Multi-LoRA on the embedded SmolLM2: vframe with LoRAManager gives the logits PEFT gives,
per adapter, in mixed batches, and across slot and host-cache evictions."""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from vframe.backends.torch_attn import TorchAttentionBackend
from vframe.errors import ConfigError, LoRAAdapterError
from vframe.lora import add_lora
from vframe.lora import manager as manager_module
from vframe.lora.layers import LoRALinear
from vframe.lora.manager import LoRAManager
from vframe.lora.request import LoRARequest
from vframe.models.llama import LlamaForCausalLM
from vframe.models.loader import ResolvedModel, load_model, load_tokenizer
from vframe.plugins.manager import get_registry

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from test_llama import PROMPT, PagedRun  # noqa: E402

ATOL = 5e-4  # logits reach ~30; batching changes how matmuls accumulate
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Adapter:
    request: LoRARequest
    logits: torch.Tensor  # [len(prompt), V]: PeftModel.from_pretrained's prefill logits


# id -> LoraConfig arguments; init_lora_weights=False makes B non-zero
ADAPTER_CONFIGS: dict[int, dict[str, Any]] = {
    1: {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    2: {"r": 8, "lora_alpha": 16, "target_modules": ALL},
    3: {
        "r": 16,
        "lora_alpha": 16,
        "use_rslora": True,
        "target_modules": ["q_proj", "v_proj", "gate_proj", "down_proj"],
    },
    4: {
        "r": 8,
        "lora_alpha": 16,
        "target_modules": r".*\.(o_proj|up_proj|down_proj)",
        "rank_pattern": {"down_proj": 4},
        "alpha_pattern": {"o_proj": 4},
    },
}
ADAPTER_NAMES = {1: "attn-r4", 2: "all-r8", 3: "rslora-r16", 4: "patterns-regex"}


@pytest.fixture(scope="module")
def prompt_ids(smollm: ResolvedModel) -> list[int]:
    return load_tokenizer(smollm)(PROMPT).input_ids


@pytest.fixture(scope="module")
def base_logits(hf_smollm: torch.nn.Module, prompt_ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf_smollm(torch.tensor([prompt_ids])).logits[0].float()


@pytest.fixture(scope="module")
def adapters(
    hf_smollm: torch.nn.Module, prompt_ids: list[int], tmp_path_factory: pytest.TempPathFactory
) -> dict[int, Adapter]:
    """The adapters of ADAPTER_CONFIGS saved by PEFT, with PEFT's logits for each."""
    from peft import LoraConfig, PeftModel, get_peft_model

    hf_model = copy.deepcopy(hf_smollm)  # PEFT edits the model in place; the session's stays clean
    root = tmp_path_factory.mktemp("adapters")
    made = {}
    for lora_id, config in ADAPTER_CONFIGS.items():
        torch.manual_seed(lora_id)
        path = root / ADAPTER_NAMES[lora_id]
        peft_model = get_peft_model(hf_model, LoraConfig(init_lora_weights=False, **config))
        peft_model.save_pretrained(str(path))
        hf_model = peft_model.unload()
        reloaded = PeftModel.from_pretrained(hf_model, str(path))
        with torch.inference_mode():
            logits = reloaded(torch.tensor([prompt_ids])).logits[0].float()
        hf_model = reloaded.unload()
        made[lora_id] = Adapter(LoRARequest(ADAPTER_NAMES[lora_id], lora_id, str(path)), logits)
    return made


def lora_model(smollm: ResolvedModel, **limits: int) -> tuple[LlamaForCausalLM, LoRAManager]:
    """A fresh float32 model (the manager wraps its layers in place) and its manager."""
    model = load_model(smollm, LlamaForCausalLM, TorchAttentionBackend, torch.float32)
    limits = {"max_loras": 2, "max_lora_rank": 16, "max_cpu_loras": 4} | limits
    return model, LoRAManager(model, dtype=torch.float32, device="cpu", **limits)  # type: ignore[arg-type]


def prefill(model: LlamaForCausalLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    """Each prompt's prefill logits, all prompts in one step."""
    run = PagedRun(model, [[2 * b, 2 * b + 1] for b in range(len(prompts))])
    logits = run.step(prompts)
    return list(logits.split([len(p) for p in prompts]))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.mark.parametrize("lora_id", list(ADAPTER_CONFIGS), ids=list(ADAPTER_NAMES.values()))
def test_adapter_logits_match_peft(
    smollm: ResolvedModel,
    adapters: dict[int, Adapter],
    base_logits: torch.Tensor,
    prompt_ids: list[int],
    lora_id: int,
) -> None:
    model, manager = lora_model(smollm, max_loras=1, max_cpu_loras=1)
    adapter = adapters[lora_id]
    manager.add_adapter(adapter.request)

    manager.prepare_step([(0, len(prompt_ids), lora_id)])
    (logits,) = prefill(model, [prompt_ids])

    assert max_diff(adapter.logits, base_logits) > 1.0  # the adapter matters
    assert max_diff(logits, adapter.logits) < ATOL


def test_prefill_then_decode_with_an_adapter(
    smollm: ResolvedModel, adapters: dict[int, Adapter], prompt_ids: list[int]
) -> None:
    model, manager = lora_model(smollm)
    manager.add_adapter(adapters[2].request)
    run = PagedRun(model, [[7, 0]])

    manager.prepare_step([(0, 10, 2)])
    logits = [run.step([prompt_ids[:10]])]
    for pos in range(10, 15):
        manager.prepare_step([(0, 1, 2)])
        logits.append(run.step([[prompt_ids[pos]]]))

    assert max_diff(torch.cat(logits), adapters[2].logits[:15]) < ATOL


def test_mixed_batch_gives_each_row_what_it_gives_alone(
    smollm: ResolvedModel, adapters: dict[int, Adapter], base_logits: torch.Tensor, prompt_ids: list[int]
) -> None:
    model, manager = lora_model(smollm, max_loras=3)
    for lora_id in (1, 2, 3):
        manager.add_adapter(adapters[lora_id].request)
    # requests: adapter 1 (20 tokens), no adapter (15), adapter 3 (all), adapter 2 (12)
    lengths = [20, 15, len(prompt_ids), 12]
    n = len(prompt_ids)

    manager.prepare_step([(0, 20, 1), (35, 35 + n, 3), (35 + n, 47 + n, 2)])
    rows = prefill(model, [prompt_ids[:length] for length in lengths])

    assert manager.slot_ids() == [1, 3, 2]
    assert max_diff(rows[0], adapters[1].logits[:20]) < ATOL
    assert max_diff(rows[1], base_logits[:15]) < ATOL
    assert max_diff(rows[2], adapters[3].logits) < ATOL
    assert max_diff(rows[3], adapters[2].logits[:12]) < ATOL


def test_slot_eviction_is_least_recently_used(
    smollm: ResolvedModel, adapters: dict[int, Adapter], prompt_ids: list[int]
) -> None:
    model, manager = lora_model(smollm, max_loras=2, max_cpu_loras=4)
    for adapter in adapters.values():
        manager.add_adapter(adapter.request)
    prompt = prompt_ids[:8]
    assert manager.slot_ids() == [None, None]

    # (adapter ids of the step's requests, slots after it)
    steps: list[tuple[list[int], list[int | None]]] = [
        ([1], [1, None]),
        ([2], [1, 2]),
        ([1], [1, 2]),  # 1 is now more recent than 2
        ([3], [1, 3]),  # evicts 2
        ([4, 1], [1, 4]),  # 1 stays: this step needs it; 3 goes
        ([2, 3], [2, 3]),  # both slots last used together: the lower one goes first
        ([3, 2], [2, 3]),  # resident: nothing moves, segments name the slots
    ]
    for ids, expected_slots in steps:
        manager.prepare_step([(8 * b, 8 * b + 8, lora_id) for b, lora_id in enumerate(ids)])
        rows = prefill(model, [prompt] * len(ids))

        assert manager.slot_ids() == expected_slots
        for row, lora_id in zip(rows, ids, strict=True):
            assert max_diff(row, adapters[lora_id].logits[:8]) < ATOL


def test_host_cache_reloads_an_evicted_adapter_from_its_path(
    smollm: ResolvedModel, adapters: dict[int, Adapter], prompt_ids: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    loads: list[int] = []
    real_load = manager_module.load_peft_adapter

    def counting_load(request: LoRARequest, **kwargs: Any) -> Any:
        loads.append(request.lora_int_id)
        return real_load(request, **kwargs)

    monkeypatch.setattr(manager_module, "load_peft_adapter", counting_load)
    model, manager = lora_model(smollm, max_loras=1, max_cpu_loras=2)

    for lora_id in (1, 2, 3):
        manager.add_adapter(adapters[lora_id].request)
    assert manager.host_ids() == [2, 3]  # 1 evicted
    manager.add_adapter(adapters[2].request)  # already cached: refreshed, not read again
    assert manager.host_ids() == [3, 2]
    assert loads == [1, 2, 3]

    manager.prepare_step([(0, 8, 1)])
    (row,) = prefill(model, [prompt_ids[:8]])

    assert loads == [1, 2, 3, 1]  # read again from its path
    assert manager.host_ids() == [2, 1]
    assert manager.slot_ids() == [1]
    assert max_diff(row, adapters[1].logits[:8]) < ATOL


def test_a_step_without_lora_gives_the_base_model(
    smollm: ResolvedModel, adapters: dict[int, Adapter], base_logits: torch.Tensor, prompt_ids: list[int]
) -> None:
    model, manager = lora_model(smollm)
    manager.add_adapter(adapters[2].request)
    manager.prepare_step([(0, 8, 2)])
    prefill(model, [prompt_ids[:8]])

    manager.prepare_step([])
    (logits,) = prefill(model, [prompt_ids])

    assert max_diff(logits, base_logits) < ATOL
    assert manager.slot_ids() == [2, None]  # stays resident for a later step


def test_wraps_the_decoder_linear_layers_only(smollm: ResolvedModel) -> None:
    model, _ = lora_model(smollm, max_loras=2, max_lora_rank=8)

    wrapped = {name for name, m in model.named_modules() if isinstance(m, LoRALinear)}
    layer0 = model.model.layers[0]

    assert len(wrapped) == 4 * model.config.num_hidden_layers
    assert {n for n in wrapped if ".layers.0." in n} == {
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.0.mlp.down_proj",
    }
    assert not isinstance(model.lm_head, LoRALinear)
    qkv = layer0.self_attn.qkv_proj
    assert qkv.output_slices == [576, 192, 192]  # q: 9 heads of 64, k and v: 3 heads
    assert tuple(qkv.lora_a(1).shape) == (2, 8, 576)  # [max_loras, max_rank, in]
    assert tuple(qkv.lora_b(1).shape) == (2, 192, 8)  # [max_loras, out, max_rank]
    assert layer0.mlp.gate_up_proj.output_slices == [1536, 1536]
    # LoRA weights are buffers, outside the state dict: nothing takes them for model weights
    assert not [n for n, _ in model.named_parameters() if "lora" in n]
    assert not [n for n in model.state_dict() if "lora" in n]


def test_remove_adapter(smollm: ResolvedModel, adapters: dict[int, Adapter]) -> None:
    _, manager = lora_model(smollm)
    manager.add_adapter(adapters[1].request)
    manager.add_adapter(adapters[2].request)
    manager.prepare_step([(0, 4, 1), (4, 8, 2)])
    manager.prepare_step([])

    assert manager.remove_adapter(1)
    assert not manager.remove_adapter(1)
    assert manager.slot_ids() == [None, 2]
    assert manager.host_ids() == [2]
    with pytest.raises(LoRAAdapterError, match="adapter id 1 is not loaded"):
        manager.prepare_step([(0, 4, 1)])
    # the id is free again, for another adapter
    manager.add_adapter(LoRARequest("other", 1, adapters[3].request.lora_path))
    assert [r.lora_name for r in manager.list_adapters()] == ["other", "all-r8"]


def test_same_id_for_another_adapter_refused(smollm: ResolvedModel, adapters: dict[int, Adapter]) -> None:
    _, manager = lora_model(smollm)
    manager.add_adapter(adapters[1].request)

    with pytest.raises(LoRAAdapterError, match=r"adapter 'imposter' \(.*\) has lora_int_id 1, already used by "
                       r"adapter 'attn-r4'"):
        manager.add_adapter(LoRARequest("imposter", 1, adapters[2].request.lora_path))


def test_more_adapters_than_slots_in_one_step_raises(smollm: ResolvedModel, adapters: dict[int, Adapter]) -> None:
    _, manager = lora_model(smollm, max_loras=2)
    for lora_id in (1, 2, 3):
        manager.add_adapter(adapters[lora_id].request)

    with pytest.raises(RuntimeError, match=r"a step uses 3 adapters \(\[1, 2, 3\]\) but max_loras=2"):
        manager.prepare_step([(0, 1, 1), (1, 2, 2), (2, 3, 3)])


def test_model_without_packed_modules_mapping_refused() -> None:
    class NoMapping(torch.nn.Module):
        pass

    with pytest.raises(ConfigError, match="LoRA is not supported for NoMapping: it declares no packed_modules_mapping"):
        LoRAManager(NoMapping(), max_loras=1, max_lora_rank=8, max_cpu_loras=1, dtype=torch.float32, device="cpu")


def test_torch_kernel_is_registered() -> None:
    assert get_registry("lora_kernel").load("torch") is add_lora
