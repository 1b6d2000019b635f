"""Multi-LoRA through the engine: real PEFT adapters made at test time on the
embedded SmolLM2, served by ``LLM(enable_lora=True)``, against PEFT's own model.

Each adapter is a ``peft`` LoraConfig with ``init_lora_weights=False`` (B is
random, not zero, so the adapter changes the output) saved with
``save_pretrained``. The reference is ``PeftModel.from_pretrained`` on
transformers' reading of the same GGUF, in float32.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch

from vframe import LLM, LoRARequest, SamplingParams
from vframe.errors import ConfigError, InvalidRequestError

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))
from parity import LOGPROB_ATOL, transformers_greedy  # noqa: E402

ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
EVERYTHING = ATTENTION + ["gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, target modules, use_rslora)
ADAPTERS = {
    "attn8": (8, 16, ATTENTION, False),
    "all4": (4, 8, EVERYTHING, False),
    "rs16": (16, 16, ["q_proj", "v_proj", "gate_proj", "down_proj"], True),
    "mlp8": (8, 32, ["gate_proj", "up_proj", "down_proj"], False),
}
PROMPTS = [
    [1, 504, 3458, 282, 4649, 314],  # token ids of the embedded tokenizer
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory, hf_smollm) -> dict[str, LoRARequest]:
    from peft import LoraConfig, get_peft_model

    made = {}
    for lora_int_id, (name, (rank, alpha, targets, rslora)) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(lora_int_id)
        config = LoraConfig(
            r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
        )
        model = get_peft_model(copy.deepcopy(hf_smollm), config)
        with torch.no_grad():  # small deltas: the outputs change, the text stays sensible
            for param_name, param in model.named_parameters():
                if "lora_B" in param_name:
                    param.mul_(0.05)
        path = tmp_path_factory.mktemp(name)
        model.save_pretrained(str(path))
        made[name] = LoRARequest(name, lora_int_id, str(path))
    return made


@pytest.fixture(scope="module")
def references(adapters, hf_smollm) -> dict[str | None, list[tuple[list[int], list[float]]]]:
    """Per adapter (None: the base model), PEFT's greedy tokens and logprobs per prompt."""
    from peft import PeftModel

    refs = {None: [transformers_greedy(hf_smollm, p, MAX_TOKENS) for p in PROMPTS]}
    for name, request in adapters.items():
        peft_model = PeftModel.from_pretrained(copy.deepcopy(hf_smollm), request.lora_path).eval()
        refs[name] = [transformers_greedy(peft_model, p, MAX_TOKENS) for p in PROMPTS]
    return refs


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=3, num_threads=2)


PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)


def _tokens_and_logprobs(output) -> tuple[list[int], list[float]]:
    completion = output.outputs[0]
    return completion.token_ids, [step[t].logprob for step, t in zip(completion.logprobs, completion.token_ids)]


def _assert_matches(output, reference: tuple[list[int], list[float]], what: str) -> None:
    tokens, logprobs = _tokens_and_logprobs(output)
    assert tokens == reference[0], f"{what}: {tokens} != PEFT's {reference[0]}"
    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(reference[1]), rtol=0, atol=LOGPROB_ATOL)


def test_the_adapters_change_the_output(references) -> None:
    base = references[None]
    assert all(references[name] != base for name in ADAPTERS)


@pytest.mark.parametrize("name", list(ADAPTERS))
def test_each_adapter_matches_peft(llm, adapters, references, name) -> None:
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, lora_request=adapters[name], use_tqdm=False
    )
    for i, output in enumerate(outputs):
        _assert_matches(output, references[name][i], f"adapter {name}, prompt {i}")


def test_a_batch_mixing_four_adapters_and_the_base_model(adapters, references) -> None:
    # max_loras=2 resident slots for 4 adapters in flight: the scheduler admits at
    # most 2 adapters at a time, the others wait; every request still gets its own.
    llm = LLM(dtype="float32", enable_lora=True, max_loras=2, max_cpu_loras=4, num_threads=2)
    names = [None, "attn8", "all4", "rs16", "mlp8"] * 2
    prompts = [{"prompt_token_ids": PROMPTS[i % 2]} for i in range(len(names))]
    loras = [None if n is None else adapters[n] for n in names]
    outputs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
    for i, (name, output) in enumerate(zip(names, outputs, strict=True)):
        _assert_matches(output, references[name][i % 2], f"request {i} ({name})")
    manager = llm.llm_engine.model_runner.lora_manager
    assert len(manager.slot_ids()) == 2


