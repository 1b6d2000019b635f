"""Checkpoint tensors into a model's parameters, by name, through each parameter's loader.

A model's ``load_weights`` maps each checkpoint name to ``(parameter, shard id)``;
the parameter's own ``weight_loader`` (set by ``vframe.layers.linear`` and the
quantization methods) places the tensor. So fused (q/k/v, gate/up), sharded and
packed weights take one path, and models only declare their fused names.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from vframe.errors import ModelLoadError

# Per-layer KV-cache scales that FP8 checkpoints (vLLM's, ModelOpt's) may carry, by tensor name; and what
# llm-compressor's attention quantization writes beside them: the query's scale (read, not used: attention
# runs in the model's dtype) and each one's zero point (symmetric: zeros).
KV_CACHE_SCALES = ("k_scale", "v_scale", "kv_scale", "q_scale", "q_zero_point", "k_zero_point", "v_zero_point")

# (fused parameter's module, checkpoint module, shard id): ("qkv_proj", "q_proj", "q")
StackedParams = Sequence[tuple[str, str, str | int]]


def default_weight_loader(param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Copy the whole tensor: parameters outside the linear layers (norms, embeddings)."""
    if shard_id is not None:
        raise ValueError(f"a parameter without a weight_loader takes no shard id; got {shard_id!r}")
    if param.shape != loaded_weight.shape:
        raise ModelLoadError(f"has shape {tuple(loaded_weight.shape)}, the model expects {tuple(param.shape)}")
    param.data.copy_(loaded_weight)


def load_named_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], stacked_params: StackedParams = ()
) -> set[str]:
    """Load ``(checkpoint name, tensor)`` pairs into ``model``; return the names of
    the parameters now fully loaded. A fused parameter counts once every shard
    its layer lists in ``shard_ids`` has arrived (or the fused tensor itself)."""
    params = dict(model.named_parameters())
    shards_seen: dict[str, set[str | int]] = {}
    loaded: set[str] = set()
    for name, tensor in weights:
        target, shard_id = _target(name, stacked_params)
        param = params.get(target)
        if param is None:
            if name.rpartition(".")[2] in KV_CACHE_SCALES:
                set_kv_cache_scale(model, name, tensor)
                continue
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has no place in {type(model).__name__}{_why(model, target)}"
            )
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard_id is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard_id)
        except ModelLoadError as e:
            raise ModelLoadError(f"checkpoint tensor {name!r} {e}") from None
        if shard_id is None:
            loaded.add(target)
            continue
        seen = shards_seen.setdefault(target, set())
        seen.add(shard_id)
        if seen >= set(model.get_submodule(target.rpartition(".")[0]).shard_ids):
            loaded.add(target)
    return loaded


def process_weights_after_loading(model: nn.Module) -> None:
    """Let every layer's quantization method finish its weights (quantize, repack).

    Unquantized bfloat16 weights on the CPU are repacked for oneDNN
    (``vframe/quant/onednn_packed.py``) only in models that declare
    ``supports_packed_weights = True`` (they never read a linear layer's ``weight``
    as a tensor, or mark such a layer ``needs_plain_weight``); in those models MoE layers
    pack their experts too (``FusedMoE.process_weights_after_loading``, plugin API 1.14)."""
    plain = not getattr(model, "supports_packed_weights", False)
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            if plain:
                module.needs_plain_weight = True
            method.process_weights_after_loading(module)
        elif not plain and callable(getattr(module, "process_weights_after_loading", None)):
            module.process_weights_after_loading()  # a layer that packs its own weights (FusedMoE)


def attention_impls(module: nn.Module) -> list:
    """The attention impls ``module`` itself holds (``AttentionImpl`` / ``MLAAttentionImpl``:
    plain objects, not submodules), in attribute order."""
    from vframe.core.interfaces import AttentionImpl, MLAAttentionImpl

    return [v for v in vars(module).values() if isinstance(v, (AttentionImpl, MLAAttentionImpl))]


