"""GGUF files of every architecture vframe reads from llama.cpp's format: Llama (the embedded
SmolLM2, tests/models/test_loader.py), Mixtral (``llama`` with experts), Qwen2, Qwen3 and
DeepSeek-V2 / V3 (``deepseek2``).

Each file here is written from a tiny random transformers model in llama.cpp's own layout
(``write_gguf``: its metadata keys, tensor names, q / k rows reordered for Llama's interleaved
rotary, Mixtral's experts merged into one ``[experts, out, in]`` tensor per projection or one
tensor each as older files have them), the linear weights rounded through Q8_0 by the ``gguf``
package and the transformers model given the rounded weights, so that it computes exactly what
the file holds. vframe serves the file both ways, dequantized on load and kept quantized
(``quantization="gguf"``), and must give transformers' tokens and logprobs
(``parity.assert_engine_matches_transformers``: prefix caching, chunked prefill, preemption).
``make test-quant`` converts tiny models with llama.cpp's own converter
(tests/quant_real/test_real_checkpoints.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import ExpertGatingFuncType, GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize, quantize
from gguf_files import add_toy_vocabulary, write_out
from parity import assert_engine_matches_transformers, prompts_of_lengths
from test_mixtral import tiny_hf_mixtral
from tiny_qwen import save_tiny_qwen

from vframe import LLM
from vframe.errors import ModelLoadError

PROMPT_LENGTHS = [5, 23, 37, 12]


def _rounded(param: torch.Tensor, ggml_type: GGMLQuantizationType) -> np.ndarray:
    """``param`` ([..., out, in]) as ``ggml_type`` blocks (uint8 [..., out, row bytes]); ``param``
    itself replaced by their dequantization, so the model holds what the file holds."""
    weight = param.detach().float().numpy()
    blocks = quantize(weight, ggml_type)
    with torch.no_grad():
        param.copy_(torch.from_numpy(dequantize(blocks, ggml_type)))
    return blocks


def _permuted(rows: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's q / k row order for Llama: the two rotary halves of each head interleaved."""
    return rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def write_gguf(path: Path, hf_model: torch.nn.Module, arch: str, *, merged_experts: bool = True,
               linear_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> None:
    """``hf_model`` (Llama, Mixtral, Qwen2 or Qwen3 from transformers) as llama.cpp writes it:
    ``general.architecture`` ``arch``, every linear weight and an untied LM head rounded through
    ``linear_type`` (in ``hf_model`` too), norms, biases, the router and the embedding in float32,
    and a toy byte vocabulary."""
    config = hf_model.config
    model = hf_model.model
    writer = GGUFWriter(str(path), arch)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if arch == "qwen3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    else:
        writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    num_experts = getattr(config, "num_local_experts", 0)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    add_toy_vocabulary(writer, config.vocab_size)

    def add(name: str, param: torch.Tensor, *, quantized: bool = False, heads: int | None = None) -> None:
        if quantized:
            blocks = _rounded(param, linear_type)
            writer.add_tensor(name, _permuted(blocks, heads) if heads else blocks, raw_dtype=linear_type)
        else:
            values = param.detach().float().numpy()
            writer.add_tensor(name, _permuted(values, heads) if heads else values)

    add("token_embd.weight", model.embed_tokens.weight)
    add("output_norm.weight", model.norm.weight)
    if not config.tie_word_embeddings:
        add("output.weight", hf_model.lm_head.weight, quantized=True)
    permuted = arch == "llama"
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        for kind, proj, heads in (("attn_q", attn.q_proj, config.num_attention_heads),
                                  ("attn_k", attn.k_proj, config.num_key_value_heads),
                                  ("attn_v", attn.v_proj, None), ("attn_output", attn.o_proj, None)):
            add(f"blk.{i}.{kind}.weight", proj.weight, quantized=True, heads=heads if permuted else None)
            if proj.bias is not None:
                add(f"blk.{i}.{kind}.bias", proj.bias, heads=heads if permuted else None)
        if hasattr(attn, "q_norm"):
            add(f"blk.{i}.attn_q_norm.weight", attn.q_norm.weight)
            add(f"blk.{i}.attn_k_norm.weight", attn.k_norm.weight)
        mlp = layer.mlp
        if not hasattr(mlp, "experts"):
            for kind, proj in (("ffn_gate", mlp.gate_proj), ("ffn_up", mlp.up_proj), ("ffn_down", mlp.down_proj)):
                add(f"blk.{i}.{kind}.weight", proj.weight, quantized=True)
            continue
        add(f"blk.{i}.ffn_gate_inp.weight", mlp.gate.weight)
        inter = config.intermediate_size
        gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj  # [E, 2I, H] (gate rows, then up), [E, H, I]
        for kind, param in (("ffn_gate", gate_up[:, :inter]), ("ffn_up", gate_up[:, inter:]), ("ffn_down", down)):
            blocks = _rounded(param, linear_type)  # a view: rounds the model's own experts
            if merged_experts:
                writer.add_tensor(f"blk.{i}.{kind}_exps.weight", blocks, raw_dtype=linear_type)
            else:
                for e in range(num_experts):
                    writer.add_tensor(f"blk.{i}.{kind}.{e}.weight", blocks[e], raw_dtype=linear_type)
    write_out(writer)


def write_deepseek_gguf(path: Path, hf_model: torch.nn.Module, *, split_kv_b: bool = True,
                        linear_type: GGMLQuantizationType = GGMLQuantizationType.Q8_0) -> None:
    """A transformers DeepSeek-V2 / V3 as llama.cpp's converter writes it (``deepseek2``): MLA as one
    key / value head of ``kv_lora_rank + rope`` (the per-head sizes in ``*_length_mla``),
    ``kv_b_proj`` split per head into ``attn_k_b`` (transposed: ``[heads, kv_lora_rank, qk_nope]``)
    and ``attn_v_b``, or whole as ``attn_kv_b`` (``split_kv_b=False``: files from before 2025), the
    routed experts merged, the shared ones ``*_shexp``, V3's correction bias ``exp_probs_b``; matrices
    rounded through ``linear_type`` (in ``hf_model`` too) but the routers, kept in float32."""
    config = hf_model.config
    model = hf_model.model
    v3 = config.model_type == "deepseek_v3"
    writer = GGUFWriter(str(path), "deepseek2")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    writer.add_leading_dense_block_count(config.first_k_dense_replace)
    writer.add_vocab_size(config.vocab_size)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_count(config.n_routed_experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_group_count(config.n_group)
    writer.add_expert_group_used_count(config.topk_group)
    if config.norm_topk_prob:
        writer.add_expert_weights_norm(True)
    if v3:
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    add_toy_vocabulary(writer, config.vocab_size)

    def add(name: str, param: torch.Tensor, *, quantized: bool = False) -> None:
        if quantized:
            writer.add_tensor(name, _rounded(param, linear_type), raw_dtype=linear_type)
        else:
            writer.add_tensor(name, param.detach().float().numpy())

    add("token_embd.weight", model.embed_tokens.weight)
    add("output_norm.weight", model.norm.weight)
    add("output.weight", hf_model.lm_head.weight, quantized=True)
    nope = config.qk_nope_head_dim
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight)
        if config.q_lora_rank is None:
            add(f"blk.{i}.attn_q.weight", attn.q_proj.weight, quantized=True)
        else:
            add(f"blk.{i}.attn_q_a.weight", attn.q_a_proj.weight, quantized=True)
            add(f"blk.{i}.attn_q_a_norm.weight", attn.q_a_layernorm.weight)
            add(f"blk.{i}.attn_q_b.weight", attn.q_b_proj.weight, quantized=True)
        add(f"blk.{i}.attn_kv_a_mqa.weight", attn.kv_a_proj_with_mqa.weight, quantized=True)
        add(f"blk.{i}.attn_kv_a_norm.weight", attn.kv_a_layernorm.weight)
        if split_kv_b:
            kv_b = attn.kv_b_proj.weight.view(config.num_attention_heads, nope + config.v_head_dim, -1)
            k_b = kv_b[:, :nope].transpose(1, 2).contiguous()  # [H, R, dn]
            add(f"blk.{i}.attn_k_b.weight", k_b, quantized=True)
            with torch.no_grad():
                kv_b[:, :nope] = k_b.transpose(1, 2)  # the rounded values, back in place
            add(f"blk.{i}.attn_v_b.weight", kv_b[:, nope:], quantized=True)  # a view: rounded in place
        else:
            add(f"blk.{i}.attn_kv_b.weight", attn.kv_b_proj.weight, quantized=True)
        add(f"blk.{i}.attn_output.weight", attn.o_proj.weight, quantized=True)
        if not hasattr(mlp, "experts"):
            for kind, proj in (("ffn_gate", mlp.gate_proj), ("ffn_up", mlp.up_proj), ("ffn_down", mlp.down_proj)):
                add(f"blk.{i}.{kind}.weight", proj.weight, quantized=True)
            continue
        add(f"blk.{i}.ffn_gate_inp.weight", mlp.gate.weight)
        if v3:
            writer.add_tensor(f"blk.{i}.exp_probs_b.bias", mlp.gate.e_score_correction_bias.float().numpy())
        inter = config.moe_intermediate_size
        gate_up, down = mlp.experts.gate_up_proj, mlp.experts.down_proj
        for kind, param in (("ffn_gate", gate_up[:, :inter]), ("ffn_up", gate_up[:, inter:]), ("ffn_down", down)):
            writer.add_tensor(f"blk.{i}.{kind}_exps.weight", _rounded(param, linear_type), raw_dtype=linear_type)
        shared = mlp.shared_experts
        for kind, proj in (("ffn_gate", shared.gate_proj), ("ffn_up", shared.up_proj), ("ffn_down", shared.down_proj)):
            add(f"blk.{i}.{kind}_shexp.weight", proj.weight, quantized=True)
    write_out(writer)


def tiny_hf_deepseek(version: str) -> torch.nn.Module:
    """transformers' DeepSeek-V2 (q uncompressed, softmax routing within the best of 2 groups) or
    V3 (q compressed, sigmoid routing with a random correction bias, a dense first layer), random,
    every size a multiple of Q8_0's 32."""
    import transformers

    tiny = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=8,
                num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32, intermediate_size=96,
                max_position_embeddings=256, initializer_range=0.1)
    if version == "V3":
        config = transformers.DeepseekV3Config(**tiny, q_lora_rank=32, n_group=2, topk_group=1,
                                               first_k_dense_replace=1, routed_scaling_factor=1.7)
    else:
        config = transformers.DeepseekV2Config(**tiny, q_lora_rank=None, topk_method="group_limited_greedy",
                                               n_group=2, topk_group=1, routed_scaling_factor=1.3)
    torch.manual_seed(0)
    hf_model = getattr(transformers, f"Deepseek{version}ForCausalLM")(config).eval()
    with torch.no_grad():
        for layer in hf_model.model.layers:
            if version == "V3" and hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.5)
    return hf_model


