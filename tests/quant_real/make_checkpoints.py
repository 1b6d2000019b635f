"""Make quantized checkpoints of a dense Hugging Face Llama with the real tools.

Runs in the tools' own environment (``make quant-tools``: ``.venv-quant``, with
llm-compressor, auto-round and ModelOpt), not in vframe's, and imports nothing from vframe::

    .venv-quant/bin/python tests/quant_real/make_checkpoints.py DENSE_DIR OUT_DIR SCHEME [SCHEME ...]

Each scheme writes two directories, made under a temporary name and renamed
when complete (an existing one is kept, so a second run costs nothing)::

    OUT_DIR/<scheme>/            the checkpoint exactly as the tool saves it
    OUT_DIR/<scheme>-reference/  the same model with every weight replaced by the
                                 tool's own dequantized weight, as a float32
                                 dense checkpoint that plain transformers loads

The reference weights come from the tool, not from vframe: for llm-compressor,
transformers loads the saved checkpoint through compressed-tensors
(``run_compressed=False`` decompresses every layer; NVFP4 layers through
compressed-tensors' unpack and dequantize functions in float32, as its decompression
would in bfloat16); for auto-round, the
model right after ``quantize()`` holds its fake-quantized (quantize then
dequantize) weights, saved before packing; for NVIDIA ModelOpt (``nvidia-modelopt``,
which calibrates and exports on the CPU), each exported layer dequantized by its own
``FP8QTensor`` / ``NVFP4QTensor`` classes (its fake quantization of NVFP4 needs a GPU).
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import torch

# Calibration text: a few dozen plain sentences (nothing is downloaded).
CALIBRATION = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Paris is the capital of France and is known for the Eiffel Tower.",
    "Water boils at one hundred degrees Celsius at sea level.",
    "The mitochondria is the powerhouse of the cell.",
    "In 1969, astronauts landed on the Moon for the first time.",
    "A triangle has three sides and its angles add up to 180 degrees.",
    "Photosynthesis turns sunlight, water and carbon dioxide into sugar.",
    "The Pacific Ocean is the largest and deepest ocean on Earth.",
    "Shakespeare wrote Hamlet, Macbeth and Romeo and Juliet.",
    "Python is a programming language that emphasizes readability.",
    "The heart pumps blood through the arteries and veins of the body.",
    "Mount Everest is the highest mountain above sea level.",
    "Bees collect nectar from flowers and turn it into honey.",
    "The Great Wall of China stretches for thousands of kilometers.",
    "Electrons carry a negative charge and orbit the nucleus of an atom.",
    "A healthy breakfast can include oatmeal, fruit and yogurt.",
    "The train leaves the station at eight o'clock every morning.",
    "Rainbows appear when sunlight is refracted by drops of water.",
    "The library opens at nine and closes at six on weekdays.",
    "Gravity keeps the planets in orbit around the Sun.",
    "She planted tomatoes, basil and peppers in her garden this spring.",
    "The stock market rose sharply after the announcement.",
    "To bake bread, mix flour, water, yeast and a pinch of salt.",
    "The human brain contains about eighty-six billion neurons.",
    "Lightning is a sudden discharge of electricity in the atmosphere.",
    "The museum displays paintings from the Renaissance period.",
    "Wolves live and hunt together in packs.",
    "A computer stores data in memory and on disk.",
    "The recipe calls for two cups of sugar and three eggs.",
    "Volcanoes erupt when pressure builds up beneath the Earth's crust.",
    "The Amazon rainforest produces a large share of the world's oxygen.",
    "He practiced the piano every evening for an hour.",
    "Def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "The committee will meet next Tuesday to discuss the budget.",
    "Snow covered the mountains, and the lake froze over in January.",
    "Light travels at about three hundred thousand kilometers per second.",
    "User: What is two plus two? Assistant: Two plus two is four.",
    "User: Name a primary color. Assistant: Red is a primary color.",
    "The children built a sandcastle on the beach.",
    "Antibiotics treat infections caused by bacteria, not viruses.",
]
MAX_SEQ_LENGTH = 64

# scheme -> the tool and what it runs
SCHEMES = {
    "ct-fp8-tensor": "llm-compressor QuantizationModifier FP8 (per-tensor weights, static activations)",
    "ct-fp8-dynamic": "llm-compressor QuantizationModifier FP8_DYNAMIC (per-channel weights)",
    "ct-fp8-block": "llm-compressor QuantizationModifier FP8_BLOCK (128x128 blocks)",
    "ct-fp8-kv": "llm-compressor QuantizationModifier FP8_DYNAMIC with kv_cache_scheme (static per-tensor FP8 "
                 "KV-cache scales: k_scale / v_scale per layer)",
    "ct-fp8-kv-head": "llm-compressor QuantizationModifier FP8_DYNAMIC with kv_cache_scheme strategy attn_head "
                      "(static FP8 KV-cache scales per KV head: k_scale / v_scale [heads] per layer)",
    "ct-fp8-attn-head": "llm-compressor QuantizationModifier attention quantization (a config group targeting "
                        "LlamaAttention, float8 input activations per head; the weights left float): q / k / v "
                        "scales per head, the kv_cache_scheme it implies",
    "ct-w8a8": "llm-compressor SmoothQuantModifier + GPTQModifier W8A8 (int8 channel weights, dynamic int8 tokens)",
    "ct-w8a16": "llm-compressor GPTQModifier W8A16 (int8, groups of 64)",
    "ct-w8a16-head": "llm-compressor GPTQModifier W8A16 (int8, groups of 64), lm_head not ignored: quantized too",
    "ct-w4a16": "llm-compressor GPTQModifier W4A16 (int4, groups of 64)",
    "ct-w4a16-head": "llm-compressor GPTQModifier W4A16 (int4, groups of 64), lm_head not ignored: quantized too",
    "ct-nvfp4a16": "llm-compressor QuantizationModifier NVFP4A16 (float4 weights, e4m3 scales per 16, global scale)",
    "ct-mxfp4a16": "llm-compressor QuantizationModifier MXFP4A16 (float4 weights, e8m0 scales per 32)",
    "ct-mxfp8a16": "llm-compressor QuantizationModifier MXFP8A16 (e4m3 weights, e8m0 scales per 32)",
    "modelopt-fp8": "NVIDIA ModelOpt FP8_DEFAULT_CFG + FP8_KV_CFG (per-tensor FP8 weights, static input scales, "
                    "FP8 KV-cache scales), export_hf_checkpoint",
    "modelopt-fp8-channel": "NVIDIA ModelOpt FP8_PER_CHANNEL_PER_TOKEN_CFG (FP8 weights, a scale per output row)",
    "modelopt-fp8-block": "NVIDIA ModelOpt FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG (FP8 weights, 128x128 block scales)",
    "modelopt-nvfp4": "NVIDIA ModelOpt NVFP4_DEFAULT_CFG (NVFP4 weights and activations, W4A4)",
    "modelopt-mxfp8": "NVIDIA ModelOpt MXFP8_DEFAULT_CFG (e4m3 weights and activations, e8m0 scales per 32)",
    "modelopt-fp8-mixtral": "NVIDIA ModelOpt FP8_DEFAULT_CFG on a mixture of experts (DENSE_DIR: a Mixtral): every "
                            "expert's w1 / w2 / w3, per-tensor scales",
    "ct-fp8-mixtral": "llm-compressor QuantizationModifier FP8_DYNAMIC on a mixture of experts (DENSE_DIR: a Mixtral): "
                      "every expert's projections, the router left float",
    "ct-w4a16-mixtral": "llm-compressor QuantizationModifier int4 groups of 32 with zero points (round to "
                        "nearest) on a Mixtral's attention and experts",
    "bnb-nf4": "bitsandbytes through transformers' BitsAndBytesConfig: NF4, blocks of 64, double quantization "
               "(absmax in 8 bits), bfloat16 compute dtype (Unsloth's bnb-4bit recipe)",
    "bnb-fp4": "bitsandbytes through transformers' BitsAndBytesConfig: FP4, blocks of 64, float32 absmax",
    "bnb-int8": "bitsandbytes through transformers' BitsAndBytesConfig: LLM.int8 (int8 weights, a scale per row)",
    "autoround-gptq": "auto-round 4 bit symmetric, groups of 64, exported as auto_gptq",
    "autoround-gptq-3bit": "auto-round 3 bit symmetric, groups of 64, exported as auto_gptq (32 values in 3 "
                           "int32 words, AutoGPTQ's stream)",
    "autoround-awq": "auto-round 4 bit with zero points, groups of 64, round to nearest (iters=0), as auto_awq",
    "autoround-gptq-head": "auto-round 4 bit symmetric, groups of 64, round to nearest (iters=0), lm_head "
                           "quantized (quant_lm_head; the head untied first), as auto_gptq",
}
# The presets W4A16 / W8A16 take groups of 128, which llm-compressor refuses for
# SmolLM2's 576 inputs (columns % group_size must be 0): the same schemes with groups of 64.
CT_PRESETS = {
    "ct-fp8-tensor": ("quantization", "FP8"),
    "ct-fp8-dynamic": ("quantization", "FP8_DYNAMIC"),
    "ct-fp8-block": ("quantization", "FP8_BLOCK"),
    "ct-fp8-kv": ("quantization", "FP8_DYNAMIC"),
    "ct-fp8-kv-head": ("quantization", "FP8_DYNAMIC"),
    "ct-fp8-attn-head": ("quantization", "ATTENTION"),
    "ct-w8a8": ("gptq", "W8A8"),
    "ct-w8a16": ("gptq", 8),
    "ct-w8a16-head": ("gptq", 8),
    "ct-w4a16": ("gptq", 4),
    "ct-w4a16-head": ("gptq", 4),
    "ct-nvfp4a16": ("quantization", "NVFP4A16"),
    "ct-mxfp4a16": ("quantization", "MXFP4A16"),
    "ct-mxfp8a16": ("quantization", "MXFP8A16"),
}
# schemes made from a mixture-of-experts model: the quantization_config's weights (None: the preset)
MOE_SCHEMES = {
    "ct-fp8-mixtral": None,
    "ct-w4a16-mixtral": {"num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 32},
}
# scheme -> ModelOpt's config(s), merged in order
MODELOPT_CONFIGS = {
    "modelopt-fp8": ("FP8_DEFAULT_CFG", "FP8_KV_CFG"),
    "modelopt-fp8-channel": ("FP8_PER_CHANNEL_PER_TOKEN_CFG",),
    "modelopt-fp8-block": ("FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG",),
    "modelopt-nvfp4": ("NVFP4_DEFAULT_CFG",),
    "modelopt-mxfp8": ("MXFP8_DEFAULT_CFG",),
    "modelopt-fp8-mixtral": ("FP8_DEFAULT_CFG",),
}
AUTOROUND_FORMATS = {"autoround-gptq": "auto_gptq", "autoround-awq": "auto_awq", "autoround-gptq-head": "auto_gptq",
                     "autoround-gptq-3bit": "auto_gptq"}
AUTOROUND_TUNED = {"autoround-gptq", "autoround-gptq-3bit"}  # 20 steps of SignRound; the others round to nearest
# schemes that calibrate the KV cache too: llm-compressor's FP8 KV cache (what vLLM reads as k_scale / v_scale)
KV_CACHE_SCHEME = {
    scheme: {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False, "symmetric": True}
    for scheme, strategy in (("ct-fp8-kv", "tensor"), ("ct-fp8-kv-head", "attn_head"))
}
# schemes that quantize the LM head too (llm-compressor unties SmolLM2's tied head itself)
HEAD_QUANTIZED = {"ct-w8a16-head", "ct-w4a16-head", "autoround-gptq-head"}


def _load(dense: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(dense)


def _save_reference(model: torch.nn.Module, dense: Path, out: Path,
                    replaced: dict[str, torch.Tensor] | None = None) -> None:
    """The model's float weights (those named in ``replaced`` from there) under the
    dense checkpoint's names, config and tokenizer; a head the tool untied (to quantize
    it) as ``lm_head.weight``, with ``tie_word_embeddings`` false."""
    _save_reference_state(model.config, model.state_dict() | (replaced or {}), dense, out)


def _save_reference_state(config: object, state: dict[str, torch.Tensor], dense: Path, out: Path) -> None:
    import json

    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(dense / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    untied = not config.tie_word_embeddings
    if untied and "lm_head.weight" not in names:
        names.append("lm_head.weight")
    weights = {name: state[name].detach().to(torch.float32).contiguous() for name in names}
    out.mkdir(parents=True)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    for item in dense.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out / item.name)
    config = json.loads((out / "config.json").read_text())
    if untied and config.get("tie_word_embeddings"):
        (out / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}, indent=2))


def make_llm_compressor(scheme: str, dense: Path, out: Path, reference: Path) -> None:
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    modifier_kind, preset = CT_PRESETS[scheme]
    model, tokenizer = _load(dense)
    if isinstance(preset, int):  # WnA16, groups of 64
        weights = {"num_bits": preset, "type": "int", "symmetric": True, "strategy": "group", "group_size": 64}
        how = {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}
    elif preset == "ATTENTION":  # llm-compressor's attention quantization example, per head
        inputs = {"num_bits": 8, "type": "float", "strategy": "attn_head"}
        how = {"config_groups": {"attention": {"targets": ["LlamaAttention"], "input_activations": inputs}}}
    else:
        how = {"targets": "Linear", "scheme": preset}
    ignore = [] if scheme in HEAD_QUANTIZED else ["lm_head"]
    if scheme in KV_CACHE_SCHEME:
        how["kv_cache_scheme"] = KV_CACHE_SCHEME[scheme]
    recipe = [(GPTQModifier if modifier_kind == "gptq" else QuantizationModifier)(ignore=ignore, **how)]
    if preset == "W8A8":
        # llm-compressor's W8A8 recipe: SmoothQuant first moves SmolLM2's activation outliers into the
        # weights; without it per-token int8 rounds most of an outlier token's inputs to 0
        recipe.insert(0, SmoothQuantModifier(smoothing_strength=0.8))
    oneshot(
        model=model,
        tokenizer=tokenizer,
        recipe=recipe,
        dataset=Dataset.from_dict({"text": CALIBRATION}),
        num_calibration_samples=len(CALIBRATION),
        max_seq_length=MAX_SEQ_LENGTH,
        output_dir=str(out),
        save_compressed=True,
    )
    for item in dense.iterdir():
        if item.suffix != ".safetensors" and not (out / item.name).exists():
            shutil.copy(item, out / item.name)
    del model

    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    loaded = AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.float32, quantization_config=CompressedTensorsConfig(run_compressed=False)
    )
    # compressed-tensors' NVFP4 decompression rounds each weight to bfloat16 at the end
    # (unpack_fp4_from_uint8's default dtype); the same functions in float32 instead
    _save_reference(loaded, dense, reference, _nvfp4_float32_weights(out) if preset == "NVFP4A16" else None)


def _nvfp4_float32_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Each NVFP4 layer's weight as compressed-tensors dequantizes it, computed in float32."""
    from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors import safe_open

    args = QuantizationArgs(num_bits=4, type="float", strategy="tensor_group", group_size=16, symmetric=True)
    weights = {}
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if not name.endswith(".weight_packed"):
                continue
            module = name.removesuffix(".weight_packed")
            packed = f.get_tensor(name)
            values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
            weights[f"{module}.weight"] = dequantize(
                x_q=values, scale=f.get_tensor(f"{module}.weight_scale").to(torch.float32), args=args,
                global_scale=f.get_tensor(f"{module}.weight_global_scale"), dtype=torch.float32,
            )
    return weights


