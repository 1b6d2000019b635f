"""Convert a llama.cpp GGUF file, once, into a Hugging Face-layout directory.

The result holds ``config.json``, ``model.safetensors`` (dequantized to
float32, so both float32 and bfloat16 runs are exact; left out for
``quantization="gguf"``, which reads the file's blocks) and the tokenizer. It is
written into a temporary directory and renamed into place, so a killed
process never leaves a half-written cache.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vframe.errors import ModelLoadError

logger = logging.getLogger(__name__)

# llama.cpp's general.architecture -> the model vframe builds; "llama" with experts
# (``llama.expert_count``) is Mixtral, as llama.cpp's converter writes it; "deepseek2" is
# DeepSeek-V2 or, with sigmoid routing, V3 (``_deepseek2_config``).
SUPPORTED_ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "deepseek2": "DeepseekV2ForCausalLM",
}
_MOE_ARCHITECTURES = {"llama": "MixtralForCausalLM", "deepseek2": "DeepseekV2ForCausalLM"}
# Models whose q / k rows llama.cpp's converter reorders for its interleaved rotary
# embedding (``unpermute_qk``); Qwen's use the rotate-half layout, which it keeps.
_PERMUTED_QK_MODEL_TYPES = ("llama", "mixtral")

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Per layer: GGUF tensor kind -> Hugging Face module.
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "attn_q_a": "self_attn.q_a_proj",  # DeepSeek's MLA
    "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj",
    "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm",
    "attn_kv_b": "self_attn.kv_b_proj",  # files before llama.cpp split it (_LATENT_SPLIT)
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_gate_shexp": "mlp.shared_experts.gate_proj",  # DeepSeek's shared experts
    "ffn_up_shexp": "mlp.shared_experts.up_proj",
    "ffn_down_shexp": "mlp.shared_experts.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
# The linear layers among them, kept as blocks by quantization="gguf" (as are the experts').
_LINEAR_KINDS = frozenset({
    "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_a", "attn_q_b", "attn_kv_a_mqa", "attn_kv_b",
    "ffn_gate", "ffn_up", "ffn_down", "ffn_gate_shexp", "ffn_up_shexp", "ffn_down_shexp",
})
# A mixture-of-experts layer as each model names it: the block that holds the router
# (GGUF ``ffn_gate_inp``) and the experts, and an expert's gate, up and down projections.
# llama.cpp merges the experts into one [experts, out, in] tensor per projection
# (``blk.3.ffn_gate_exps.weight``, since 2024); older files hold one tensor each
# (``blk.3.ffn_gate.5.weight``).
_MOE_NAMES = {
    "mixtral": ("block_sparse_moe", {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}),
    "deepseek_v2": ("mlp", {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}),
    "deepseek_v3": ("mlp", {"ffn_gate": "gate_proj", "ffn_up": "up_proj", "ffn_down": "down_proj"}),
}
_MERGED_EXPERTS = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)_exps\.weight")
_ONE_EXPERT = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")
_ROUTER = re.compile(r"blk\.(\d+)\.ffn_gate_inp\.weight")
_ROUTER_BIAS = re.compile(r"blk\.(\d+)\.exp_probs_b\.bias")  # DeepSeek-V3's e_score_correction_bias
# DeepSeek's kv_b_proj as llama.cpp writes it since 2025, split for its absorbed attention:
# ``attn_k_b`` [heads, kv_lora_rank, qk_nope] (transposed) and ``attn_v_b`` [heads, v_head, kv_lora_rank].
_LATENT_SPLIT = re.compile(r"blk\.(\d+)\.attn_(k|v)_b\.weight")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling factors, folded into the config
_REQUIRED = object()


def convert_gguf(gguf_path: Path, out_dir: Path, *, weights: bool = True) -> None:
    """Write the Hugging Face-layout conversion of ``gguf_path`` to ``out_dir``;
    ``weights=False``: only ``config.json`` and the tokenizer."""
    from safetensors.torch import save_file

    reader = open_gguf(gguf_path)
    architecture = read_field(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_path}: GGUF general.architecture={architecture!r} is not supported; "
            f"vframe reads GGUF files of: {sorted(SUPPORTED_ARCHITECTURES)} (llama with experts: Mixtral; "
            "deepseek2: DeepSeek-V2 / V3)"
        )
    logger.info("converting %s into %s (first load only)", gguf_path, out_dir)
    config = gguf_to_hf_config(reader, architecture)
    tensors = dict(gguf_to_hf_tensors(reader, config)) if weights else None

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=out_dir.parent))
    try:
        config.save_pretrained(tmp)
        if tensors is not None:
            save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        tokenizer = _gguf_tokenizer(gguf_path, architecture)
        tokenizer.save_pretrained(str(tmp))
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").exists():
                raise
            shutil.rmtree(tmp)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# transformers reads no config of these, so its AutoTokenizer refuses their files; its
# tokenizer builders read llama.cpp's vocabulary the same whatever the architecture.
_TOKENIZER_WITHOUT_CONFIG = ("deepseek2",)


def _gguf_tokenizer(gguf_path: Path, architecture: str) -> Any:
    """The file's tokenizer, built by transformers from its ``tokenizer.ggml.*`` keys."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    tokenizer_class = PreTrainedTokenizerFast if architecture in _TOKENIZER_WITHOUT_CONFIG else AutoTokenizer
    return tokenizer_class.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def open_gguf(path: Path) -> Any:
    """A ``gguf.GGUFReader`` over ``path``; a truncated or corrupt file raises ModelLoadError."""
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError, IndexError, ... on bad bytes
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from e
    file_size = path.stat().st_size
    for t in reader.tensors:
        if t.data_offset + t.n_bytes > file_size:
            raise ModelLoadError(f"{path}: truncated GGUF file (tensor {t.name!r} ends past the end of file)")
    return reader