@pytest.mark.parametrize(("version", "quantization", "split_kv_b"),
                         [("V3", None, True), ("V3", "gguf", True), ("V2", "gguf", True), ("V2", None, False),
                          ("V2", "gguf", False)])
def test_a_deepseek_gguf_serves_as_transformers(version: str, quantization: str | None, split_kv_b: bool,
                                                tmp_path: Path, gguf_cache: Path) -> None:
    """DeepSeek-V2 / V3 as llama.cpp writes them (``deepseek2``, ``write_deepseek_gguf``), dense and
    kept quantized: the routed experts GGUF layers of QuantizedExperts, ``kv_b_proj`` joined from
    ``attn_k_b`` / ``attn_v_b`` into a float32 layer (MLA reads it as a tensor)."""
    hf_model = tiny_hf_deepseek(version)
    path = tmp_path / f"tiny-deepseek-{version}.gguf"
    write_deepseek_gguf(path, hf_model, split_kv_b=split_kv_b)
    prompts = prompts_of_lengths(hf_model.config.vocab_size, PROMPT_LENGTHS, shared_prefix=4)

    llm = assert_engine_matches_transformers(path, hf_model, prompts, num_blocks=14, quantization=quantization)

    model = llm.llm_engine.model_runner.model
    assert model.config.architectures == [f"Deepseek{version}ForCausalLM"]
    assert (model.config.qk_nope_head_dim, model.config.v_head_dim, model.config.num_key_value_heads) == (32, 32, 4)
    attn = model.model.layers[1].self_attn
    expected = hf_model.model.layers[1].self_attn.kv_b_proj.weight
    torch.testing.assert_close(attn.kv_b_weight().float(), expected, rtol=0, atol=0)
    if quantization:
        experts = model.model.layers[1].mlp.experts
        assert {type(getattr(e, n).quant_method).__name__ for e in experts for n in ("gate_proj", "down_proj")} == {
            "GGUFLinearMethod"}
        joined = GGMLQuantizationType.F32 if split_kv_b else GGMLQuantizationType.Q8_0  # joined, or the file's own
        assert [int(t) for t in attn.kv_b_proj.qweight_type] == [joined]