def make_auto_round(scheme: str, dense: Path, out: Path, reference: Path) -> None:
    from auto_round import AutoRound

    model, tokenizer = _load(dense)
    if scheme in HEAD_QUANTIZED:
        # auto-round quantizes a head only when untied (it resets quant_lm_head otherwise): its own copy
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    rounder = AutoRound(
        model,
        tokenizer,
        bits=3 if scheme == "autoround-gptq-3bit" else 4,
        group_size=64,
        sym=scheme != "autoround-awq",  # AWQ as AutoAWQ writes it: with zero points
        # auto-round drops texts shorter than seqlen: five sentences a text
        dataset=[" ".join(CALIBRATION[i : i + 5]) for i in range(0, len(CALIBRATION), 5)],
        nsamples=len(CALIBRATION) // 5,
        seqlen=MAX_SEQ_LENGTH,
        # 20 steps of SignRound for GPTQ (4 and 3 bit); AWQ and the GPTQ with its head round to nearest (iters=0):
        # tuning in float32 takes about 11 s a layer on an idle 2-core machine, minutes on a busy one
        iters=20 if scheme in AUTOROUND_TUNED else 0,
        quant_lm_head=scheme in HEAD_QUANTIZED,
        batch_size=4,
        device_map="cpu",
        enable_torch_compile=False,
        # in float32 (no bfloat16 autocast on the CPU): the fake-quantized weights it keeps are then
        # the exported integers times the exported float16 scales
        amp=False,
    )
    qdq_model, _ = rounder.quantize()
    qdq_state = {name: tensor.clone() for name, tensor in qdq_model.state_dict().items()}
    rounder.save_quantized(str(out), format=AUTOROUND_FORMATS[scheme], inplace=True)
    for item in dense.iterdir():
        if item.suffix != ".safetensors" and not (out / item.name).exists():
            shutil.copy(item, out / item.name)
    exported = {}
    if scheme in HEAD_QUANTIZED:
        # rounding to nearest (iters=0) and the head (outside the decoder blocks), auto-round
        # fake-quantizes with float32 scales and exports them rounded to float16 (up to 4.5e-4 of
        # a layer's largest weight apart, which moved a logprob by 5e-3): what the export means is
        # its integers times those float16 scales, as GPTQ v1 defines them
        from safetensors import safe_open

        with safe_open(str(out / "model.safetensors"), framework="pt") as f:
            modules = [name.removesuffix(".qweight") for name in f.keys() if name.endswith(".qweight")]
        exported = {f"{module}.weight": _gptq_v1_weight(out, module) for module in modules}
    _save_reference_state(qdq_model.config, qdq_state | exported, dense, reference)


