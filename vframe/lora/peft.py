"""Reading a PEFT LoRA adapter directory into host tensors, refusing what vframe cannot serve.

A PEFT directory holds ``adapter_config.json`` and ``adapter_model.safetensors``
with one ``A`` and one ``B`` per adapted module, named by the module's path in
the Hugging Face model::

    base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight   [r, in]
    base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight   [out, r]

The tensors say which modules are adapted (``target_modules``,
``layers_to_transform`` and ``exclude_modules`` only decided that at training
time); the config gives each module's rank and alpha (``r`` / ``lora_alpha``,
overridden per module by ``rank_pattern`` / ``alpha_pattern``) and so its
scaling, ``alpha / r`` or ``alpha / sqrt(r)`` with ``use_rslora``. Nothing is
ever unpickled: ``adapter_model.bin`` is refused.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vframe.errors import LoRAAdapterError
from vframe.lora.request import LoRARequest

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_TENSOR_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight")
# Modules whose adapters change the vocabulary side of the model: not served.
_EMBEDDING_MODULES = ("embed_tokens", "lm_head")


@dataclass(frozen=True)
class LoRAWeights:
    """One adapted module.

    Attributes:
        lora_a: ``[r, in]`` the down projection, on the CPU.
        lora_b: ``[out, r]`` the up projection, on the CPU.
        scaling: what ``B A x`` is multiplied by.
    """

    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.lora_a.shape[0]


@dataclass
class LoRAAdapter:
    """A loaded adapter: its weights by Hugging Face module path
    (``model.layers.0.self_attn.q_proj``).

    Attributes:
        request: the request it was loaded for.
        rank: the largest rank of its modules.
        modules: module path -> its ``LoRAWeights``.
    """

    request: LoRARequest
    rank: int
    modules: dict[str, LoRAWeights] = field(default_factory=dict)


def load_peft_adapter(request: LoRARequest, *, max_lora_rank: int) -> LoRAAdapter:
    """Read the PEFT adapter at ``request.lora_path``; raises ``LoRAAdapterError``
    naming the adapter, its path and what is wrong if it cannot be served."""
    path = Path(request.lora_path)
    config = _read_config(request, path)
    _check_config(request, config)
    tensors = _read_tensors(request, path)

    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        if "lora_embedding_" in name:
            raise adapter_error(
                request, f"has an embedding adapter ({name}); adapters of embed_tokens are not supported"
            )
        match = _TENSOR_NAME.fullmatch(name)
        if match is None:
            raise adapter_error(
                request,
                f"has tensor {name!r} in {WEIGHTS_FILE}, which is not a LoRA A or B weight "
                f"('{_PREFIX}<module>.lora_A.weight'); DoRA, LoRA biases and trained modules are not supported",
            )
        module, which = match["module"], match["which"]
        if module.rsplit(".", 1)[-1] in _EMBEDDING_MODULES:
            raise adapter_error(request, f"adapts {module}; adapters of embed_tokens and lm_head are not supported")
        pairs.setdefault(module, {})[which] = tensor
    if not pairs:
        raise adapter_error(request, f"has no LoRA weights in {WEIGHTS_FILE}")

    modules: dict[str, LoRAWeights] = {}
    for module, pair in sorted(pairs.items()):
        modules[module] = _module_weights(request, config, module, pair)
    rank = max(weights.rank for weights in modules.values())
    if rank > max_lora_rank:
        raise adapter_error(request, f"has rank {rank} > max_lora_rank={max_lora_rank}; raise max_lora_rank")
    return LoRAAdapter(request, rank, modules)


def adapter_error(request: LoRARequest, what: str) -> LoRAAdapterError:
    return LoRAAdapterError(f"adapter {request.lora_name!r} ({request.lora_path}) {what}")


def _read_config(request: LoRARequest, path: Path) -> dict[str, Any]:
    config_file = path / CONFIG_FILE
    if not config_file.is_file():
        raise adapter_error(request, f"has no {CONFIG_FILE}; lora_path must be a PEFT adapter directory")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise adapter_error(request, f"has an unreadable {CONFIG_FILE}: {e}") from e
    if not isinstance(config, dict):
        raise adapter_error(request, f"has a {CONFIG_FILE} that is not a JSON object")
    return config


def _check_config(request: LoRARequest, config: dict[str, Any]) -> None:
    """Refuse every PEFT option that changes what the adapter computes beyond ``B A x``."""
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise adapter_error(request, f"is a {peft_type} adapter; only LoRA (peft_type 'LORA') is supported")
    refusals = {
        "bias": ("none", "biases trained with the adapter are not supported; train with bias='none'"),
        "fan_in_fan_out": (False, "fan_in_fan_out=true (Conv1D-style weights) is not supported"),
        "use_dora": (False, "DoRA (use_dora=true) is not supported"),
        "lora_bias": (False, "lora_bias=true is not supported"),
        "use_qalora": (False, "QA-LoRA (use_qalora=true) is not supported"),
    }
    for key, (allowed, reason) in refusals.items():
        value = config.get(key, allowed)
        if value != allowed:
            raise adapter_error(request, f"has {key}={value!r}: {reason}")
    for key, reason in (
        ("modules_to_save", "fully trained modules are not supported; serve a model with them merged"),
        ("target_parameters", "adapters of raw parameters (MoE experts) are not supported"),
        ("trainable_token_indices", "trainable token embeddings are not supported"),
        ("alora_invocation_tokens", "activated LoRA (aLoRA) is not supported"),
    ):
        if config.get(key):
            raise adapter_error(request, f"has {key}={config[key]!r}: {reason}")
    targets = config.get("target_modules")
    if isinstance(targets, str):
        try:
            hit = [m for m in ("model.embed_tokens", "lm_head") if re.fullmatch(targets, m)]
        except re.error as e:
            raise adapter_error(request, f"has target_modules={targets!r}, not a regular expression: {e}") from e
    else:
        hit = [t for t in targets or [] if str(t).rsplit(".", 1)[-1] in _EMBEDDING_MODULES]
    if hit:
        raise adapter_error(
            request, f"targets {', '.join(hit)}; adapters of embed_tokens and lm_head are not supported"
        )
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise adapter_error(request, f"has {key}={value!r} in {CONFIG_FILE}; expected a positive number")


def _read_tensors(request: LoRARequest, path: Path) -> dict[str, torch.Tensor]:
    weights_file = path / WEIGHTS_FILE
    if not weights_file.is_file():
        if (path / "adapter_model.bin").is_file():
            raise adapter_error(
                request,
                "has only adapter_model.bin, which vframe does not unpickle; convert it to "
                f"{WEIGHTS_FILE} (PeftModel.from_pretrained(...).save_pretrained(dir, safe_serialization=True))",
            )
        raise adapter_error(request, f"has no {WEIGHTS_FILE}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(weights_file), device="cpu")
    except (OSError, SafetensorError) as e:
        raise adapter_error(request, f"has an unreadable {WEIGHTS_FILE}: {e}") from e


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's lookup (``peft.utils.other.get_pattern_key``): the first key matching
    the end of the module path, as a regex."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _module_weights(
    request: LoRARequest, config: dict[str, Any], module: str, pair: dict[str, torch.Tensor]
) -> LoRAWeights:
    missing = {"A", "B"} - pair.keys()
    if missing:
        raise adapter_error(request, f"has no lora_{missing.pop()} for {module}")
    lora_a, lora_b = pair["A"], pair["B"]
    if lora_a.dim() != 2 or lora_b.dim() != 2 or lora_a.shape[0] != lora_b.shape[1]:
        raise adapter_error(
            request,
            f"has {module}.lora_A of shape {list(lora_a.shape)} and lora_B of shape {list(lora_b.shape)}; "
            "expected [r, in] and [out, r]",
        )
    rank = _pattern_value(config.get("rank_pattern") or {}, module, config["r"])
    alpha = _pattern_value(config.get("alpha_pattern") or {}, module, config["lora_alpha"])
    if lora_a.shape[0] != rank:
        raise adapter_error(request, f"has {module}.lora_A of rank {lora_a.shape[0]}, but its config says r={rank}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora", False) else alpha / rank
    return LoRAWeights(lora_a, lora_b, scaling)
