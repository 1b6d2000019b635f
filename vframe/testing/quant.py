"""Conformance checks for quantizers: ``check_quant_method``.

The check builds every kind of vframe linear layer with the quantizer's
method, as a model would, at a few sizes and shards::

    ReplicatedLinear            in -> out
    ColumnParallelLinear        in -> out / tp
    MergedColumnParallelLinear  in -> [gate | up] / tp             shard ids 0, 1
    QKVParallelLinear           hidden -> [q | k | v] / tp (GQA)   shard ids "q", "k", "v"
    RowParallelLinear           in / tp -> out (partial sums)

loads random float weights through the parameters' own ``weight_loader``
(one checkpoint tensor per fused shard, as ``load_weights`` does), runs
``process_weights_after_loading``, and compares ``apply`` with plain PyTorch.

What "correct" means
--------------------
With ``W`` the float weight this rank's layer should hold (its q/k/v or
gate/up rows, its input columns, cut by the kit independently of the layers),
``W_deq = method.dequantize_weight(layer)`` and ``tol = stated + 2 * eps(dtype)``
(the stated tolerances are for float32; the slack covers one rounding of the
output in a narrower dtype):

* ``W_deq`` has shape ``[out / tp, in / tp]`` and, row by row,
  ``max |W_deq - W| <= (weight_tolerance + tol slack) * max |W|``: the
  quantization error the config states (``QuantizationConfig.weight_tolerance``).
  A weight placed in the wrong rows (a fused shard or a rank cut wrong) fails here.
* ``apply(layer, x, bias)`` for ``x`` of a few token counts has shape
  ``[T, out / tp]``, the activation dtype, no NaN or inf, and
  ``max |apply - ref| <= (reference_tolerance + slack) * max |ref|`` where
  ``ref = F.linear(x, W_deq, bias)`` in float64 from the same inputs
  (``QuantizationConfig.reference_tolerance``).
* ``bind(layer, bias)``, where it returns a function, gives ``apply``'s output bit
  for bit on the same inputs, and so does the operator call the function says it is
  (``vframe.quant.native_call``).
* At least one layer kind is quantized (``get_quant_method`` returned a method).

Methods that quantize on load (``from_config(None)``) receive the float
weights themselves, as ``weight`` and ``bias``. A checkpoint-format method
(GPTQ, AWQ, FP8 checkpoints) needs its own tensors: pass
``checkpoint_tensors=fn``, where ``fn(weight)`` turns one float ``[out, in]``
checkpoint weight (a single q/k/v or gate/up shard, or a whole unfused layer)
into the tensors a checkpoint of that format stores for it, by parameter name
(``{"qweight": ..., "scales": ..., "qzeros": ...}``); each is loaded through
its parameter's loader with the shard id. Biases are always float ``bias``.

``quick=True`` runs one size set at tensor-parallel size 1; the full check
adds larger sizes, an MQA shape and both ranks of tensor-parallel size 2
(kv heads replicated across ranks), which exercises ``output_dim`` /
``input_dim`` of every parameter the method creates.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from vframe.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from vframe.quant.base import LinearMethodBase, QuantizationConfig, bound_apply
from vframe.quant.native_call import native_result

CheckpointTensors = Callable[[torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class _Sizes:
    hidden: int
    head_size: int
    num_heads: int
    num_kv_heads: int
    intermediate: int
    bias: bool  # of QKV, column and row layers; merged and replicated take the opposite


# Multiples of 128 along every input and of 64 along every output, per rank too,
# so that group-quantized and packed formats can take every layer.
_QUICK = [_Sizes(hidden=128, head_size=32, num_heads=8, num_kv_heads=2, intermediate=256, bias=True)]
_FULL = _QUICK + [_Sizes(hidden=256, head_size=64, num_heads=4, num_kv_heads=1, intermediate=512, bias=False)]


@dataclass
class _Case:
    name: str
    layer: LinearBase
    shards: list[tuple[str | int | None, torch.Tensor, torch.Tensor | None]]  # (shard id, W [out, in], b [out])
    expected: torch.Tensor  # [out / tp, in / tp]: this rank's part of the fused W
    expected_bias: torch.Tensor | None  # [out / tp]


def check_quant_method(
    quantizer: str | type[QuantizationConfig],
    *,
    hf_quant_config: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    quick: bool = False,
    checkpoint_tensors: CheckpointTensors | None = None,
    device: torch.device | str = "cpu",
) -> None:
    """Check a quantizer's linear method on every layer kind; raises ``AssertionError``.

    ``quantizer``: a ``quantizer`` registry name or the ``QuantizationConfig``
    class; ``hf_quant_config``: what ``from_config`` gets (a checkpoint's
    ``quantization_config``, or ``None``); ``dtype``: the activation dtype;
    ``checkpoint_tensors``: for checkpoint formats, see the module docstring;
    ``device``: where the layers and inputs live (``"cuda"`` for a GPU kernel)."""
    config_cls = _load(quantizer)
    reasons = config_cls.validate_configuration(dtype=dtype, device=torch.device(device))
    assert not reasons, f"{config_cls.__name__} refuses dtype={dtype} on {device}: {'; '.join(reasons)}"
    config = config_cls.from_config(hf_quant_config)
    slack = 2 * torch.finfo(dtype).eps
    generator = torch.Generator().manual_seed(0)
    ranks = [(0, 1)] if quick else [(0, 1), (0, 2), (1, 2)]
    token_counts = (1, 7) if quick else (1, 7, 64)
    quantized = 0
    for sizes in _QUICK if quick else _FULL:
        for tp_rank, tp_size in ranks:
            with torch.device(device):
                cases = _cases(config, sizes, dtype, tp_rank, tp_size, generator, torch.device(device))
            for case in cases:
                where = f"{case.name} (tp rank {tp_rank} of {tp_size})"
                quantized += isinstance(config.get_quant_method(case.layer, case.layer.prefix), LinearMethodBase)
                _load_case(case, checkpoint_tensors, where)
                case.layer.quant_method.process_weights_after_loading(case.layer)
                _check_weight(case, config.weight_tolerance + slack, where)
                for num_tokens in token_counts:
                    x = torch.randn(num_tokens, case.layer.input_size_per_partition, generator=generator, device="cpu")
                    _check_apply(case, x.to(device=device, dtype=dtype), config.reference_tolerance + slack, where)
    assert quantized, f"{config_cls.__name__}.get_quant_method returned None for every layer: nothing was quantized"


def _load(quantizer: str | type[QuantizationConfig]) -> type[QuantizationConfig]:
    if isinstance(quantizer, str):
        from vframe.plugins import get_registry

        return get_registry("quantizer").load(quantizer)
    assert isinstance(quantizer, type) and issubclass(quantizer, QuantizationConfig), (
        f"{quantizer!r} is not a QuantizationConfig subclass"
    )
    return quantizer


def _cases(
    config: QuantizationConfig,
    s: _Sizes,
    dtype: torch.dtype,
    tp_rank: int,
    tp_size: int,
    generator: torch.Generator,
    device: torch.device,
) -> list[_Case]:
    def tensors(out: int, inp: int, bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        w = torch.randn(out, inp, generator=generator, device="cpu") / inp**0.5  # [out, in]: outputs O(1)
        b = torch.randn(out, generator=generator, device="cpu") if bias else None
        return w.to(device, dtype), None if b is None else b.to(device, dtype)

    def rows(t: torch.Tensor | None, index: int, count: int) -> torch.Tensor | None:
        return None if t is None else t.chunk(count, dim=0)[index]

    kw = dict(quant_config=config, params_dtype=dtype, tp_rank=tp_rank, tp_size=tp_size)
    cases = []

    # [q | k | v]: q by rank, k and v by the rank's kv head (replicated when tp > kv heads)
    layer = QKVParallelLinear(s.hidden, s.head_size, s.num_heads, s.num_kv_heads, bias=s.bias, prefix="qkv_proj", **kw)
    kv_ranks = tp_size // layer.num_kv_head_replicas
    kv_rank = tp_rank // layer.num_kv_head_replicas
    q, k, v = (tensors(n * s.head_size, s.hidden, s.bias) for n in (s.num_heads, s.num_kv_heads, s.num_kv_heads))
    parts = [(rows(q[0], tp_rank, tp_size), rows(q[1], tp_rank, tp_size))]
    parts += [(rows(t[0], kv_rank, kv_ranks), rows(t[1], kv_rank, kv_ranks)) for t in (k, v)]
    cases.append(_case(f"QKVParallelLinear{_shape(s)}", layer, [("q", *q), ("k", *k), ("v", *v)], parts))

    layer = MergedColumnParallelLinear(s.hidden, [s.intermediate] * 2, bias=not s.bias, prefix="gate_up_proj", **kw)
    gate, up = tensors(s.intermediate, s.hidden, not s.bias), tensors(s.intermediate, s.hidden, not s.bias)
    parts = [(rows(w, tp_rank, tp_size), rows(b, tp_rank, tp_size)) for w, b in (gate, up)]
    name = f"MergedColumnParallelLinear({s.hidden} -> 2x{s.intermediate})"
    cases.append(_case(name, layer, [(0, *gate), (1, *up)], parts))

    layer = ColumnParallelLinear(s.hidden, s.intermediate, bias=s.bias, prefix="column", **kw)
    w, b = tensors(s.intermediate, s.hidden, s.bias)
    parts = [(rows(w, tp_rank, tp_size), rows(b, tp_rank, tp_size))]
    cases.append(_case(f"ColumnParallelLinear({s.hidden} -> {s.intermediate})", layer, [(None, w, b)], parts))

    layer = RowParallelLinear(s.intermediate, s.hidden, bias=s.bias, prefix="row", **kw)
    w, b = tensors(s.hidden, s.intermediate, s.bias)
    parts = [(w.chunk(tp_size, dim=1)[tp_rank], b)]
    cases.append(_case(f"RowParallelLinear({s.intermediate} -> {s.hidden})", layer, [(None, w, b)], parts))

    layer = ReplicatedLinear(s.hidden, s.hidden // 2, bias=not s.bias, prefix="replicated", **kw)
    w, b = tensors(s.hidden // 2, s.hidden, not s.bias)
    cases.append(_case(f"ReplicatedLinear({s.hidden} -> {s.hidden // 2})", layer, [(None, w, b)], [(w, b)]))
    return cases


def _shape(s: _Sizes) -> str:
    return f"(hidden {s.hidden}, {s.num_heads} heads, {s.num_kv_heads} kv heads of {s.head_size})"


def _case(name: str, layer: LinearBase, shards: list, parts: list) -> _Case:
    weights = [w for w, _ in parts]
    biases = [b for _, b in parts]
    bias = None if biases[0] is None else torch.cat(biases)
    return _Case(name, layer, shards, torch.cat(weights), bias)


def _load_case(case: _Case, checkpoint_tensors: CheckpointTensors | None, where: str) -> None:
    layer = case.layer
    for name, param in layer.named_parameters():
        assert callable(getattr(param, "weight_loader", None)), f"{where}: parameter {name!r} has no weight_loader"
    for shard_id, weight, bias in case.shards:
        named = checkpoint_tensors(weight) if checkpoint_tensors is not None else {"weight": weight}
        if bias is not None:
            named = {**named, "bias": bias}
        for name, tensor in named.items():
            param = getattr(layer, name, None)
            assert isinstance(param, torch.nn.Parameter), (
                f"{where}: the method created no parameter {name!r} to load a checkpoint tensor into "
                f"(parameters: {[n for n, _ in layer.named_parameters()]})"
            )
            try:
                if shard_id is None:
                    param.weight_loader(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard_id)
            except Exception as e:  # noqa: BLE001 - any loader failure is the method's to fix
                raise AssertionError(
                    f"{where}: loading {name!r} of shard {shard_id!r} failed: {type(e).__name__}: {e}"
                ) from e
    assert (layer.bias is None) == (case.expected_bias is None), f"{where}: bias created or dropped"


def _check_weight(case: _Case, tolerance: float, where: str) -> None:
    try:
        w_deq = case.layer.quant_method.dequantize_weight(case.layer)
    except NotImplementedError as e:
        raise AssertionError(f"{where}: {e}; the conformance check needs it") from None
    expected = case.expected.double()
    assert tuple(w_deq.shape) == tuple(expected.shape), (
        f"{where}: dequantize_weight has shape {tuple(w_deq.shape)}, "
        f"expected {tuple(expected.shape)} [out / tp, in / tp]"
    )
    error = (w_deq.double() - expected).abs().amax(dim=1)  # [out]
    scale = expected.abs().amax(dim=1).clamp(min=1e-30)
    worst = int((error / scale).argmax())
    assert bool((error <= tolerance * scale).all()), (
        f"{where}: dequantized weight row {worst} is off by {float(error[worst]):.3g}, "
        f"{float(error[worst] / scale[worst]):.3g} of the row's largest |w| (allowed: {tolerance:.3g}); "
        "a shard or rank placed in the wrong rows, or a quantization error above weight_tolerance"
    )


def _check_apply(case: _Case, x: torch.Tensor, tolerance: float, where: str) -> None:
    layer = case.layer
    row_parallel_split = isinstance(layer, RowParallelLinear) and layer.tp_size > 1
    # A row-parallel rank's partial sum takes no bias: the layer adds it once, after the all-reduce.
    bias = None if row_parallel_split else layer.bias
    with torch.inference_mode():
        out = layer.quant_method.apply(layer, x, bias) if row_parallel_split else layer(x)
        w_deq = layer.quant_method.dequantize_weight(layer)
        bound = bound_apply(layer.quant_method, layer, bias)
        bound_out = None if bound is None else bound(x)
        native_out = None if bound is None else native_result(bound, x)
    where = f"{where}, {x.shape[0]} tokens"
    assert bound_out is None or torch.equal(bound_out, out), (
        f"{where}: the function bind returned differs from apply (it must compute the same, bit for bit)"
    )
    assert native_out is None or torch.equal(native_out, out), (
        f"{where}: the NativeCall that bind's function carries differs from apply (it must compute the same, "
        "bit for bit)"
    )
    expected_shape = (x.shape[0], layer.output_size_per_partition)
    assert tuple(out.shape) == expected_shape, (
        f"{where}: apply returned shape {tuple(out.shape)}, expected {expected_shape}"
    )
    assert out.dtype == x.dtype, f"{where}: apply returned {out.dtype} for {x.dtype} activations"
    assert bool(torch.isfinite(out).all()), f"{where}: apply returned NaN or inf"
    ref = F.linear(x.double(), w_deq.double(), None if bias is None else bias.double())
    error = float((out.double() - ref).abs().max())
    magnitude = float(ref.abs().max().clamp(min=1e-30))
    assert error <= tolerance * magnitude, (
        f"{where}: apply differs from F.linear(x, dequantize_weight, bias) by {error:.3g}, "
        f"{error / magnitude:.3g} of the output's largest |y| (allowed: {tolerance:.3g}, reference_tolerance)"
    )
    if case.expected_bias is not None and not row_parallel_split:
        assert torch.equal(layer.bias, case.expected_bias), f"{where}: bias loaded into the wrong entries"