def read_field(reader: Any, key: str, default: Any = _REQUIRED) -> Any:
    """A scalar or string metadata value."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None:
        if default is _REQUIRED:
            raise ModelLoadError(f"GGUF metadata lacks the required field {key!r}")
        return default
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    return value[0].item()


def gguf_to_hf_config(reader: Any, architecture: str) -> Any:
    """A transformers config (Llama, Mixtral, Qwen2, Qwen3, DeepSeek-V2 / V3) from llama.cpp's metadata keys."""
    import transformers

    def field(name: str, default: Any = _REQUIRED) -> Any:
        return read_field(reader, f"{architecture}.{name}", default)

    tensor_names = {t.name for t in reader.tensors}
    hidden_size = field("embedding_length")
    num_heads = field("attention.head_count")
    head_dim = field("attention.key_length", None) or field("rope.dimension_count", None) or hidden_size // num_heads
    vocab_size = field("vocab_size", None)
    if vocab_size is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab_size = len(tokens.data) if tokens is not None else int(_tensor(reader, "token_embd.weight").shape[-1])
    max_position = field("context_length")
    rope_parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": field("rope.freq_base", 10000.0)}
    scaling_type = field("rope.scaling.type", "none")
    if scaling_type in ("linear", "yarn"):
        rope_parameters.update(rope_type=scaling_type, factor=field("rope.scaling.factor"))
        if scaling_type == "yarn":
            rope_parameters["original_max_position_embeddings"] = field("rope.scaling.original_context_length")
            for key in ("beta_fast", "beta_slow"):
                if (value := field(f"rope.scaling.yarn_{key}", None)) is not None:
                    rope_parameters[key] = value
    if _ROPE_FREQS in tensor_names:
        rope_parameters.update(
            _llama3_rope_parameters(_dequantize(_tensor(reader, _ROPE_FREQS)), rope_parameters["rope_theta"], head_dim)
        )

    common = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=field("feed_forward_length"),
        num_hidden_layers=field("block_count"),
        num_attention_heads=num_heads,
        max_position_embeddings=max_position,
        rms_norm_eps=field("attention.layer_norm_rms_epsilon"),
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=read_field(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=read_field(reader, "tokenizer.ggml.padding_token_id", None),
        dtype="float32",
    )
    if architecture == "deepseek2":
        return _deepseek2_config(field, tensor_names, common)
    hf_architecture = SUPPORTED_ARCHITECTURES[architecture]
    extra: dict[str, Any] = {}
    num_experts = field("expert_count", 0)
    if num_experts:
        if architecture not in _MOE_ARCHITECTURES:
            raise ModelLoadError(
                f"GGUF {architecture!r} with {architecture}.expert_count={num_experts}: vframe reads experts "
                f"in GGUF files of {sorted(_MOE_ARCHITECTURES)} only"
            )
        hf_architecture = _MOE_ARCHITECTURES[architecture]
        extra.update(num_local_experts=num_experts, num_experts_per_tok=field("expert_used_count"),
                     sliding_window=None)
    elif architecture == "llama":
        extra.update(attention_bias="blk.0.attn_q.bias" in tensor_names,
                     mlp_bias="blk.0.ffn_gate.bias" in tensor_names)
    elif architecture == "qwen3":
        extra.update(attention_bias="blk.0.attn_q.bias" in tensor_names)
    if architecture.startswith("qwen"):
        extra.update(use_sliding_window=False)
    config_class = getattr(transformers, hf_architecture.replace("ForCausalLM", "Config"))
    return config_class(
        architectures=[hf_architecture],
        num_key_value_heads=field("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        **common,
        **extra,
    )


_SIGMOID_GATING = 2  # llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid


def _deepseek2_config(field: Any, tensor_names: set[str], common: dict[str, Any]) -> Any:
    """DeepSeek-V2 or V3 (sigmoid routing with a correction bias: ``expert_gating_func`` 2
    or ``exp_probs_b`` tensors) from llama.cpp's ``deepseek2`` keys. Its converter writes
    MLA as one key / value head (``head_count_kv`` 1, ``key_length`` kv_lora_rank + rope),
    the per-head sizes in ``key_length_mla`` / ``value_length_mla`` (older files: in
    ``key_length`` / ``value_length``), and YaRN's ``mscale_all_dim`` as ``yarn_log_multiplier
    / 0.1`` (``mscale`` taken equal to it, as in DeepSeek's releases)."""
    from transformers import DeepseekV2Config, DeepseekV3Config

    rope_dim = field("rope.dimension_count")
    key_length = field("attention.key_length_mla", None) or field("attention.key_length")
    value_length = field("attention.value_length_mla", None) or field("attention.value_length")
    v3 = (field("expert_gating_func", None) == _SIGMOID_GATING
          or any(name.endswith("exp_probs_b.bias") for name in tensor_names))
    n_group = field("expert_group_count", 1)
    rope = common["rope_parameters"]
    log_multiplier = field("rope.scaling.yarn_log_multiplier", None)
    if rope["rope_type"] == "yarn" and log_multiplier:
        rope.update(mscale_all_dim=log_multiplier / 0.1, mscale=log_multiplier / 0.1)
    moe = dict(
        n_routed_experts=field("expert_count"),
        num_experts_per_tok=field("expert_used_count"),
        n_shared_experts=field("expert_shared_count", 0),
        moe_intermediate_size=field("expert_feed_forward_length"),
        first_k_dense_replace=field("leading_dense_block_count", 0),
        routed_scaling_factor=field("expert_weights_scale", 1.0),
        norm_topk_prob=bool(field("expert_weights_norm", False)),
        n_group=n_group,
        topk_group=field("expert_group_used_count", 1),
    )
    if not v3:
        moe["topk_method"] = "group_limited_greedy" if n_group > 1 else "greedy"
    config_class = DeepseekV3Config if v3 else DeepseekV2Config
    return config_class(
        architectures=["DeepseekV3ForCausalLM" if v3 else "DeepseekV2ForCausalLM"],
        num_key_value_heads=common["num_attention_heads"],
        q_lora_rank=field("attention.q_lora_rank", None),
        kv_lora_rank=field("attention.kv_lora_rank"),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=key_length - rope_dim,
        v_head_dim=value_length,
        **common,
        **moe,
    )


def _llama3_rope_parameters(rope_freqs: np.ndarray, theta: float, head_dim: int) -> dict[str, Any]:
    """Recover Hugging Face ``llama3`` rope parameters from llama.cpp's per-frequency factors.

    llama.cpp stores only the factors; every Llama 3.x release uses low/high
    frequency factors 1 and 4 over an original context of 8192, so those are
    assumed and the factors are checked against them."""
    factor = float(rope_freqs.max())
    if factor == 1.0:
        return {}
    params = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    expected = []
    for freq in inv_freq:
        wavelen = 2 * math.pi / freq
        if wavelen < 8192 / 4.0:
            expected.append(1.0)
        elif wavelen > 8192 / 1.0:
            expected.append(factor)
        else:
            smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
            expected.append(1 / ((1 - smooth) / factor + smooth))
    if not np.allclose(rope_freqs, expected, rtol=1e-3):
        raise ModelLoadError(
            f"GGUF tensor {_ROPE_FREQS!r} does not match llama3 rope scaling "
            "(low_freq_factor=1, high_freq_factor=4, original context 8192); this rope scaling is not supported"
        )
    return params


def gguf_to_hf_tensors(reader: Any, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantized float32 tensors under Hugging Face names, q/k un-permuted, merged experts
    split, DeepSeek's split ``kv_b_proj`` joined."""
    latent = _LatentJoiner()
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        array = _dequantize(t).reshape(tuple(reversed(t.shape.tolist())))  # [..., out, in]: GGUF's dims reversed
        for name, part in latent.tensors(t.name, array, config.model_type):
            part = _unpermute_rows(name, part, config)
            yield name, torch.from_numpy(np.require(part, np.float32, ["C", "W"]))
    latent.check_complete()


def iterate_gguf_quantized(gguf_path: Path, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``gguf_path`` for ``quantization="gguf"`` (``vframe.quant.gguf``):
    each linear layer's weight (every expert's too), the token embedding and an untied
    LM head kept as the file stores them, as ``<module>.qweight_type`` (the ggml type
    number) then ``<module>.qweight`` (uint8 [out, row bytes], q / k rows un-permuted);
    every other tensor (norms, biases, a router) dequantized to float32 as the conversion
    does. DeepSeek's ``kv_b_proj`` from llama.cpp's transposed split is joined in float32
    (an F32 layer: MLA reads it as a tensor, once)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    latent = _LatentJoiner()
    for gguf_name, ggml_type, shape, rows in read_gguf_tensors(gguf_path):
        if gguf_name == _ROPE_FREQS:
            continue
        if _kept_quantized(gguf_name):
            blocks = rows.reshape(*shape[:-1], rows.shape[-1])  # [..., out, row bytes]
            for name, part in hf_tensors(gguf_name, blocks, config.model_type):
                module = name.removesuffix(".weight")
                yield f"{module}.qweight_type", torch.tensor(ggml_type)
                yield f"{module}.qweight", torch.from_numpy(np.array(_unpermute_rows(name, part, config)))
            continue
        array = dequantize(rows, GGMLQuantizationType(ggml_type)).reshape(shape)
        for name, part in latent.tensors(gguf_name, array, config.model_type):
            part = np.require(_unpermute_rows(name, part, config), np.float32, ["C", "W"])
            if name.endswith("kv_b_proj.weight"):
                module = name.removesuffix(".weight")
                yield f"{module}.qweight_type", torch.tensor(int(GGMLQuantizationType.F32))
                yield f"{module}.qweight", torch.from_numpy(part.view(np.uint8))
            else:
                yield name, torch.from_numpy(part)
    latent.check_complete()


def _kept_quantized(gguf_name: str) -> bool:
    """Whether ``quantization="gguf"`` keeps this tensor's blocks: the embedding, the LM
    head and every linear layer's weight (its biases and norms are dequantized)."""
    if gguf_name in _KEPT_QUANTIZED:
        return True
    if _MERGED_EXPERTS.fullmatch(gguf_name) or _ONE_EXPERT.fullmatch(gguf_name):
        return True
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    return bool(match) and match.group(3) == "weight" and match.group(2) in _LINEAR_KINDS


class _LatentJoiner:
    """Passes tensors through ``hf_tensors``, but holds a layer's ``attn_k_b`` until its
    ``attn_v_b`` comes (or the other way round) and hands over the ``kv_b_proj`` they split:
    per head ``h``, ``[k_b[h].T ; v_b[h]]`` ([dn + dv, R]), heads one after the other."""

    def __init__(self) -> None:
        self.pending: dict[str, dict[str, np.ndarray]] = {}

    def tensors(self, gguf_name: str, array: np.ndarray, model_type: str) -> Iterator[tuple[str, np.ndarray]]:
        split = _LATENT_SPLIT.fullmatch(gguf_name)
        if split is None:
            yield from hf_tensors(gguf_name, array, model_type)
            return
        layer, part = split.groups()
        halves = self.pending.setdefault(layer, {})
        halves[part] = array
        if len(halves) == 2:
            del self.pending[layer]
            k_b, v_b = halves["k"], halves["v"]  # [H, R, dn], [H, dv, R]
            kv_b = np.concatenate([k_b.swapaxes(1, 2), v_b], axis=1)  # [H, dn + dv, R]
            yield f"model.layers.{layer}.self_attn.kv_b_proj.weight", kv_b.reshape(-1, kv_b.shape[-1])

    def check_complete(self) -> None:
        for layer, halves in self.pending.items():
            missing = "v" if "k" in halves else "k"
            raise ModelLoadError(f"GGUF tensor 'blk.{layer}.attn_{missing}_b.weight' is missing (its pair is there)")


_KEPT_QUANTIZED = ("token_embd.weight", "output.weight")  # besides the layers' linear weights (_LINEAR_KINDS)

# GGUF value types: struct formats of the scalars; 8 is a string, 9 an array
_GGUF_SCALARS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d",
}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_tensors(path: Path) -> Iterator[tuple[str, int, tuple[int, ...], np.ndarray]]:
    """``(name, ggml type, shape, uint8 [rows, row bytes])`` for each tensor of a GGUF
    file (v2 / v3), memory-mapped; ``shape`` is in values, outermost first ([out, in]).
    ``gguf.GGUFReader`` also builds every metadata value (a vocabulary is ~100k of
    them: seconds); this reads only the tensor table."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, dtype=np.uint8, mode="r")
    pos = 0

    def read(fmt: str) -> Any:
        nonlocal pos
        (value,) = struct.unpack_from(fmt, data, pos)
        pos += struct.calcsize(fmt)
        return value

    def read_string() -> str:
        nonlocal pos
        length = read("<Q")
        pos += length
        return bytes(data[pos - length : pos]).decode("utf-8")

    def skip_value(value_type: int) -> None:
        nonlocal pos
        if value_type == _GGUF_STRING:
            length = read("<Q")  # not `pos += read(...)`: that adds to pos as it was before the read
            pos += length
        elif value_type == _GGUF_ARRAY:
            item_type, count = read("<I"), read("<Q")
            if item_type in _GGUF_SCALARS:
                pos += count * struct.calcsize(_GGUF_SCALARS[item_type])
            else:
                for _ in range(count):
                    skip_value(item_type)
        else:
            pos += struct.calcsize(_GGUF_SCALARS[value_type])

    try:
        if bytes(data[:4]) != b"GGUF":
            raise ValueError("no GGUF magic")
        pos = 4
        version = read("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version}; vframe reads versions 2 and 3")
        num_tensors, num_fields = read("<Q"), read("<Q")
        alignment = 32
        for _ in range(num_fields):
            key, value_type = read_string(), read("<I")
            if key == "general.alignment":
                alignment = read(_GGUF_SCALARS[value_type])
            else:
                skip_value(value_type)
        infos = []
        for _ in range(num_tensors):
            name, num_dims = read_string(), read("<I")
            dims = [read("<Q") for _ in range(num_dims)]  # innermost first: [in, out] for a matrix
            infos.append((name, dims, read("<I"), read("<Q")))
        start = -(-pos // alignment) * alignment
        for name, dims, ggml_type, offset in infos:
            block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            rows = math.prod(dims[1:])
            row_bytes = dims[0] // block_size * type_size
            begin = start + offset
            if begin + rows * row_bytes > data.size:
                raise ModelLoadError(f"{path}: truncated GGUF file (tensor {name!r} ends past the end of file)")
            blocks = data[begin : begin + rows * row_bytes].reshape(rows, row_bytes)
            yield name, ggml_type, tuple(reversed(dims)), blocks
    except (ValueError, struct.error, KeyError) as e:
        raise ModelLoadError(f"{path}: truncated or corrupt GGUF file ({type(e).__name__}: {e})") from e


def _unpermute_rows(name: str, rows: np.ndarray, config: Any) -> np.ndarray:
    """Undo llama.cpp's q / k row order (see ``unpermute_qk``) in Llama and Mixtral;
    rows of floats or of blocks alike."""
    if config.model_type not in _PERMUTED_QK_MODEL_TYPES:
        return rows
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return unpermute_qk(rows, config.num_attention_heads)
    if name.endswith(("k_proj.weight", "k_proj.bias")):
        return unpermute_qk(rows, config.num_key_value_heads)
    return rows


def hf_tensors(gguf_name: str, array: np.ndarray, model_type: str = "llama") -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face tensors GGUF tensor ``gguf_name`` (``array``: values or rows of
    blocks, outermost dimension first) holds in a ``model_type`` model: itself under its
    Hugging Face name, or for llama.cpp's merged experts (``[experts, out, in]``) each
    expert's ``[out, in]``."""
    merged = _MERGED_EXPERTS.fullmatch(gguf_name)
    if merged is None:
        yield hf_tensor_name(gguf_name, model_type), array
        return
    layer, kind = merged.groups()
    block, projections = _moe_names(gguf_name, model_type)
    for expert, part in enumerate(array):
        yield f"model.layers.{layer}.{block}.experts.{expert}.{projections[kind]}.weight", part


def hf_tensor_name(gguf_name: str, model_type: str = "llama") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; in Mixtral
    ``blk.3.ffn_gate.5.weight`` -> ``model.layers.3.block_sparse_moe.experts.5.w1.weight``."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL and suffix in ("weight", "bias"):
        return f"{_TOP_LEVEL[base]}.{suffix}"
    if router := _ROUTER.fullmatch(gguf_name):
        return f"model.layers.{router[1]}.{_moe_names(gguf_name, model_type)[0]}.gate.weight"
    if bias := _ROUTER_BIAS.fullmatch(gguf_name):
        return f"model.layers.{bias[1]}.{_moe_names(gguf_name, model_type)[0]}.gate.e_score_correction_bias"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _PER_LAYER:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_PER_LAYER[kind]}.{suffix}"
    if expert := _ONE_EXPERT.fullmatch(gguf_name):
        layer, kind, index = expert.groups()
        block, projections = _moe_names(gguf_name, model_type)
        return f"model.layers.{layer}.{block}.experts.{index}.{projections[kind]}.weight"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent; vframe cannot load this file")


def _moe_names(gguf_name: str, model_type: str) -> tuple[str, dict[str, str]]:
    if model_type not in _MOE_NAMES:
        raise ModelLoadError(f"GGUF tensor {gguf_name!r} belongs to a mixture of experts, which a {model_type!r} "
                             f"model has not; vframe reads experts in {sorted(_MOE_NAMES)}")
    return _MOE_NAMES[model_type]


def unpermute_qk(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves the two rotary halves of each head:
    ``w.reshape(n_head, 2, head_dim // 2, *rest).swapaxes(1, 2)``."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor(reader: Any, name: str) -> Any:
    return next(t for t in reader.tensors if t.name == name)


def _dequantize(t: Any) -> np.ndarray:
    from gguf.quants import dequantize

    # Writable and contiguous: unquantized tensors come back as read-only views of the file.
    return np.require(dequantize(t.data, t.tensor_type), np.float32, ["C", "W"])
