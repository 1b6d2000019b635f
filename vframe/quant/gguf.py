"""GGUF files kept quantized (``quantization="gguf"``): each linear layer holds
its tensors' llama.cpp blocks as the file stores them and dequantizes them in
the matmul.

The loader (``vframe.models.loader.gguf.iterate_gguf_quantized``) hands each
linear weight over as two tensors::

    <module>.qweight_type  int scalar                 the ggml type (Q4_1 = 3, Q6_K = 14, ...)
    <module>.qweight       uint8 [out, row bytes]     the rows' blocks, q / k rows un-permuted

A fused layer (``qkv_proj``, ``gate_up_proj``) receives one pair per shard;
shards may differ in type (a Q4_K_M file keeps some ``attn_v`` as Q6_K). After
loading, such a layer becomes one segment on one kernel where one takes its types
together (``_merged``), else runs of shards of one type form segments, each computed
on its own::

    rows      [ q             | k             | v             ]
    types       Q4_K            Q4_K            Q6_K
    segments  [ 0: Q4_K, quant kernel in segment0 | 1: Q6_K, bytes in qweight ]

Kernels, per segment:

* Q4_0 / Q4_1 / Q4_K and Q2_K / Q3_K (4 bit) and Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0
  (8 bit; the 5- and 6-bit types first offered in 6 bits, ``_six_bit``): an ``IntWeight``
  (``_int_weight``; ``gguf_dequant.int4_groups`` / ``int8_groups``) on the quant kernel
  ``vframe.quant.kernels.choose_kernel`` picks (on the CPU in bfloat16 with AVX512-BF16:
  ``int4_pairs`` / ``int6_pairs`` / ``int8_pairs``, which keep Q4_0 / Q4_1 / Q8_0 in the file's
  bytes; else ``int4_cpu`` for bfloat16 Q4, ``woq_cpu`` otherwise), its buffers in the
  submodule ``segment<i>``; the blocks are dropped. ``quant_kernel="woq_cpu_a8"`` runs the
  32-wide types with llama.cpp's numerics instead (activations quantized to int8 per
  block of 32, integer dot products; ``_named_kernel``).
* IQ4_NL / IQ4_XS (4-bit codes into llama.cpp's table of 16 non-linear values, a scale per
  32 inputs): a ``Lut4Weight`` (``gguf_dequant.lut4_groups``; the table kernels ``lut4_pairs``
  in bfloat16 with AVX512-BF16, else ``lut4_cpu``), the segment's blocks dropped.
* the float formats (F32, F16, BF16), and those above when the chosen kernel is the
  built-in ``reference``: the segment's bytes stay in ``qweight`` (uint8, the file's
  bytes, nothing else) and are dequantized to float32 on every call, cast, ``F.linear``.

Under tensor parallelism a linear layer's file tensors come whole; ``_rank_blocks`` has the
layer's own loader pick this rank's rows or inputs of their blocks (whole blocks, else refused).

The token embedding and the LM head tied to it are one ``GGUFEmbeddingMethod``
(``get_embedding_method``; ``vframe/layers/embedding.py``): lookups dequantize the
looked-up rows, the head runs a Q8_0 table as two int4 planes (bfloat16 CPU) or
the reference. An untied ``output.weight`` head is a ``GGUFLinearMethod`` layer. Both stay whole on every
tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vframe.errors import ConfigError, ModelLoadError
from vframe.layers.linear import LinearBase
from vframe.quant import int4_cpu
from vframe.quant.base import (
    BoundApply, EmbeddingMethodBase, LinearMethodBase, QuantizationConfig, bound_apply, fused_shard_index,
    load_rank_part, native_call, register_weight, with_native,
)
from vframe.quant.gguf_dequant import (
    FORMATS, GGML_TYPE_NAMES, INT4_TYPES, INT8_TYPES, LUT4_TYPES, dequantize, int4_groups, int8_groups, lut4_groups,
    row_bytes,
)
from vframe.quant.kernels import (
    INT8_PER_BLOCK, WEIGHT_ONLY, IntWeight, Lut4Weight, QuantLinearKernel, QuantLinearSpec, choose_kernel,
    reads_rows, refusal,
)

NAME = "gguf"
_INT4_GROUP = 32  # Q4_0 / Q4_1 blocks, Q4_K sub-blocks, Q8_0 blocks: one scale (and offset) per 32 inputs
INT_TYPES = INT4_TYPES + INT8_TYPES  # the types with an IntWeight form (_int_weight)
KERNEL_TYPES = INT_TYPES + LUT4_TYPES  # ... or a Lut4Weight one (IQ4_NL, IQ4_XS): the types a quant kernel takes
SIX_BIT_TYPES = ("Q5_0", "Q5_1", "Q5_K", "Q6_K")  # INT8_TYPES whose integers fit 6 bits (_six_bit)


class GGUFConfig(QuantizationConfig):
    # Q4_0 spans -8 d .. 7 d with d = (the block's largest |w|) / 8, so the other
    # sign's extreme is clamped by 1/8 of it; Q4_1 (1/15), 5 and 8 bit stay below.
    # The float16 scales add a little.
    weight_tolerance = 1 / 8 + 2**-9

    def __repr__(self) -> str:
        return "GGUFConfig()"

    @classmethod
    def get_name(cls) -> str:
        return NAME

    @classmethod
    def get_supported_dtypes(cls) -> list[torch.dtype]:
        return [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def validate_configuration(cls, *, dtype: torch.dtype, device: torch.device) -> list[str]:
        reasons = super().validate_configuration(dtype=dtype, device=device)
        if dtype == torch.bfloat16 and device.type != "cpu":
            # The bfloat16 path repacks Q4 blocks for a CPU-only kernel and drops them.
            reasons.append(f"dtype='bfloat16' runs GGUF on the CPU only; on {device.type} use dtype='float16'")
        return reasons

    @classmethod
    def from_config(cls, hf_quant_config: dict[str, Any] | None) -> GGUFConfig:
        if hf_quant_config is not None:
            raise ConfigError(
                "quantization='gguf' reads a .gguf file; this checkpoint is already quantized as "
                f"{hf_quant_config.get('quant_method')!r}: drop the quantization setting"
            )
        return cls()

    def get_quant_method(self, layer: nn.Module, prefix: str) -> LinearMethodBase | None:
        if not isinstance(layer, LinearBase):
            return None
        return GGUFLinearMethod(self.quant_kernel)

    def get_embedding_method(self, prefix: str) -> EmbeddingMethodBase:
        return GGUFEmbeddingMethod(self.quant_kernel)


@dataclass(frozen=True)
class Segment:
    """Consecutive output rows ``start .. stop`` of the layer of one ggml type, kept
    as bytes ``byte_start ..`` of its ``qweight`` (``kernel`` "reference") or, with
    ``byte_start`` None, handed as an ``IntWeight`` to the quant kernel ``kernel``,
    which keeps it in the layer's submodule ``segment<i>`` (``i``: the segment's index)."""

    ggml_type: str
    start: int
    stop: int
    row_bytes: int
    byte_start: int | None
    kernel: str = "reference"

    def rows(self, qweight: torch.Tensor) -> torch.Tensor:  # uint8 [stop - start, row bytes]
        assert self.byte_start is not None, "handed to a quant kernel"
        size = (self.stop - self.start) * self.row_bytes
        return qweight[self.byte_start : self.byte_start + size].view(self.stop - self.start, self.row_bytes)


class GGUFLinearMethod(LinearMethodBase):
    repack = True  # KERNEL_TYPES segments go to a quant kernel (their bytes are dropped)

    def __init__(self, kernel_name: str | None = None) -> None:
        self.kernel_name = kernel_name  # the quant_kernel setting
        self.kernels: dict[int, Any] = {}  # segment index -> its QuantLinearKernel
        self.segments: list[Segment] = []
        self._blocks: dict[int, torch.Tensor] = {}  # shard index -> uint8 [rows, row bytes], until processed

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
    ) -> None:
        self.where = layer.prefix or type(layer).__name__  # for messages
        self.shard_ids = layer.shard_ids
        self.output_partition_sizes = list(output_partition_sizes)
        self.in_features, self.input_size = input_size_per_partition, input_size
        # tensor parallelism: this rank holds its rows or its inputs of each file tensor, which the
        # layer's own loader picks from the file's blocks (_rank_blocks)
        self.split = input_size_per_partition != input_size or sum(output_partition_sizes) != output_size
        self.layer_loader = layer.weight_loader
        self._types: dict[int, str] = {}  # shard index -> its ggml type, as loaded
        # Sized once every shard's type is known (process_weights_after_loading).
        register_weight(
            layer, "qweight", torch.empty(0, dtype=torch.uint8),
            {"output_dim": None, "input_dim": None, "weight_loader": self._load_blocks},
        )
        register_weight(
            layer, "qweight_type", torch.full((len(output_partition_sizes),), -1, dtype=torch.int32),  # [shards]
            {"output_dim": None, "input_dim": None, "weight_loader": self._load_type},
        )

    def _shard_index(self, shard_id: Any) -> int:
        return fused_shard_index(self.shard_ids, shard_id, self.where, "GGUF")

    def _load_type(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        value = int(loaded_weight)
        if value not in GGML_TYPE_NAMES:
            raise ModelLoadError(
                f"is of GGUF type {_ggml_type_name(value)}, which quantization='gguf' does not run "
                f"(it runs {', '.join(FORMATS)}); drop quantization='gguf' to dequantize the whole file on load"
            )
        param.data[self._shard_index(shard_id)] = value
        self._types[self._shard_index(shard_id)] = GGML_TYPE_NAMES[value]

    def _load_blocks(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: Any = None) -> None:
        index = self._shard_index(shard_id)
        rows = self.output_partition_sizes[index]
        if self.split and loaded_weight.dtype == torch.uint8 and loaded_weight.dim() == 2:
            loaded_weight = self._rank_blocks(loaded_weight, index, shard_id)
        if loaded_weight.dtype != torch.uint8 or loaded_weight.dim() != 2 or loaded_weight.shape[0] != rows:
            raise ModelLoadError(
                f"has {loaded_weight.dtype} shape {tuple(loaded_weight.shape)}; {self.where} expects the "
                f"GGUF blocks of {rows} rows as uint8 [{rows}, row bytes]"
            )
        self._blocks[index] = loaded_weight

    def _rank_blocks(self, blocks: torch.Tensor, index: int, shard_id: Any) -> torch.Tensor:
        """This rank's rows (column-parallel: q / k / v, gate / up; k / v as the ranks share
        KV heads) or inputs (row-parallel: o, down) of a file tensor's blocks ``uint8 [rows,
        row bytes]``, which the layer's own loader picks as it would a float weight's: a row
        is one output, its blocks run along the inputs, so this rank's inputs must be whole
        blocks of the shard's type."""
        ggml_type = self._types.get(index)
        if ggml_type is None:
            raise ModelLoadError(f"{self.where}: a shard's blocks came before its qweight_type")
        block_size, type_size, _ = FORMATS[ggml_type]
        if self.in_features % block_size:
            raise ConfigError(
                f"{self.where}: tensor parallelism gives each rank {self.in_features} of its {self.input_size} "
                f"inputs, which are not whole {ggml_type} blocks of {block_size}; use a tensor_parallel_size "
                "that leaves whole blocks, or 1"
            )
        # the whole fused layer's rows of this rank, in this shard's row bytes: the loader places
        # the shard at its offset among them
        part = torch.empty(sum(self.output_partition_sizes), self.in_features // block_size * type_size,
                           dtype=torch.uint8)
        load_rank_part(self.layer_loader, part, blocks, shard_id)
        start = sum(self.output_partition_sizes[:index])
        return part[start : start + self.output_partition_sizes[index]]

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        vars(self).pop("layer_loader", None)  # the layer's bound method: loading is over
        in_features = layer.input_size_per_partition
        types = [GGML_TYPE_NAMES[int(t)] for t in layer.qweight_type]
        segments: list[Segment] = []
        segment_blocks: list[list[torch.Tensor]] = []  # each segment's shards, uint8 [rows, row bytes]
        start = 0
        for index, (ggml_type, rows) in enumerate(zip(types, self.output_partition_sizes, strict=True)):
            block_size = FORMATS[ggml_type][0]
            if in_features % block_size:
                raise ModelLoadError(
                    f"{self.where}: {in_features} inputs are not whole {ggml_type} blocks of {block_size}"
                )
            size = row_bytes(ggml_type, in_features)
            if self._blocks[index].shape[1] != size:
                raise ModelLoadError(
                    f"{self.where}: shard {index} has {self._blocks[index].shape[1]} bytes per row; "
                    f"{ggml_type} rows of {in_features} inputs take {size}"
                )
            if segments and segments[-1].ggml_type == ggml_type:
                segments[-1] = Segment(ggml_type, segments[-1].start, start + rows, size, None)
                segment_blocks[-1].append(self._blocks[index])
            else:
                segments.append(Segment(ggml_type, start, start + rows, size, None))
                segment_blocks.append([self._blocks[index]])
            start += rows
        self._blocks = {}

        # A fused layer of several integer types (a Q4_K_M file's q / k with a Q6_K v) on one
        # kernel where one takes them together: bound as one product, the decode plan takes it.
        if len(segments) > 1 and self.repack and all(seg.ggml_type in INT_TYPES for seg in segments):
            merged = self._merged_segment(layer, segments, segment_blocks, start)
            if merged is not None:
                self.segments.append(merged)
                layer.qweight.data = torch.empty(0, dtype=torch.uint8)
                return

        # Each segment goes to a quant kernel, or its bytes are kept (in qweight, in order).
        kept: list[torch.Tensor] = []
        byte_start = 0
        for i, (segment, shards) in enumerate(zip(segments, segment_blocks, strict=True)):
            rows = torch.cat(shards)  # [segment rows, row bytes]
            on_kernel = self._on_kernel(layer, i, segment, rows) if self.repack else None
            if on_kernel is not None:
                self.segments.append(on_kernel)
            else:
                kept.append(rows.reshape(-1))
                self.segments.append(dataclasses.replace(segment, byte_start=byte_start))
                byte_start += rows.numel()
        layer.qweight.data = torch.cat(kept) if kept else torch.empty(0, dtype=torch.uint8)

    def _on_kernel(self, layer: nn.Module, i: int, segment: Segment, rows: torch.Tensor) -> Segment | None:
        """Segment ``i`` (its blocks ``rows``) handed as an ``IntWeight`` (IQ4_NL / IQ4_XS: a
        ``Lut4Weight``, their codes into llama.cpp's table) to the quant kernel chosen for it,
        which keeps it in the submodule ``segment<i>``; the segment as it then is, or None where
        its type has neither form (``KERNEL_TYPES``) or the choice is the built-in ``reference``
        (which keeps a byte per weight: the file's bytes, dequantized per call, are better). The
        5- and 6-bit types are offered in 6 bits first (``_six_bit``; ``int6_pairs``), then in 8;
        a named kernel is tried on both before the kernels by priority."""
        if segment.ggml_type in LUT4_TYPES:
            q, scales, table, group = lut4_groups(rows, segment.ggml_type)
            q = q[:, 0::2] | (q[:, 1::2] << 4)  # two codes a byte, the first in the low nibble
            return self._attach(layer, i, segment, [Lut4Weight(q, scales, table, group)])
        if segment.ggml_type not in INT_TYPES:
            return None
        return self._attach(layer, i, segment, _int_forms(rows, segment.ggml_type))

    def _merged_segment(
        self, layer: nn.Module, segments: list[Segment], segment_blocks: list[list[torch.Tensor]], rows: int
    ) -> Segment | None:
        """The layer's integer segments as one (``_merged``: the widest bits, the finest groups;
        in their preferred forms, else in 4 / 8 bits) on a kernel that takes it, or None: then
        each segment on its own. A named kernel that takes neither merged form keeps them apart
        (each segment it runs stays on it)."""
        forms = [_int_forms(torch.cat(shards), seg.ggml_type) for seg, shards in zip(segments, segment_blocks,
                                                                                     strict=True)]
        candidates = [_merged([f[0] for f in forms])]
        if any(len(f) > 1 for f in forms):
            candidates.append(_merged([f[-1] for f in forms]))
        merged = Segment("+".join(seg.ggml_type for seg in segments), 0, rows, 0, None)
        return self._attach(layer, 0, merged, candidates, named_only=self.kernel_name is not None)

    def _attach(
        self, layer: nn.Module, i: int, segment: Segment, weights: list[IntWeight] | list[Lut4Weight],
        named_only: bool = False,
    ) -> Segment | None:
        """The first of ``weights`` (one segment's forms, the preferred first) that a kernel takes
        (the named one, on any form, before those by priority, which ``named_only`` leaves out;
        never the ``reference``), handed to it as segment ``i``; the segment as it then is, or None."""
        where = f"{self.where} rows {segment.start}..{segment.stop} ({segment.ggml_type})"
        specs = [QuantLinearSpec.for_weight(w, activations=WEIGHT_ONLY, dtype=layer.params_dtype, layer=where)
                 for w in weights]
        chosen = next(((w, k) for w, k in zip(weights, map(self._named_kernel, specs), strict=True) if k is not None),
                      None)
        if chosen is None and not named_only:
            chosen = next(((w, k) for w, k in zip(weights, map(choose_kernel, specs), strict=True)
                           if k.name != "reference"), None)
        if chosen is None or chosen[1].name == "reference":
            return None
        weight, kernel = chosen
        holder = nn.Module()  # the kernel's buffers, one submodule per segment
        layer.add_module(f"segment{i}", holder)
        kernel.prepare(holder, weight)
        self.kernels[i] = kernel
        return dataclasses.replace(segment, kernel=kernel.name, byte_start=None)

    def _named_kernel(self, spec: QuantLinearSpec) -> QuantLinearKernel | None:
        """The ``quant_kernel`` setting's kernel for a segment of ``spec`` (float activations),
        or where it runs only activations quantized to int8 per block of 32 (``woq_cpu_a8``:
        llama.cpp's numerics, its Q8_0 / Q8_1 dot products), for the same spec so; None when
        nothing is named or the named kernel runs neither (Q6_K's 16-wide groups on
        ``woq_cpu_a8``): that segment takes the kernel chosen by priority. A GGUF file mixes
        types, so a named kernel is a preference here, not a requirement."""
        from vframe.plugins import get_registry

        if self.kernel_name is None:
            return None
        cls = get_registry("quant_kernel").load(self.kernel_name)
        for candidate in (spec, dataclasses.replace(spec, activations=INT8_PER_BLOCK)):
            if refusal(cls, candidate) is None:
                return cls(candidate, self.kernel_name)
        return None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if len(self.segments) == 1 and 0 in self.kernels:  # the common case, in fewer Python steps
            out = self.kernels[0].apply(layer._modules["segment0"], x, None)
            return out if bias is None else out + bias
        # One segment at a time: a mixed-type layer never holds its whole float weight.
        outs = []
        for i, segment in enumerate(self.segments):
            if i in self.kernels:
                outs.append(self.kernels[i].apply(layer._modules[f"segment{i}"], x, None))
            else:
                outs.append(F.linear(x, self._dequantize(layer, i).to(x.dtype)))
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)  # [T, out]
        return out if bias is None else out + bias

    def bind(self, layer: nn.Module, bias: torch.Tensor | None) -> BoundApply | None:
        if len(self.segments) != 1 or 0 not in self.kernels:  # mixed types: apply's loop
            return None
        product = bound_apply(self.kernels[0], layer._modules["segment0"], None)
        if product is None or bias is None:
            return product

        def biased(x: torch.Tensor) -> torch.Tensor:
            return product(x) + bias

        call = native_call(product)
        if call is None or call.bias is not None:
            return biased
        return with_native(biased, dataclasses.replace(call, bias=bias))

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:  # [out, in] float32, exact
        return torch.cat([self._dequantize(layer, i) for i in range(len(self.segments))])

    def _dequantize(self, layer: nn.Module, i: int) -> torch.Tensor:  # [segment rows, in] float32
        if i in self.kernels:
            return self.kernels[i].dequantize_weight(getattr(layer, f"segment{i}"))
        segment = self.segments[i]
        return dequantize(segment.rows(layer.qweight), segment.ggml_type)