@pytest.mark.slow  # three worker processes: about 16 s
def test_adapters_split_over_three_tensor_parallel_ranks_match_peft(adapters, references) -> None:
    # SmolLM2's 9 heads split by 3: each worker holds its shard of A (row-parallel
    # layers) or B (column-parallel ones) of every adapter (docs/distributed.md).
    llm = LLM(dtype="float32", enable_lora=True, max_loras=2, tensor_parallel_size=3)
    try:
        names = [None, "all4", "rs16"]
        prompts = [{"prompt_token_ids": PROMPTS[i % 2]} for i in range(len(names))]
        loras = [None if n is None else adapters[n] for n in names]
        outputs = llm.generate(prompts, PARAMS, lora_request=loras, use_tqdm=False)
        for i, (name, output) in enumerate(zip(names, outputs, strict=True)):
            _assert_matches(output, references[name][i % 2], f"request {i} ({name}) over 3 ranks")
        assert sorted(r.lora_name for r in llm.llm_engine.list_loras()) == ["all4", "rs16"]
    finally:
        llm.shutdown()


def test_prefix_cache_is_not_shared_across_adapters(adapters) -> None:
    llm = LLM(dtype="float32", enable_lora=True, max_loras=2, num_threads=2, block_size=4)
    prompt = [{"prompt_token_ids": PROMPTS[1]}]  # 21 tokens: 5 full blocks
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def hits(lora: LoRARequest | None) -> int:
        before = llm.get_stats()["prefix_cache_hits"]
        llm.generate(prompt, params, lora_request=lora, use_tqdm=False)
        return int(llm.get_stats()["prefix_cache_hits"] - before)

    assert hits(adapters["attn8"]) == 0
    assert hits(adapters["attn8"]) == 20  # the same adapter: 5 blocks of 4
    assert hits(adapters["all4"]) == 0
    assert hits(None) == 0


def test_lora_request_needs_enable_lora(adapters) -> None:
    llm = LLM(dtype="float32", num_threads=2)
    with pytest.raises(ConfigError, match="start it with enable_lora=True"):
        llm.generate("Hi", SamplingParams(max_tokens=1), lora_request=adapters["attn8"], use_tqdm=False)
    assert llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids


def test_a_bad_adapter_fails_its_request_and_the_engine_keeps_serving(llm, tmp_path, adapters, references) -> None:
    missing = LoRARequest("missing", 90, str(tmp_path / "nowhere"))
    with pytest.raises(InvalidRequestError, match="missing"):
        llm.generate("Hi", SamplingParams(max_tokens=1), lora_request=missing, use_tqdm=False)
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "lora_alpha": 16}')
    (tmp_path / "pickled" / "adapter_model.bin").write_bytes(b"not read")
    with pytest.raises(InvalidRequestError, match="safetensors"):
        llm.generate(
            "Hi", SamplingParams(max_tokens=1), lora_request=LoRARequest("pickled", 91, str(tmp_path / "pickled")),
            use_tqdm=False,
        )
    assert not llm.llm_engine.has_unfinished_requests()
    output = llm.generate(
        [{"prompt_token_ids": PROMPTS[0]}], PARAMS, lora_request=adapters["attn8"], use_tqdm=False
    )[0]
    _assert_matches(output, references["attn8"][0], "after the failures")


def test_add_list_and_remove(adapters) -> None:
    llm = LLM(dtype="float32", enable_lora=True, max_loras=1, num_threads=2)
    llm.add_lora(adapters["mlp8"])
    assert [r.lora_name for r in llm.list_loras()] == ["mlp8"]
    assert llm.remove_lora(adapters["mlp8"].lora_int_id) is True
    assert llm.remove_lora(adapters["mlp8"].lora_int_id) is False
    assert llm.list_loras() == []


def test_an_adapter_over_the_gguf_kept_quantized_matches_peft(adapters, references) -> None:
    """``quantization="gguf"``: the adapter's deltas beside the base layers' Q4_1 blocks (on their quant
    kernels, outside the decode plan), against PEFT on transformers' reading of the same file."""
    llm = LLM(dtype="float32", quantization="gguf", enable_lora=True, max_loras=1, num_threads=2)
    model = llm.llm_engine.model_runner.model.model
    assert type(model.layers[0].mlp.down_proj.base_layer.quant_method).__name__ == "GGUFLinearMethod"
    assert model.decode_plan is None
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], PARAMS, lora_request=adapters["all4"], use_tqdm=False
    )
    for i, output in enumerate(outputs):
        _assert_matches(output, references["all4"][i], f"GGUF, adapter all4, prompt {i}")
