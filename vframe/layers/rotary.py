"""Rotary position embedding frequencies, as transformers computes them.

``rope_frequencies(hf_config, dim)`` gives the inverse frequencies and the
attention factor for the config's ``rope_type``: ``default``, ``linear``,
``llama3`` and ``yarn``. The models apply the rotation themselves (Llama and
Qwen by halves, DeepSeek by pairs); every one multiplies cos and sin by the
attention factor (1 except under YaRN), as transformers does.

YaRN (https://arxiv.org/abs/2309.00071) keeps the fast-rotating dimensions (more than ``beta_fast`` turns over the
original context), interpolates the slow ones (fewer than ``beta_slow`` turns)
by ``factor``, and ramps linearly between them. It also returns the
"attention factor" by which cos and sin are multiplied, which scales every
attention score by its square. DeepSeek-V2/V3 multiply the softmax scale by
``yarn_get_mscale(factor, mscale_all_dim) ** 2`` on top (``mla_softmax_scale``
in ``vframe/models/deepseek.py``).

The other rope types (default, linear, llama3) are ``rope_inv_freq`` in
``vframe/models/llama.py``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from vframe.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any) -> dict[str, Any]:
    """The config's rope settings in transformers >= 5 spelling (``rope_parameters``),
    falling back on the older ``rope_scaling``."""
    params = dict(getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return params


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(hf_config: Any, dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] float32, attention_factor)`` of a ``rope_type="yarn"``
    config, as ``transformers.modeling_rope_utils._compute_yarn_parameters``."""
    params = rope_parameters(hf_config)
    base = params["rope_theta"]
    original_max = params.get("original_max_position_embeddings", hf_config.max_position_embeddings)
    # DeepSeek-V3 style configs may leave `factor` out: the context ratio is the factor.
    factor = params.get("factor") or hf_config.max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_get_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength fits `num_rotations` times into the original context.
        return dim * math.log(original_max / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp

    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)  # [dim/2]
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def rope_frequencies(hf_config: Any, dim: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] float32, attention_factor)`` for the config's rope type;
    ``ModelLoadError`` naming the supported ones for any other."""
    if rope_parameters(hf_config)["rope_type"] == "yarn":
        return yarn_inv_freq(hf_config, dim)
    return rope_inv_freq(hf_config, dim), 1.0


def rope_inv_freq(hf_config: Any, dim: int) -> torch.Tensor:  # [dim/2] float32
    """Inverse frequencies of the ``default``, ``linear`` and ``llama3`` rope types."""
    params = rope_parameters(hf_config)
    rope_type = params["rope_type"]
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (params["rope_theta"] ** exponents)
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / params["factor"]
    if rope_type == "llama3":
        # Long wavelengths are stretched by `factor`, short ones kept, the band between blended.
        factor = params["factor"]
        low_freq_factor = params["low_freq_factor"]
        high_freq_factor = params["high_freq_factor"]
        old_context_len = params["original_max_position_embeddings"]
        low_freq_wavelen = old_context_len / low_freq_factor
        high_freq_wavelen = old_context_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ModelLoadError(
        f"rope_type={rope_type!r} is not supported by vframe's rotary embedding; "
        f"supported: {', '.join(repr(t) for t in SUPPORTED_ROPE_TYPES)}"
    )