@pytest.mark.parametrize("quantization", [None, "gguf"])
@pytest.mark.parametrize("family", ["Qwen2", "Qwen3"])
def test_a_qwen_gguf_serves_as_transformers(family: str, quantization: str | None, tmp_path: Path,
                                            gguf_cache: Path) -> None:
    """Qwen2 (random q / k / v biases) and Qwen3 (per-head q / k norms, head_dim 24 where
    hidden / heads is 16): rows in their own order (llama.cpp reorders only Llama's)."""
    overrides = {"head_dim": 24} if family == "Qwen3" else {}
    hf_model = save_tiny_qwen(tmp_path / "hf", family, intermediate_size=96, **overrides)  # Q8_0: rows of 32
    path = tmp_path / f"tiny-{family.lower()}.gguf"
    write_gguf(path, hf_model, family.lower())
    prompts = prompts_of_lengths(hf_model.config.vocab_size, PROMPT_LENGTHS, shared_prefix=4)

    llm = assert_engine_matches_transformers(path, hf_model, prompts, num_blocks=14, quantization=quantization)

    config = llm.llm_engine.model_runner.model.config
    assert config.architectures == [f"{family}ForCausalLM"]
    assert config.head_dim == (24 if family == "Qwen3" else 16)
    layer = llm.llm_engine.model_runner.model.model.layers[0]
    method = type(layer.self_attn.qkv_proj.quant_method).__name__
    assert method == ("GGUFLinearMethod" if quantization else "UnquantizedLinearMethod")