def set_kv_cache_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Give a calibrated FP8 KV-cache scale to its layer's attention impl (plugin API 1.19:
    ``AttentionImpl.k_scale`` / ``v_scale``; ``kv_scale`` sets both). The names the tools write:
    ``<attention>.k_scale`` (llm-compressor, vLLM), ``<attention>.k_proj.k_scale`` (ModelOpt),
    ``<attention>.attn.k_scale``: the nearest module on the name's path that holds one
    attention impl takes it. One positive finite value per layer, or (plugin API 1.22,
    llm-compressor's ``strategy: attn_head``, ``[KVH, 1, 1]``) one per KV head of the model:
    the impl's ``k_head_scales`` / ``v_head_scales`` then hold this rank's heads. A ``q_scale``
    (llm-compressor's attention quantization: the query's, for attention computed in float8, as
    vLLM's FlashAttention 3 does) needs an attention layer on its path and is not kept (nor its
    values checked: llm-compressor 0.14 on a CPU writes them uncalibrated); so are the zero points
    it writes beside each scale, which must be zero for keys and values (symmetric float8)."""
    kind = name.rpartition(".")[2]
    if kind.startswith("q_") or kind.endswith("_zero_point"):
        _scaled_attention_impl(model, name)
        if kind in ("k_zero_point", "v_zero_point") and bool(tensor.float().ne(0).any()):
            raise ModelLoadError(
                f"checkpoint tensor {name!r} is a nonzero zero point: vframe's float8 KV cache is symmetric (scales "
                "only), as vLLM's"
            )
        return
    values = tensor.detach().float().reshape(-1)
    bad = values[~((values > 0) & (values < float("inf")))]
    if values.numel() == 0 or bad.numel():
        raise ModelLoadError(
            f"checkpoint tensor {name!r} is a KV-cache scale of {float(bad[0]) if bad.numel() else 'nothing'}; "
            "a scale must be positive and finite"
        )
    impl = _scaled_attention_impl(model, name)
    if values.numel() == 1:
        value = float(values[0])
        if kind in ("k_scale", "kv_scale"):
            impl.k_scale = value
        if kind in ("v_scale", "kv_scale"):
            impl.v_scale = value
        return
    heads = _rank_heads(impl, values, name, tuple(tensor.shape))
    if kind in ("k_scale", "kv_scale"):
        impl.k_head_scales = heads
    if kind in ("v_scale", "kv_scale"):
        impl.v_head_scales = heads


def _scaled_attention_impl(model: nn.Module, name: str) -> object:
    """The one attention impl (``AttentionImpl`` / ``MLAAttentionImpl``) the nearest module on
    ``name``'s path holds."""
    parts = name.split(".")[:-1]
    while parts:
        try:
            module = model.get_submodule(".".join(parts))
        except AttributeError:
            parts.pop()
            continue
        impls = attention_impls(module)
        if len(impls) == 1:
            return impls[0]
        parts.pop()
    raise ModelLoadError(f"checkpoint tensor {name!r} is a KV-cache scale with no attention layer on its path in "
                         f"{type(model).__name__}")


def _rank_heads(impl: object, values: torch.Tensor, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """This rank's share of per-KV-head scales ``values`` ([total KV heads]), as the q / k / v
    projection splits the heads: ``num_kv_heads`` consecutive heads a rank, or with more ranks
    than heads, each head on ``tp / heads`` consecutive ranks."""
    from vframe.core.interfaces import AttentionImpl
    from vframe.layers.parallel import get_tp_rank, get_tp_size

    if not isinstance(impl, AttentionImpl):
        raise ModelLoadError(
            f"checkpoint tensor {name!r} holds {values.numel()} FP8 KV-cache scales (shape {shape}) for a multi-head "
            "latent attention layer, whose cache holds one latent per token: it takes one scale"
        )
    total, rank, tp, mine = values.numel(), get_tp_rank(), get_tp_size(), impl.num_kv_heads
    if tp <= total and total == mine * tp:
        return values[rank * mine : (rank + 1) * mine].clone()
    if tp > total and tp % total == 0 and mine == 1:
        return values[rank // (tp // total)].reshape(1).clone()
    raise ModelLoadError(
        f"checkpoint tensor {name!r} holds {total} FP8 KV-cache scales (shape {shape}), and its attention layer has "
        f"{mine} KV head{'s' if mine != 1 else ''}" + (f" on each of {tp} tensor-parallel ranks" if tp > 1 else "")
        + ": a calibrated scale is one value per layer, or one per KV head of the model"
    )


def _why(model: nn.Module, target: str) -> str:
    """What the module ``target`` names holds instead, when it exists: a quantized
    layer given a float weight (or the reverse) is a checkpoint whose tensors and
    ``quantization_config`` disagree."""
    module_name, _, _ = target.rpartition(".")
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return ""
    held = ", ".join(name for name, _ in module.named_parameters(recurse=False)) or "no tensors"
    method = getattr(module, "quant_method", None)
    how = f" (quantization method {type(method).__name__})" if method is not None else ""
    return f": its layer {module_name!r} holds {held}{how}"


def _target(name: str, stacked_params: StackedParams) -> tuple[str, str | int | None]:
    module_name, _, leaf = name.rpartition(".")  # leaf: weight | bias | qweight | scales ...
    parent, _, module = module_name.rpartition(".")
    for fused, checkpoint_module, shard_id in stacked_params:
        if module == checkpoint_module:
            return f"{parent}.{fused}.{leaf}" if parent else f"{fused}.{leaf}", shard_id
    return name, None
