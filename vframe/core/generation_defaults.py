"""Default sampling parameters from a model's ``generation_config.json`` (vLLM's
``generation_config`` setting).

``"auto"`` reads the model directory's file, a directory path reads that
directory's, ``"vllm"`` reads none. Only the fields vLLM takes are used, with
transformers' ``max_new_tokens`` renamed to ``max_tokens``; they become the
``SamplingParams`` of ``LLM.generate`` / ``LLM.chat`` calls that give none.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vframe.errors import ConfigError

# generation_config.json field -> SamplingParams field
_FIELDS = {
    "repetition_penalty": "repetition_penalty",
    "temperature": "temperature",
    "top_k": "top_k",
    "top_p": "top_p",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
FILE_NAME = "generation_config.json"


def load_generation_defaults(setting: str, model_dir: Path) -> dict[str, Any]:
    """The ``SamplingParams`` keywords the setting's ``generation_config.json`` sets."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        path = model_dir / FILE_NAME
        if not path.is_file():
            return {}
    else:
        path = Path(setting).expanduser() / FILE_NAME
        if not path.is_file():
            raise ConfigError(
                f"generation_config={setting!r}: {path} does not exist; give a directory holding "
                f"{FILE_NAME}, 'auto' (the model's) or 'vllm' (SamplingParams defaults)"
            )
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path}: not a readable JSON file ({e})") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must hold a JSON object")
    return {ours: data[theirs] for theirs, ours in _FIELDS.items() if data.get(theirs) is not None}
