"""vframe's Llama on the torch backend gives the logits transformers gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vframe.backends.torch_attn import TorchAttentionBackend, TorchAttentionMetadata
from vframe.core.interfaces import CommonAttentionMetadata
from vframe.errors import ModelLoadError
from vframe.models.llama import ARCHITECTURES, LlamaForCausalLM
from vframe.models.loader import ResolvedModel, load_model, load_tokenizer, resolve_model

BLOCK_SIZE = 16
NUM_BLOCKS = 8
PROMPT = (
    "The capital of France is Paris, the capital of Italy is Rome, "
    "and the capital of Germany, a country in central Europe, is"
)


class PagedRun:
    """Drives a model step by step over a small paged KV cache, as a runner would."""

    def __init__(self, model: LlamaForCausalLM, block_ids: list[list[int]]) -> None:
        config = model.config
        shape = TorchAttentionBackend.get_kv_cache_shape(
            NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, model.model.layers[0].self_attn.head_dim
        )
        self.model = model
        self.kv_caches = [torch.zeros(shape, dtype=model.dtype) for _ in range(config.num_hidden_layers)]
        self.block_table = torch.tensor(block_ids, dtype=torch.int32)  # [B, max_blocks]
        self.num_computed = [0] * len(block_ids)

    def step(self, new_tokens: list[list[int]]) -> torch.Tensor:  # -> [T, V] logits
        """Run ``new_tokens[b]`` for each request ``b`` (may be empty: not scheduled)."""
        reqs = [b for b, tokens in enumerate(new_tokens) if tokens]
        input_ids, positions, slots, query_start_loc, seq_lens = [], [], [], [0], []
        for b in reqs:
            start = self.num_computed[b]
            for pos in range(start, start + len(new_tokens[b])):
                positions.append(pos)
                slots.append(int(self.block_table[b, pos // BLOCK_SIZE]) * BLOCK_SIZE + pos % BLOCK_SIZE)
            input_ids += new_tokens[b]
            query_start_loc.append(len(input_ids))
            seq_lens.append(start + len(new_tokens[b]))
            self.num_computed[b] += len(new_tokens[b])
        query_lens = [len(new_tokens[b]) for b in reqs]
        common = CommonAttentionMetadata(
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            context_lens=torch.tensor([s - q for s, q in zip(seq_lens, query_lens)], dtype=torch.int32),
            block_table=self.block_table[reqs],
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            num_reqs=len(reqs),
            num_actual_tokens=len(input_ids),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            block_size=BLOCK_SIZE,
            query_start_loc_cpu=query_start_loc,
            seq_lens_cpu=seq_lens,
        )
        meta = TorchAttentionMetadata.from_common(common)
        with torch.inference_mode():
            hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), self.kv_caches, meta)
            return self.model.compute_logits(hidden)


@pytest.fixture(scope="module")
def model(smollm: ResolvedModel) -> LlamaForCausalLM:
    return load_model(smollm, LlamaForCausalLM, TorchAttentionBackend, torch.float32)


@pytest.fixture(scope="module")
def prompt_ids(smollm: ResolvedModel) -> list[int]:
    ids = load_tokenizer(smollm)(PROMPT).input_ids
    assert len(ids) > BLOCK_SIZE + 2  # the prompt spans two non-adjacent blocks
    return ids


@pytest.fixture(scope="module")
def hf_logits(hf_smollm: torch.nn.Module, prompt_ids: list[int]) -> torch.Tensor:  # [len(prompt), V]
    with torch.inference_mode():
        return hf_smollm(torch.tensor([prompt_ids])).logits[0].float()


def test_architectures_registered() -> None:
    assert ARCHITECTURES == ["LlamaForCausalLM", "MistralForCausalLM"]


def test_prefill_logits_match_transformers(
    model: LlamaForCausalLM, prompt_ids: list[int], hf_logits: torch.Tensor
) -> None:
    run = PagedRun(model, [[5, 2]])

    logits = run.step([prompt_ids])

    assert logits.dtype == torch.float32
    assert (logits - hf_logits).abs().max() < 1e-3


def test_prefill_then_decode_matches_transformers(
    model: LlamaForCausalLM, prompt_ids: list[int], hf_logits: torch.Tensor
) -> None:
    run = PagedRun(model, [[7, 0]])
    logits = [run.step([prompt_ids[:10]])]
    for pos in range(10, 15):
        logits.append(run.step([[prompt_ids[pos]]]))

    assert (torch.cat(logits) - hf_logits[:15]).abs().max() < 1e-3


def test_mixed_batch_of_prefill_chunk_and_decode(
    model: LlamaForCausalLM, prompt_ids: list[int], hf_logits: torch.Tensor
) -> None:
    run = PagedRun(model, [[1, 6], [3, 4]])
    run.step([prompt_ids[:12], prompt_ids[:5]])
    # One step: request 0 decodes, request 1 runs a chunk on top of its 5 cached tokens.
    logits = run.step([[prompt_ids[12]], prompt_ids[5:14]])

    assert (logits[0] - hf_logits[12]).abs().max() < 1e-3
    assert (logits[1:] - hf_logits[5:14]).abs().max() < 1e-3


def test_bfloat16_runs_close_to_float32(
    smollm: ResolvedModel, prompt_ids: list[int], hf_logits: torch.Tensor
) -> None:
    bf16 = load_model(smollm, LlamaForCausalLM, TorchAttentionBackend, torch.bfloat16)
    logits = PagedRun(bf16, [[5, 2]]).step([prompt_ids])

    assert logits.dtype == torch.float32
    assert torch.equal(logits.argmax(-1)[-3:], hf_logits.argmax(-1)[-3:])


# --------------------------------------------------------------------------- #
# Tiny random checkpoints: rope scaling, untied head, biases, sharding
# --------------------------------------------------------------------------- #


def save_tiny_llama(path: Path, **overrides: object) -> torch.nn.Module:
    from transformers import LlamaConfig
    from transformers import LlamaForCausalLM as HFLlama

    fields: dict[str, object] = dict(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    )
    fields.update(overrides)
    torch.manual_seed(0)
    hf_model = HFLlama(LlamaConfig(**fields)).eval()
    hf_model.save_pretrained(str(path), max_shard_size="100KB")
    return hf_model


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"rope_parameters": {"rope_type": "linear", "rope_theta": 500.0, "factor": 2.0}, "attention_bias": True},
        {"tie_word_embeddings": True, "mlp_bias": True, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        # YaRN: positions past 32 are interpolated, and cos/sin carry its attention factor (~1.07)
        {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0,
                             "original_max_position_embeddings": 32}},
    ],
    ids=["llama3-untied", "linear-attn-bias", "default-tied-mlp-bias", "yarn"],
)
def test_tiny_checkpoint_matches_transformers(tmp_path: Path, overrides: dict[str, object]) -> None:
    hf_model = save_tiny_llama(tmp_path, **overrides)
    assert (tmp_path / "model.safetensors.index.json").exists()  # sharded
    tokens = torch.randint(0, 96, (40,), generator=torch.Generator().manual_seed(1)).tolist()

    ours = load_model(resolve_model(str(tmp_path)), LlamaForCausalLM, TorchAttentionBackend, torch.float32)
    logits = PagedRun(ours, [[4, 0, 6]]).step([tokens])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]

    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_missing_weight_is_named(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    save_tiny_llama(tmp_path)
    for shard in tmp_path.glob("*.safetensors"):
        tensors = load_file(str(shard))
        if tensors.pop("model.layers.1.self_attn.k_proj.weight", None) is not None:
            save_file(tensors, str(shard), metadata={"format": "pt"})

    with pytest.raises(ModelLoadError, match=r"no weights for model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        load_model(resolve_model(str(tmp_path)), LlamaForCausalLM, TorchAttentionBackend, torch.float32)


def test_unsupported_rope_type(tmp_path: Path) -> None:
    save_tiny_llama(
        tmp_path,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    )
    with pytest.raises(
        ModelLoadError,
        match="rope_type='dynamic' is not supported by vframe's rotary embedding; "
        "supported: 'default', 'linear', 'llama3', 'yarn'",
    ):
        load_model(resolve_model(str(tmp_path)), LlamaForCausalLM, TorchAttentionBackend, torch.float32)