def make_llm_compressor_moe(scheme: str, dense: Path, out: Path, reference: Path) -> None:
    """A mixture-of-experts model quantized without calibration data (round to nearest: FP8's
    channel scales, int4 groups), the routers left float. llm-compressor (on transformers 5)
    saves each expert's projections as ``experts.{e}.gate_proj`` / ``up_proj`` / ``down_proj``.
    The reference: every quantized tensor dequantized by compressed-tensors' own functions,
    under the dense checkpoint's names."""
    import json

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    model, _ = _load(dense)
    weights = MOE_SCHEMES[scheme]
    how = ({"targets": "Linear", "scheme": "FP8_DYNAMIC"} if weights is None
           else {"config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}})
    oneshot(model=model, recipe=[QuantizationModifier(ignore=["lm_head", "re:.*mlp.gate$"], **how)],
            output_dir=str(out), save_compressed=True)
    for item in dense.iterdir():
        if item.suffix != ".safetensors" and not (out / item.name).exists():
            shutil.copy(item, out / item.name)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    _save_dense_names(dense, reference, _ct_float32_weights(out, config))


def _ct_float32_weights(checkpoint: Path, config: dict) -> dict[str, torch.Tensor]:
    """Each quantized module's weight as compressed-tensors unpacks and dequantizes it, in
    float32, keyed by its module name."""
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize
    from safetensors import safe_open

    [group] = config["config_groups"].values()
    args = QuantizationArgs(**group["weights"])
    weights = {}
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in sorted(names):
            if not name.endswith(".weight_scale"):
                continue
            module = name.removesuffix(".weight_scale")
            scale = f.get_tensor(name).float()
            zero = f.get_tensor(f"{module}.weight_zero_point") if f"{module}.weight_zero_point" in names else None
            if f"{module}.weight_packed" in names:
                shape = torch.Size(f.get_tensor(f"{module}.weight_shape").tolist())
                q = unpack_from_int32(f.get_tensor(f"{module}.weight_packed"), args.num_bits, shape)
                if zero is not None:  # packed along the outputs
                    zero = unpack_from_int32(zero, args.num_bits, torch.Size([shape[0], scale.shape[1]]), packed_dim=0)
            else:
                q = f.get_tensor(f"{module}.weight")
            weights[module] = dequantize(q.float(), scale, zero, args=args, dtype=torch.float32)
    return weights


def _save_dense_names(dense: Path, out: Path, by_module: dict[str, torch.Tensor]) -> None:
    """The dense checkpoint with each module in ``by_module`` replaced, the names mapped from
    llm-compressor's expert names (``gate_proj`` / ``up_proj`` / ``down_proj``) to the dense file's
    (``w1`` / ``w3`` / ``w2``, Mixtral's) where those are the ones it uses."""
    import re

    from safetensors import safe_open
    from safetensors.torch import save_file

    aliases = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
    with safe_open(str(dense / "model.safetensors"), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for module, weight in by_module.items():
        name = f"{module}.weight"
        if name not in tensors:
            name = re.sub(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.",
                          lambda m: f".experts.{m[1]}.{aliases[m[2]]}.", name)
        assert name in tensors, f"{module}: no such weight in {dense}"
        tensors[name] = weight.contiguous()
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    for item in dense.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, out / item.name)


def make_modelopt(scheme: str, dense: Path, out: Path, reference: Path) -> None:
    """``mtq.quantize`` calibrated on the sentences, then ``export_hf_checkpoint``; the
    reference is every exported layer dequantized by ModelOpt's own tensor classes."""
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint

    model, tokenizer = _load(dense)
    config = {"quant_cfg": [], "algorithm": "max"}
    for name in MODELOPT_CONFIGS[scheme]:
        config["quant_cfg"] = list(config["quant_cfg"]) + list(getattr(mtq, name)["quant_cfg"])
        config["algorithm"] = getattr(mtq, name).get("algorithm", config["algorithm"])

    def calibrate(m: torch.nn.Module) -> None:
        with torch.no_grad():
            for text in CALIBRATION:
                m(**tokenizer(text, return_tensors="pt", truncation=True, max_length=MAX_SEQ_LENGTH))

    model = mtq.quantize(model, config, calibrate)
    with torch.inference_mode():
        export_hf_checkpoint(model, export_dir=str(out))
    for item in dense.iterdir():
        if item.suffix != ".safetensors" and not (out / item.name).exists():
            shutil.copy(item, out / item.name)
    weights = _modelopt_float32_weights(out)
    _save_dense_names(dense, reference, {name.removesuffix(".weight"): w for name, w in weights.items()})


def _modelopt_float32_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Each quantized layer's weight as ModelOpt's FP8QTensor / MXFP8QTensor / NVFP4QTensor dequantize it,
    in float32. The stored scales in the shapes those take: a row's scale as [out, 1], the
    blocks of FP8_PB_WO ([out blocks, 1, in blocks, 1] on disk) as [out blocks, in blocks]."""
    from modelopt.torch.quantization.qtensor import FP8QTensor, MXFP8QTensor, NVFP4QTensor
    from safetensors import safe_open

    weights = {}
    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        for name in sorted(names):
            module = name.removesuffix(".weight_scale")
            if not name.endswith(".weight_scale") or f"{module}.weight" not in names:
                continue
            q, scale = f.get_tensor(f"{module}.weight"), f.get_tensor(name)
            if q.dtype == torch.uint8:  # NVFP4: two codes a byte
                shape = torch.Size([q.shape[0], q.shape[1] * 2])
                w = NVFP4QTensor(shape, torch.float32, q).dequantize(
                    torch.float32, scale=scale, double_scale=f.get_tensor(f"{module}.weight_scale_2"),
                    block_sizes={-1: 16},
                )
            elif scale.dtype == torch.uint8:  # MXFP8: e8m0 scales per 32 inputs
                w = MXFP8QTensor(q.shape, torch.float32, q).dequantize(torch.float32, scale=scale)
            elif scale.dim() == 4:  # 128 x 128 blocks
                w = FP8QTensor(q.shape, torch.float32, q).dequantize(
                    torch.float32, scale=scale.reshape(scale.shape[0], scale.shape[2]), block_sizes={-1: 128, -2: 128}
                )
            else:
                w = FP8QTensor(q.shape, torch.float32, q).dequantize(
                    torch.float32, scale=scale.reshape(-1, 1) if scale.dim() == 1 else scale
                )
            weights[f"{module}.weight"] = w.float()
    return weights


def _gptq_v1_weight(checkpoint: Path, module: str) -> torch.Tensor:
    """``scales[g] * (q - (z + 1))`` of a 4-bit GPTQ v1 layer, ``[out, in]`` float32:
    eight values an int32 word, lowest bits first, inputs along qweight's rows and
    outputs along qzeros' columns; v1 stores each zero point minus one."""
    from safetensors import safe_open

    with safe_open(str(checkpoint / "model.safetensors"), framework="pt") as f:
        qweight, qzeros, scales, g_idx = (f.get_tensor(f"{module}.{name}")
                                          for name in ("qweight", "qzeros", "scales", "g_idx"))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = ((qweight[:, None, :] >> shifts[None, :, None]) & 15).reshape(-1, qweight.shape[1])  # [in, out]
    zeros = ((qzeros[:, :, None] >> shifts[None, None, :]) & 15).reshape(qzeros.shape[0], -1) + 1  # [groups, out]
    g = g_idx.long()
    return (scales.float()[g] * (q - zeros[g]).float()).T.contiguous()


BITSANDBYTES = {
    "bnb-nf4": {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                "bnb_4bit_compute_dtype": torch.bfloat16},
    "bnb-fp4": {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4", "bnb_4bit_use_double_quant": False},
    "bnb-int8": {"load_in_8bit": True},
}


def make_bitsandbytes(scheme: str, dense: Path, out: Path, reference: Path) -> None:
    """transformers quantizes while loading (bitsandbytes' CPU backend) and saves the checkpoint; the
    reference is every quantized layer's weight as bitsandbytes itself dequantizes it."""
    from bitsandbytes.functional import dequantize_4bit
    from bitsandbytes.nn import Linear4bit, Linear8bitLt
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32, device_map="cpu",
                                                 quantization_config=BitsAndBytesConfig(**BITSANDBYTES[scheme]))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(dense).save_pretrained(out)
    replaced = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear4bit):
            weight = dequantize_4bit(module.weight.data, module.weight.quant_state)
        elif isinstance(module, Linear8bitLt):
            weight = module.weight.data.float() * module.weight.SCB.float()[:, None] / 127
        else:
            continue
        replaced[f"{name}.weight"] = weight.float()
    assert replaced, f"{scheme}: transformers quantized no layer"
    float_model = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32)
    _save_reference(float_model, dense, reference, replaced)