@pytest.mark.parametrize(("quantization", "merged"), [(None, True), ("gguf", True), ("gguf", False)])
def test_a_mixtral_gguf_serves_as_transformers(quantization: str | None, merged: bool, tmp_path: Path,
                                               gguf_cache: Path) -> None:
    """Mixtral as llama.cpp writes it: architecture ``llama`` with ``llama.expert_count``, the
    router ``ffn_gate_inp``, the experts merged (``ffn_gate_exps``: [experts, out, in]) or one
    tensor each (``ffn_gate.<e>``, older files); kept quantized, each expert's projections are
    GGUF layers of vframe's QuantizedExperts."""
    hf_model = tiny_hf_mixtral()
    path = tmp_path / "tiny-mixtral.gguf"
    write_gguf(path, hf_model, "llama", merged_experts=merged)
    prompts = prompts_of_lengths(hf_model.config.vocab_size, PROMPT_LENGTHS, shared_prefix=4)

    llm = assert_engine_matches_transformers(path, hf_model, prompts, num_blocks=14, quantization=quantization)

    config = llm.llm_engine.model_runner.model.config
    assert config.architectures == ["MixtralForCausalLM"]
    assert (config.num_local_experts, config.num_experts_per_tok) == (4, 2)
    experts = llm.llm_engine.model_runner.model.model.layers[1].mlp.experts
    if quantization:
        assert type(experts).__name__ == "QuantizedExperts" and len(experts) == 4
        assert {type(getattr(e, n).quant_method).__name__ for e in experts for n in ("w1", "w2", "w3")} == {
            "GGUFLinearMethod"}
        assert {int(t) for e in experts for t in e.w2.qweight_type} == {GGMLQuantizationType.Q8_0}
    else:
        assert type(experts).__name__ == "FusedMoE"


def test_experts_in_a_gguf_architecture_without_a_moe_model_are_refused(tmp_path: Path, gguf_cache: Path) -> None:
    hf_model = save_tiny_qwen(tmp_path / "hf", "Qwen2", intermediate_size=96)
    path = tmp_path / "qwen2-experts.gguf"
    hf_model.config.num_local_experts, hf_model.config.num_experts_per_tok = 4, 2  # only the metadata: no experts
    write_gguf(path, hf_model, "qwen2")

    with pytest.raises(ModelLoadError, match=r"GGUF 'qwen2' with qwen2.expert_count=4: vframe reads experts in "
                                             r"GGUF files of \['deepseek2', 'llama'\] only"):
        LLM(str(path))
