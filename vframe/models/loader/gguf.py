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
# (``llama.expert_count``) is Mixtral, as llama.cpp's converter writes it.
SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_MOE_ARCHITECTURES = {"llama": "MixtralForCausalLM"}
# Models whose q / k rows llama.cpp's converter reorders for its interleaved rotary
# embedding (``unpermute_qk``); Qwen's use the rotate-half layout, which it keeps.
_PERMUTED_QK_MODEL_TYPES = ("llama", "mixtral")

_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Per layer: GGUF tensor kind -> Hugging Face module; the linear layers (kept as blocks
# for quantization="gguf") are those ending in "_proj" and the experts' w1 / w2 / w3.
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "block_sparse_moe.gate",  # Mixtral's router
}
# Mixtral's experts: merged into one [experts, out, in] tensor per projection
# (``blk.3.ffn_gate_exps.weight``, llama.cpp since 2024) or one tensor each
# (``blk.3.ffn_gate.5.weight``, older files); Hugging Face names them per expert.
_EXPERTS = {"ffn_gate": "w1", "ffn_up": "w3", "ffn_down": "w2"}
_MERGED_EXPERTS = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)_exps\.weight")
_ONE_EXPERT = re.compile(r"blk\.(\d+)\.(ffn_gate|ffn_up|ffn_down)\.(\d+)\.weight")
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"  # llama3 rope scaling factors, folded into the config
_REQUIRED = object()


def convert_gguf(gguf_path: Path, out_dir: Path, *, weights: bool = True) -> None:
    """Write the Hugging Face-layout conversion of ``gguf_path`` to ``out_dir``;
    ``weights=False``: only ``config.json`` and the tokenizer."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = open_gguf(gguf_path)
    architecture = read_field(reader, "general.architecture")
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"{gguf_path}: GGUF general.architecture={architecture!r} is not supported; "
            f"vframe reads GGUF files of: {sorted(SUPPORTED_ARCHITECTURES)} (llama with experts: Mixtral)"
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
        tokenizer = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
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
    """A transformers config (Llama, Mixtral, Qwen2 or Qwen3) from llama.cpp's metadata keys."""
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
    if _ROPE_FREQS in tensor_names:
        rope_parameters.update(
            _llama3_rope_parameters(_dequantize(_tensor(reader, _ROPE_FREQS)), rope_parameters["rope_theta"], head_dim)
        )

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
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=field("feed_forward_length"),
        num_hidden_layers=field("block_count"),
        num_attention_heads=num_heads,
        num_key_value_heads=field("attention.head_count_kv", num_heads),
        head_dim=head_dim,
        max_position_embeddings=max_position,
        rms_norm_eps=field("attention.layer_norm_rms_epsilon"),
        rope_parameters=rope_parameters,
        tie_word_embeddings="output.weight" not in tensor_names,
        bos_token_id=read_field(reader, "tokenizer.ggml.bos_token_id", None),
        eos_token_id=read_field(reader, "tokenizer.ggml.eos_token_id", None),
        pad_token_id=read_field(reader, "tokenizer.ggml.padding_token_id", None),
        dtype="float32",
        **extra,
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
    """Dequantized float32 tensors under Hugging Face names, q/k un-permuted, merged experts split."""
    for t in reader.tensors:
        if t.name == _ROPE_FREQS:
            continue
        array = _dequantize(t).reshape(tuple(reversed(t.shape.tolist())))  # [..., out, in]: GGUF's dims reversed
        for name, part in hf_tensors(t.name, array):
            part = _unpermute_rows(name, part, config)
            yield name, torch.from_numpy(np.require(part, np.float32, ["C", "W"]))


def iterate_gguf_quantized(gguf_path: Path, config: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of ``gguf_path`` for ``quantization="gguf"`` (``vframe.quant.gguf``):
    each linear layer's weight (every expert's too), the token embedding and an untied
    LM head kept as the file stores them, as ``<module>.qweight_type`` (the ggml type
    number) then ``<module>.qweight`` (uint8 [out, row bytes], q / k rows un-permuted);
    every other tensor (norms, biases, a router) dequantized to float32 as the conversion does."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    for gguf_name, ggml_type, shape, rows in read_gguf_tensors(gguf_path):
        if gguf_name == _ROPE_FREQS:
            continue
        if _kept_quantized(gguf_name):
            blocks = rows.reshape(*shape[:-1], rows.shape[-1])  # [..., out, row bytes]
            for name, part in hf_tensors(gguf_name, blocks):
                module = name.removesuffix(".weight")
                yield f"{module}.qweight_type", torch.tensor(ggml_type)
                yield f"{module}.qweight", torch.from_numpy(np.array(_unpermute_rows(name, part, config)))
        else:
            array = dequantize(rows, GGMLQuantizationType(ggml_type)).reshape(shape)
            for name, part in hf_tensors(gguf_name, array):
                part = _unpermute_rows(name, part, config)
                yield name, torch.from_numpy(np.require(part, np.float32, ["C", "W"]))


def _kept_quantized(gguf_name: str) -> bool:
    """Whether ``quantization="gguf"`` keeps this tensor's blocks: the embedding, the LM
    head and every linear layer's weight (its biases and norms are dequantized)."""
    if gguf_name in _KEPT_QUANTIZED:
        return True
    if _MERGED_EXPERTS.fullmatch(gguf_name) or _ONE_EXPERT.fullmatch(gguf_name):
        return True
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    return bool(match) and match.group(3) == "weight" and _PER_LAYER.get(match.group(2), "").endswith("_proj")


_KEPT_QUANTIZED = ("token_embd.weight", "output.weight")  # besides the layers' linear weights

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


def hf_tensors(gguf_name: str, array: np.ndarray) -> Iterator[tuple[str, np.ndarray]]:
    """The Hugging Face tensors GGUF tensor ``gguf_name`` (``array``: values or rows of
    blocks, outermost dimension first) holds: itself under its Hugging Face name, or for
    llama.cpp's merged experts (``[experts, out, in]``) each expert's ``[out, in]``."""
    merged = _MERGED_EXPERTS.fullmatch(gguf_name)
    if merged is None:
        yield hf_tensor_name(gguf_name), array
        return
    layer, kind = merged.groups()
    for expert, part in enumerate(array):
        yield f"model.layers.{layer}.block_sparse_moe.experts.{expert}.{_EXPERTS[kind]}.weight", part


def hf_tensor_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``;
    ``blk.3.ffn_gate.5.weight`` -> ``model.layers.3.block_sparse_moe.experts.5.w1.weight``."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL and suffix in ("weight", "bias"):
        return f"{_TOP_LEVEL[base]}.{suffix}"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match and match.group(2) in _PER_LAYER:
        layer, kind, suffix = match.groups()
        return f"model.layers.{layer}.{_PER_LAYER[kind]}.{suffix}"
    expert = _ONE_EXPERT.fullmatch(gguf_name)
    if expert:
        layer, kind, index = expert.groups()
        return f"model.layers.{layer}.block_sparse_moe.experts.{index}.{_EXPERTS[kind]}.weight"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no Hugging Face equivalent; vframe cannot load this file")


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
