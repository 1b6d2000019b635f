"""Poolers: one vector per prompt from the model's per-token hidden states.

The step's tokens are flattened prompt after prompt; ``query_start_loc`` marks
the prompts (see ``CommonAttentionMetadata``)::

    hidden           | p0 p0 p0 | p1 p1 |
    query_start_loc  = [0, 3, 5]
    MEAN  -> mean of rows 0..2, mean of rows 3..4
    CLS   -> rows 0 and 3 (each prompt's first token)
    LAST  -> rows 2 and 4 (each prompt's last token)

The pooling of a model, as vLLM resolves it: ``pooler_config`` (the engine
setting), else the checkpoint's sentence-transformers modules (``modules.json``:
a ``Pooling`` module's mode and whether a ``Normalize`` module follows), else the
model class's ``default_pooling_type`` (``LAST`` for decoders) with normalisation.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from vframe.errors import ConfigError

POOLING_TYPES = ("MEAN", "CLS", "LAST", "ALL")
# sentence-transformers' 1_Pooling/config.json flags -> pooling type
_ST_POOLING_MODES = {
    "pooling_mode_mean_tokens": "MEAN",
    "pooling_mode_cls_token": "CLS",
    "pooling_mode_lasttoken": "LAST",
}


@dataclass(frozen=True)
class PoolerConfig:
    """vLLM's ``PoolerConfig`` subset: how hidden states become an embedding."""

    pooling_type: str = "LAST"
    normalize: bool = True

    @classmethod
    def from_setting(cls, value: dict[str, Any], default: PoolerConfig) -> PoolerConfig:
        """``pooler_config={"pooling_type": "MEAN", "normalize": False}``; fields left out keep ``default``'s."""
        unknown = sorted(set(value) - {"pooling_type", "normalize"})
        if unknown:
            raise ConfigError(
                f"pooler_config keys {unknown} are not supported; it takes 'pooling_type' and 'normalize'"
            )
        pooling_type = str(value.get("pooling_type", default.pooling_type)).upper()
        if pooling_type not in POOLING_TYPES:
            raise ConfigError(
                f"pooler_config pooling_type={value.get('pooling_type')!r} is not supported; use one of {POOLING_TYPES}"
            )
        return cls(pooling_type, bool(value.get("normalize", default.normalize)))


def resolve_pooler_config(model_dir: Path, model: Any, setting: dict[str, Any] | None) -> PoolerConfig:
    """The pooling of ``model`` loaded from ``model_dir`` (see the module docstring)."""
    default = PoolerConfig(getattr(model, "default_pooling_type", "LAST"), normalize=True)
    from_checkpoint = _sentence_transformers_pooling(model_dir) or default
    return from_checkpoint if setting is None else PoolerConfig.from_setting(setting, from_checkpoint)


def _sentence_transformers_pooling(model_dir: Path) -> PoolerConfig | None:
    try:
        modules = json.loads((model_dir / "modules.json").read_text())
    except (OSError, ValueError):
        return None
    types = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in modules if isinstance(m, dict)]
    pooling = next((m for m in modules if isinstance(m, dict) and str(m.get("type", "")).endswith(".Pooling")), None)
    if pooling is None:
        return None
    try:
        flags = json.loads((model_dir / pooling.get("path", "") / "config.json").read_text())
    except (OSError, ValueError):
        return None
    modes = [kind for flag, kind in _ST_POOLING_MODES.items() if flags.get(flag)]
    if len(modes) != 1:
        return None  # max pooling, sqrt-len means and combinations: the model's default
    return PoolerConfig(modes[0], normalize="Normalize" in types)


def pool(
    hidden: torch.Tensor,  # [T, E]
    query_start_loc: list[int],  # B + 1
    pooling_type: str,
    normalize: bool,
) -> list[torch.Tensor]:
    """One float32 tensor per prompt: ``[E]``, or ``[n, E]`` for ``ALL`` (every token's)."""
    hidden = hidden.float()
    starts, ends = query_start_loc[:-1], query_start_loc[1:]
    if pooling_type == "ALL":
        rows = [hidden[s:e] for s, e in zip(starts, ends)]
        return [F.normalize(r, dim=-1) if normalize else r for r in rows]
    if pooling_type == "MEAN":
        lens = torch.tensor([e - s for s, e in zip(starts, ends)], device=hidden.device)
        segment = torch.repeat_interleave(torch.arange(len(lens), device=hidden.device), lens)  # [T]
        sums = torch.zeros(len(lens), hidden.shape[1], device=hidden.device).index_add_(0, segment, hidden)
        pooled = sums / lens[:, None]  # [B, E]
    elif pooling_type == "CLS":
        pooled = hidden[torch.tensor(starts, device=hidden.device)]
    elif pooling_type == "LAST":
        pooled = hidden[torch.tensor(ends, device=hidden.device) - 1]
    else:
        raise ValueError(f"unknown pooling type {pooling_type!r}")
    if normalize:
        pooled = F.normalize(pooled, dim=-1)
    return list(pooled.unbind(0))