def make(scheme: str, dense: Path, out_dir: Path) -> None:
    if scheme not in SCHEMES:
        raise SystemExit(f"unknown scheme {scheme!r}; known: {', '.join(SCHEMES)}")
    final, final_ref = out_dir / scheme, out_dir / f"{scheme}-reference"
    if (final / "config.json").exists() and (final_ref / "config.json").exists():
        return
    tmp, tmp_ref = out_dir / f".{scheme}.tmp", out_dir / f".{scheme}-reference.tmp"
    for path in (tmp, tmp_ref, final, final_ref):
        shutil.rmtree(path, ignore_errors=True)
    torch.manual_seed(0)
    maker = (make_auto_round if scheme in AUTOROUND_FORMATS else make_modelopt if scheme in MODELOPT_CONFIGS
             else make_bitsandbytes if scheme in BITSANDBYTES
             else make_llm_compressor_moe if scheme in MOE_SCHEMES else make_llm_compressor)
    maker(scheme, dense, tmp, tmp_ref)
    tmp_ref.rename(final_ref)
    tmp.rename(final)


def main(argv: list[str]) -> None:
    if len(argv) < 3:
        raise SystemExit(__doc__)
    dense, out_dir = Path(argv[0]), Path(argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for scheme in argv[2:]:
        make(scheme, dense, out_dir)


if __name__ == "__main__":
    main(sys.argv[1:])