class GGUFEmbeddingMethod(GGUFLinearMethod, EmbeddingMethodBase):
    """The token embedding, and the LM head tied to it, kept quantized.

    A GGUF embedding row is one token's vector (blocks along the hidden size), so a
    lookup dequantizes only the looked-up rows. Head kernels:

    * the integer types (``INT_TYPES``: Q2_K to Q8_0) and IQ4_NL / IQ4_XS: the quant kernel
      chosen for the table's ``IntWeight`` (``Lut4Weight``), as for a linear segment, in the
      submodule ``segment0``;
      lookups through the kernel's ``dequantize_rows`` where it reads rows on its own
      (``int8_pairs``, ``int4_pairs``, ``woq_cpu``: the table is held once; SmolLM2's Q8_0 on
      ``int8_pairs`` in the file's 1.06 bytes per weight), else from the file's bytes, kept
      beside the kernel's copy (``int4_cpu`` for a bfloat16 Q4 table: 0.56 + 0.63 bytes per weight).
    * Q8_0 where that choice is the built-in ``reference``, in a bfloat16 model on the
      CPU (vocabulary a multiple of 64): each
      ``q = 16 hi + lo`` is split into two 4-bit planes, each run through torch's
      int4 kernel with the block's scale (``d (q - 8)`` form: hi plane scale
      ``16 d``, zero ``8 d``; lo plane scale ``d``, zero 0) and the two outputs
      added. The planes hold the file's int8 values, the float16 ``d`` stay for
      lookups: 1.31 bytes per weight (the file: 1.06; bfloat16: 2). The kernel's
      bfloat16 scales round ``d`` to 8 bits, as a dense bfloat16 weight rounds ``d q``.
    * otherwise (float types, or the ``reference`` kernel) the file's bytes stay in
      ``qweight`` and the head dequantizes
      ``_HEAD_ROWS`` vocabulary rows at a time, casts and multiplies: exact, but
      a dequantization of the whole table per step (docs/quantization.md has its cost).
    """

    repack = False
    q8_planes = False  # the Q8_0 int4 planes replace qweight (process_weights_after_loading)
    lookup_segment: Segment | None = None  # the file's bytes that lookups read, beside a kernel's copy
    q8_tile = 64  # rows per tile of torch's int4 CPU layout here (64 with AVX-512, 32 with AVX2)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        super().process_weights_after_loading(layer)
        [segment] = self.segments
        vocab = layer.num_embeddings
        # A table of an integer type on the quant kernel chosen for it, as a linear segment would
        # be (woq_cpu on the CPU: Q8_0's int8 values and a float32 scale per 32, 1.125 bytes per
        # weight). Lookups go through the kernel's dequantize_rows where it reads rows on its own;
        # else (int4_cpu) the file's bytes stay for them. Without a kernel: the Q8_0 int4 planes
        # or the file's bytes.
        on_kernel = None
        if segment.ggml_type in KERNEL_TYPES:
            on_kernel = self._on_kernel(layer, 0, segment, segment.rows(layer.qweight))
        if on_kernel is not None:
            self.segments[0] = on_kernel
            if reads_rows(self.kernels[0]):
                layer.qweight.data = torch.empty(0, dtype=torch.uint8)
            else:
                self.lookup_segment = segment
            return
        if not (
            segment.ggml_type == "Q8_0" and layer.qweight.device.type == "cpu" and vocab % 64 == 0
            and int4_cpu.kernel_group_size(layer, _INT4_GROUP) == _INT4_GROUP
        ):
            return
        blocks = segment.rows(layer.qweight).view(vocab, -1, 34)  # [vocab, hidden / 32, 34]: d | 32 int8
        d = blocks[..., :2].contiguous().view(torch.float16).reshape(vocab, -1)  # [vocab, hidden / 32]
        scale = d.float().T  # [hidden / 32, vocab]
        scales_and_zeros = {
            "hi": torch.stack([16 * scale, 8 * scale], dim=-1), "lo": torch.stack([scale, 0 * scale], dim=-1)
        }
        # The kernel's layout packs each 64 rows on their own: pack a chunk of rows at a time
        # so that the int32 values it takes never exist for the whole table.
        planes: dict[str, list[torch.Tensor]] = {"hi": [], "lo": []}
        for start in range(0, vocab, _HEAD_ROWS):
            q = blocks[start : start + _HEAD_ROWS, :, 2:].contiguous().view(torch.int8)  # [rows, hidden / 32, 32]
            q = q.int().flatten(1)  # [rows, hidden]
            planes["hi"].append(torch._convert_weight_to_int4pack_for_cpu((q >> 4) + 8, 1))
            planes["lo"].append(torch._convert_weight_to_int4pack_for_cpu(q & 0x0F, 1))
        for plane, chunks in planes.items():
            layer.register_buffer(f"q8_{plane}", torch.cat(chunks), persistent=False)
            layer.register_buffer(
                f"q8_{plane}_scales_and_zeros", scales_and_zeros[plane].to(torch.bfloat16), persistent=False
            )
        layer.register_buffer("q8_d", d, persistent=False)
        self.q8_planes = True
        # The planes' layout is torch's, not a documented format, and depends on the CPU (tiles of
        # 64 rows with AVX-512, 32 with AVX2): take the tile whose rows of both nibble halves match.
        ids = torch.tensor([0, 15, 16, 31, 32, 63, vocab // 2 + 33, vocab - 1], device=d.device)
        want = dequantize(segment.rows(layer.qweight)[ids], "Q8_0")
        for self.q8_tile in (64, 32):
            if torch.equal(self._rows(layer, ids), want):
                break
        else:
            raise ModelLoadError(
                f"{self.where}: torch's int4 CPU weight layout is not the one vframe reads rows from; "
                "run the Q8_0 embedding in float32 (dtype='float32') or report this torch version"
            )
        layer.qweight.data = torch.empty(0, dtype=torch.uint8)

    def embedding(self, layer: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self._rows(layer, input_ids).to(layer.params_dtype)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.kernels:
            return GGUFLinearMethod.apply(self, layer, x, bias)
        if self.q8_planes and int4_cpu.applies(x):
            out = int4_cpu.matmul(x, layer.q8_hi, layer.q8_hi_scales_and_zeros, _INT4_GROUP, bias)
            return out + int4_cpu.matmul(x, layer.q8_lo, layer.q8_lo_scales_and_zeros, _INT4_GROUP, None)
        vocab = layer.num_embeddings
        out = x.new_empty(x.shape[0], vocab)  # [T, vocab]
        for start in range(0, vocab, _HEAD_ROWS):
            ids = torch.arange(start, min(start + _HEAD_ROWS, vocab), device=x.device)
            out[:, start : start + len(ids)] = F.linear(x, self._rows(layer, ids).to(x.dtype))
        return out if bias is None else out + bias

    def dequantize_weight(self, layer: nn.Module) -> torch.Tensor:  # [vocab, hidden] float32, exact
        return self._rows(layer, torch.arange(layer.num_embeddings, device=layer.qweight.device))

    def _rows(self, layer: nn.Module, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden] float32, exact
        [segment] = self.segments
        if self.lookup_segment is not None:  # the file's bytes, kept beside a kernel that cannot read rows
            return dequantize(self.lookup_segment.rows(layer.qweight)[ids], segment.ggml_type)
        if self.kernels:
            return self.kernels[0].dequantize_rows(layer.segment0, ids)
        if not self.q8_planes:
            return dequantize(segment.rows(layer.qweight)[ids], segment.ggml_type)
        # The int4 CPU layout: per tile of 64 rows (AVX-512; 32 with AVX2), byte [k, n % 32 (16)]
        # holds input k of row n, the high nibble for the tile's second half.
        tile, half = self.q8_tile, self.q8_tile // 2
        shift = (ids % tile >= half).to(torch.uint8)[:, None] * 4  # [T, 1]

        def nibbles(weight: torch.Tensor) -> torch.Tensor:  # [T, hidden] uint8
            packed = weight.view(-1, layer.embedding_dim, half)[ids // tile, :, ids % half]
            return (packed >> shift) & 0x0F

        q = (nibbles(layer.q8_hi).int() - 8) * 16 + nibbles(layer.q8_lo).int()  # [T, hidden] in [-128, 128)
        d = layer.q8_d[ids].float()  # [T, hidden / 32]
        return (q.view(len(ids), -1, 32).float() * d[..., None]).view(len(ids), -1)


_HEAD_ROWS = 4096  # vocabulary rows dequantized at once by the reference head: 9 MiB of float32 at hidden 576


def _int_forms(rows: torch.Tensor, ggml_type: str) -> list[IntWeight]:
    """A segment's ``IntWeight`` forms, the preferred first: the 5- and 6-bit types in 6 bits,
    then in 8 (``_six_bit``); the others in their 4 or 8 bits."""
    weight = _int_weight(rows, ggml_type)
    return [_six_bit(weight), weight] if ggml_type in SIX_BIT_TYPES else [weight]


def _merged(weights: list[IntWeight]) -> IntWeight:
    """Segments' weights (their rows in order) as one ``IntWeight``, the same weights: the widest
    bits (each code moved by the midpoints' difference), groups of the greatest common divisor
    (each scale and offset repeated), offsets where any has them (zero for the others)."""
    bits, group = max(w.bits for w in weights), math.gcd(*(w.group_size for w in weights))
    q = torch.cat([(w.q.to(torch.int16) + (1 << (bits - 1)) - (1 << (w.bits - 1))).to(torch.uint8) for w in weights])

    def spread(t: torch.Tensor, w: IntWeight) -> torch.Tensor:
        return t.repeat_interleave(w.group_size // group, dim=1)

    scales = torch.cat([spread(w.scales, w) for w in weights])
    offsets = None
    if any(w.offsets is not None for w in weights):
        offsets = torch.cat([spread(w.offsets if w.offsets is not None else torch.zeros_like(w.scales), w)
                             for w in weights])
    return IntWeight(bits, q, scales, offsets, group)


def _six_bit(weight: IntWeight) -> IntWeight:
    """A 5- or 6-bit type's 8-bit ``IntWeight`` (``int8_groups``) in 6 bits, the same weights:
    Q6_K's ``q - 32`` and Q5_0's ``q - 16`` (symmetric) as ``q + 32``; Q5_1's and Q5_K's
    unsigned ``q`` as it is, the offset raised by 32 scales (the kernel's zero, ``offset - 32
    scale``, is then the file's ``m`` / ``-dmin m``)."""
    if weight.offsets is None:
        return IntWeight(6, weight.q - 96, weight.scales, None, weight.group_size)
    return IntWeight(6, weight.q - 128, weight.scales, weight.offsets + 32 * weight.scales, weight.group_size)


def _int_weight(rows: torch.Tensor, ggml_type: str) -> IntWeight:
    """A segment's blocks (uint8 [out, row bytes]) as an ``IntWeight``: Q4_0 / Q4_1 /
    Q4_K (groups of 32) and Q2_K / Q3_K (16) as ``gguf_dequant.int4_groups`` spells them
    (4 bit, ``scale * (q - 8) + zero``), Q5_0 / Q5_1 / Q5_K / Q6_K / Q8_0 as
    ``int8_groups`` does (8 bit, groups of 32; Q6_K 16)."""
    if ggml_type in INT8_TYPES:
        q8, scale, offset, group = int8_groups(rows, ggml_type)
        return IntWeight(8, q8, scale, offset, group)
    q, scale, zero, group = int4_groups(rows, ggml_type)
    return IntWeight(4, q, scale, zero, group)


def _ggml_type_name(value: int) -> str:
    try:
        from gguf import GGMLQuantizationType

        return f"{GGMLQuantizationType(value).name} ({value})"
    except (ImportError, ValueError):
        return f"number {value}"
