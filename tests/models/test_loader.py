"""Resolving and reading models: the embedded GGUF, its cache, and every refusal."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_files import write_out

from vframe.errors import ModelLoadError
from vframe.models.loader import (
    ResolvedModel,
    architecture,
    iterate_weights,
    load_hf_config,
    load_tokenizer,
    resolve_model,
)
from vframe.models.loader import gguf as gguf_loader


def test_embedded_default_resolves_to_converted_smollm2(smollm: ResolvedModel, vframe_cache_dir: Path) -> None:
    assert smollm.gguf_file.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm.source == smollm.gguf_file
    assert smollm.model_dir.parent == vframe_cache_dir / "gguf"
    assert smollm.weight_files == (smollm.model_dir / "model.safetensors",)
    assert architecture(smollm) == "LlamaForCausalLM"

    config = load_hf_config(smollm)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (576, 1536, 30)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert config.tie_word_embeddings is True
    assert (config.bos_token_id, config.eos_token_id) == (1, 2)


def test_gguf_tensors_equal_transformers_reading(smollm: ResolvedModel, hf_smollm: torch.nn.Module) -> None:
    expected = hf_smollm.state_dict()
    ours = dict(iterate_weights(smollm))

    assert set(ours) == set(expected) - {"lm_head.weight"}  # tied to the embedding
    for name in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.7.mlp.down_proj.weight",
        "model.norm.weight",
    ):
        assert torch.equal(ours[name], expected[name]), name
    # The comparison above proves the un-permutation: without it q_proj differs.
    q = ours["model.layers.0.self_attn.q_proj.weight"].numpy()
    permuted = q.reshape(9, 2, 32, 576).swapaxes(1, 2).reshape(q.shape)
    assert not np.array_equal(permuted, q)
    assert np.array_equal(gguf_loader.unpermute_qk(permuted, 9), q)


def test_second_resolve_hits_the_cache(
    smollm: ResolvedModel, vframe_cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf_loader, "convert_gguf", fail)
    assert resolve_model(None, cache_dir=vframe_cache_dir) == smollm


def test_tokenizer_saved_with_the_conversion(smollm: ResolvedModel) -> None:
    tokenizer = load_tokenizer(smollm)

    assert tokenizer("Hello, world!").input_ids == [19556, 28, 905, 17]
    assert tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt


def test_interrupted_conversion_leaves_no_cache(
    smollm: ResolvedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def killed(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_loader, "gguf_to_hf_tensors", lambda reader, config: iter([]))
    monkeypatch.setattr("transformers.AutoTokenizer.from_pretrained", killed)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(str(smollm.gguf_file), cache_dir=tmp_path)
    assert list((tmp_path / "gguf").iterdir()) == []


def test_missing_path_is_not_downloaded() -> None:
    with pytest.raises(ModelLoadError, match="does not download"):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct")


def test_directory_without_config(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_pickled_weights_are_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelLoadError, match="never loads pickled weights; convert to safetensors"):
        resolve_model(str(tmp_path))


def test_corrupt_safetensors_header(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="corrupt safetensors") as info:
        resolve_model(str(tmp_path))
    assert str(tmp_path / "model.safetensors") in str(info.value)


def test_truncated_gguf(smollm: ResolvedModel, tmp_path: Path) -> None:
    truncated = tmp_path / "half.gguf"
    with open(smollm.gguf_file, "rb") as f:
        truncated.write_bytes(f.read(smollm.gguf_file.stat().st_size // 2))
    with pytest.raises(ModelLoadError, match="truncated or corrupt GGUF") as info:
        resolve_model(str(truncated), cache_dir=tmp_path / "cache")
    assert str(truncated) in str(info.value)
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").iterdir())


def test_unknown_gguf_architecture(tmp_path: Path) -> None:
    import gguf

    path = tmp_path / "tiny-gemma.gguf"
    writer = gguf.GGUFWriter(str(path), arch="gemma2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    write_out(writer)

    with pytest.raises(ModelLoadError, match="general.architecture='gemma2' is not supported"):
        resolve_model(str(path), cache_dir=tmp_path / "cache")


def test_config_without_architectures(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"x": torch.zeros(2)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="no 'architectures'"):
        architecture(resolve_model(str(tmp_path)))


def test_hf_tensor_names() -> None:
    assert gguf_loader.hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_loader.hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert gguf_loader.hf_tensor_name("output.weight") == "lm_head.weight"
    assert gguf_loader.hf_tensor_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight"
    router, expert = "blk.2.ffn_gate_inp.weight", "blk.2.ffn_down.7.weight"  # older files: one tensor an expert
    assert gguf_loader.hf_tensor_name(router, "mixtral") == "model.layers.2.block_sparse_moe.gate.weight"
    assert gguf_loader.hf_tensor_name(expert, "mixtral") == "model.layers.2.block_sparse_moe.experts.7.w2.weight"
    assert gguf_loader.hf_tensor_name(router, "deepseek_v3") == "model.layers.2.mlp.gate.weight"
    assert gguf_loader.hf_tensor_name(expert, "deepseek_v3") == "model.layers.2.mlp.experts.7.down_proj.weight"
    assert (gguf_loader.hf_tensor_name("blk.2.exp_probs_b.bias", "deepseek_v3")
            == "model.layers.2.mlp.gate.e_score_correction_bias")
    mqa = "model.layers.2.self_attn.kv_a_proj_with_mqa.weight"
    assert gguf_loader.hf_tensor_name("blk.2.attn_kv_a_mqa.weight") == mqa
    with pytest.raises(ModelLoadError, match="belongs to a mixture of experts, which a 'llama' model has not"):
        gguf_loader.hf_tensor_name(router, "llama")
    with pytest.raises(ModelLoadError, match="blk.0.attn_qkv.weight"):
        gguf_loader.hf_tensor_name("blk.0.attn_qkv.weight")


def test_weights_are_views_of_the_mapped_file_equal_to_safetensors_own_reading(tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    generator = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16_odd": torch.randn(3, 5, generator=generator).to(torch.bfloat16),  # 30 bytes: what follows is unaligned
        "b.f32": torch.randn(7, 4, generator=generator),
        "c.f16": torch.randn(9, generator=generator).half(),
        "d.i32": torch.arange(-5, 6, dtype=torch.int32),
        "e.u8": torch.arange(0, 200, 7, dtype=torch.uint8),
        "f.fp8": torch.randn(4, 4, generator=generator).to(torch.float8_e4m3fn),
        "g.bool": torch.tensor([True, False, True]),
        "h.empty": torch.empty(0, 3),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    reference = load_file(str(path))

    ours = dict(iterate_weights(ResolvedModel(source=tmp_path, model_dir=tmp_path, weight_files=(path,))))

    assert sorted(ours) == sorted(tensors)
    for name, tensor in ours.items():
        assert tensor.dtype == reference[name].dtype and tensor.shape == reference[name].shape, name
        assert torch.equal(tensor.view(torch.uint8), reference[name].view(torch.uint8)), name
    # Views of one mapping of the file, not copies (the rows a tensor-parallel rank
    # keeps are all it reads): their addresses lie as far apart as their data in the file.
    header = json.loads(path.read_bytes()[8 : 8 + int.from_bytes(path.read_bytes()[:8], "little")])
    offset = {name: entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}
    for name in ("b.f32", "c.f16", "g.bool"):
        assert ours[name].data_ptr() - ours["a.bf16_odd"].data_ptr() == offset[name] - offset["a.bf16_odd"], name


def test_safetensors_whose_offsets_do_not_hold_the_shape_are_refused(tmp_path: Path) -> None:
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    resolved = ResolvedModel(source=tmp_path, model_dir=tmp_path, weight_files=(path,))
    with pytest.raises(ModelLoadError) as info:
        list(iterate_weights(resolved))
    assert str(info.value) == (
        f"{path}: corrupt safetensors file (tensor 'w': data_offsets [0, 60] do not hold shape [4, 4])"
    )


@pytest.mark.parametrize("leaf", ["k_scale", "v_scale", "kv_scale"])
def test_a_kv_cache_scale_needs_an_attention_layer_on_its_path(leaf: str) -> None:
    """KV-cache scales go to the attention impl of their layer (tests/backends/test_fp8_kv_scales.py);
    in a model without one on the name's path they have no place."""
    from vframe.models.loader.weights import load_named_weights

    model = torch.nn.Linear(2, 2)
    with pytest.raises(ModelLoadError) as info:
        load_named_weights(model, [(f"model.layers.0.self_attn.{leaf}", torch.tensor(0.5))])
    assert str(info.value) == (
        f"checkpoint tensor 'model.layers.0.self_attn.{leaf}' is a KV-cache scale with no attention layer on its "
        "path in Linear"
    )
    with pytest.raises(ModelLoadError, match=r"^checkpoint tensor 'lm_head.scale' has no place in Linear$"):
        load_named_weights(model, [("lm_head.scale", torch.tensor(0.5))])
