"""vframe's Qwen2 and Qwen3 give what transformers gives, windows included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from parity import assert_engine_matches_transformers, prompts_of_lengths
from test_llama import PagedRun
from tiny_qwen import TINY, VOCAB, save_tiny_qwen

from vframe.backends.torch_attn import TorchAttentionBackend
from vframe.core.kv_cache_spec import FullAttentionSpec, SlidingWindowSpec
from vframe.errors import ModelLoadError
from vframe.models.config import ModelConfig
from vframe.models.loader import load_model, resolve_model
from vframe.models.qwen import ARCHITECTURES, Qwen2ForCausalLM, Qwen3ForCausalLM, sliding_windows
from vframe.plugins import get_registry

PROMPT_LENGTHS = [5, 23, 37, 12]


def qkv_biases(hf_model: torch.nn.Module, layer: int) -> torch.Tensor:  # [(H + 2 * KVH) * D]
    attn = hf_model.model.layers[layer].self_attn
    return torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias])


def test_architectures_registered() -> None:
    registry = get_registry("model")

    assert ARCHITECTURES == ["Qwen2ForCausalLM", "Qwen3ForCausalLM"]
    assert registry.load("Qwen2ForCausalLM") is Qwen2ForCausalLM
    assert registry.load("Qwen3ForCausalLM") is Qwen3ForCausalLM


# --------------------------------------------------------------------------- #
# Qwen2: q/k/v biases
# --------------------------------------------------------------------------- #


def test_qwen2_loads_qkv_biases_and_no_o_proj_bias(tmp_path: Path) -> None:
    hf_model = save_tiny_qwen(tmp_path, "Qwen2")

    ours = load_model(resolve_model(str(tmp_path)), Qwen2ForCausalLM, TorchAttentionBackend, torch.float32)

    for i, layer in enumerate(ours.model.layers):
        assert torch.equal(layer.self_attn.qkv_proj.bias, qkv_biases(hf_model, i))
        assert layer.self_attn.qkv_proj.bias.abs().min() > 0
        assert layer.self_attn.o_proj.bias is None
        assert layer.mlp.down_proj.bias is None


def test_qwen2_prefill_logits_match_transformers(tmp_path: Path) -> None:
    hf_model = save_tiny_qwen(tmp_path, "Qwen2")
    tokens = prompts_of_lengths(VOCAB, [40])[0]

    ours = load_model(resolve_model(str(tmp_path)), Qwen2ForCausalLM, TorchAttentionBackend, torch.float32)
    logits = PagedRun(ours, [[4, 0, 6]]).step([tokens])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]

    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_qwen2_engine_matches_transformers(tmp_path: Path) -> None:
    hf_model = save_tiny_qwen(tmp_path, "Qwen2")
    prompts = prompts_of_lengths(VOCAB, PROMPT_LENGTHS, shared_prefix=4)

    assert_engine_matches_transformers(tmp_path, hf_model, prompts, max_tokens=8, num_blocks=14)


# --------------------------------------------------------------------------- #
# Qwen3: per-head q/k norms, head_dim != hidden / heads
# --------------------------------------------------------------------------- #


def test_qwen3_prefill_logits_match_transformers(tmp_path: Path) -> None:
    hf_model = save_tiny_qwen(tmp_path, "Qwen3", head_dim=24, attention_bias=True)
    with torch.no_grad():  # norms start at one: make them matter
        for layer in hf_model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    hf_model.save_pretrained(str(tmp_path))
    tokens = prompts_of_lengths(VOCAB, [40])[0]

    ours = load_model(resolve_model(str(tmp_path)), Qwen3ForCausalLM, TorchAttentionBackend, torch.float32)
    logits = PagedRun(ours, [[4, 0, 6]]).step([tokens])
    with torch.inference_mode():
        expected = hf_model(torch.tensor([tokens])).logits[0]

    assert ours.model.layers[0].self_attn.head_dim == 24
    assert ours.model.layers[0].self_attn.o_proj.bias is not None  # attention_bias covers o_proj too
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-4)


def test_qwen3_engine_matches_transformers(tmp_path: Path) -> None:
    hf_model = save_tiny_qwen(tmp_path, "Qwen3", head_dim=24, tie_word_embeddings=True)
    prompts = prompts_of_lengths(VOCAB, PROMPT_LENGTHS, shared_prefix=4)

    assert_engine_matches_transformers(tmp_path, hf_model, prompts, max_tokens=8, num_blocks=14)


# --------------------------------------------------------------------------- #
# Windows: only with use_sliding_window, only on the layers transformers picks
# --------------------------------------------------------------------------- #

WINDOWS = [
    # Released checkpoints: a window value, use_sliding_window off.
    ({"sliding_window": 32768, "max_window_layers": 1}, [None, None]),
    ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}, [None, 8]),
    ({"use_sliding_window": True, "max_window_layers": 0}, [4096, 4096]),  # the default window
    ({"use_sliding_window": True, "sliding_window": 8, "layer_types": ["sliding_attention", "attention"]}, [8, None]),
    # layer_types alone turns on no window.
    ({"sliding_window": 8, "layer_types": ["sliding_attention", "sliding_attention"]}, [None, None]),
]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
@pytest.mark.parametrize(("fields", "expected"), WINDOWS, ids=[str(w) for w, _ in WINDOWS])
def test_windows_match_transformers(
    tmp_path: Path, model_type: str, fields: dict[str, object], expected: list[int | None]
) -> None:
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **TINY, **fields}))
    ref = AutoConfig.from_pretrained(str(tmp_path))
    ours = ModelConfig.from_file(tmp_path / "config.json")
    model_cls = Qwen2ForCausalLM if model_type == "qwen2" else Qwen3ForCausalLM
    specs = model_cls(ours, TorchAttentionBackend, torch.float32).get_kv_cache_specs(4, torch.float32)

    ref_windows = [ref.sliding_window if t == "sliding_attention" else None for t in ref.layer_types]
    assert ref_windows == expected
    assert sliding_windows(ours) == expected
    assert [getattr(spec, "sliding_window", None) for spec in specs] == expected
    assert [type(spec) for spec in specs] == [FullAttentionSpec if w is None else SlidingWindowSpec for w in expected]


@pytest.mark.parametrize("model_type", ["qwen2", "qwen3"])
def test_window_fields_default_as_in_transformers(model_type: str) -> None:
    from transformers import AutoConfig

    ref = AutoConfig.for_model(model_type, use_sliding_window=True)
    ours = ModelConfig({"model_type": model_type, "use_sliding_window": True})

    assert (ours.sliding_window, ours.max_window_layers) == (ref.sliding_window, ref.max_window_layers) == (4096, 28)
    assert ModelConfig({"model_type": model_type}).use_sliding_window is False


def test_windowed_upper_layer_engine_matches_transformers(tmp_path: Path) -> None:
    hf_model = save_tiny_qwen(tmp_path, "Qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    prompts = prompts_of_lengths(VOCAB, PROMPT_LENGTHS, shared_prefix=4)

    assert_engine_matches_transformers(tmp_path, hf_model, prompts, max_tokens=8, num_blocks=14)


def test_unknown_layer_type_is_refused(tmp_path: Path) -> None:
    config = ModelConfig({"model_type": "qwen3", **TINY, "layer_types": ["full_attention", "chunked_attention"]})

    with pytest.raises(ModelLoadError, match="'layer_types': .*chunked_attention.* num_hidden_layers=2 entries"):
        Qwen3ForCausalLM(config, TorchAttentionBackend, torch.float32)
