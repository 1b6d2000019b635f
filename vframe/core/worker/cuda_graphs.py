"""CUDA graphs of decode steps.

A decode step of a small model on a GPU is bound by kernel launches, not by the GPU:
SmolLM2-135M's 30 layers are some 400 kernels of a few microseconds each, and Python
launching them one by one takes longer than the GPU takes to run them. A CUDA graph
records the launches of one forward pass once; replaying it is one call.

What is captured: the model's forward (embedding to final norm) for a step in which
every request decodes one token, once per batch size of ``capture_sizes``, all graphs
sharing one memory pool (captured largest first). The graphs read their inputs from
static buffers::

    a step of B = 5 decodes replays the graph of size 8:
    rows 0..4   the step's tokens: ids, positions, slots, seq_lens, block table rows
    rows 5..7   padding: a one-token decode at position 0 whose key and value go
                to the scratch block (a KV block the scheduler never hands out)

A step copies its rows into the buffers, points the padding rows at the scratch block,
replays, and reads the first B rows of the graph's output; the output head and the
sampler run eagerly on them. Rows never mix (every layer works row by row, attention
within a request), so padding changes no real row.

The attention backend's metadata is built once per graph from views of the buffers
(``AttentionBackend.supports_cuda_graphs``, plugin API 1.15, says what a backend
promises), with ``max_seq_len = max_model_len`` so that any launch decided from it (the
Triton backend's split-KV count) serves every later step.

Which steps replay: decode-only steps of at most the largest captured size. Graphs are
captured only on CUDA, with ``enforce_eager`` off, a model class and an attention backend
that declare ``supports_cuda_graphs``, no LoRA and one tensor-parallel rank; everything
else runs eagerly, as every prefill does.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vframe.core.interfaces import AttentionMetadataBuilder, CommonAttentionMetadata

logger = logging.getLogger(__name__)

# vLLM's default sizes are every multiple of 8 up to 512; fewer here (capture takes
# time at start-up) at the price of padding a step by at most a quarter.
DEFAULT_CAPTURE_SIZES = (
    1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256,
    320, 384, 448, 512, 640, 768, 896, 1024,
)  # fmt: skip


def capture_sizes(max_num_seqs: int, sizes: list[int] | None = None, max_size: int | None = None) -> list[int]:
    """The batch sizes to capture: ``sizes`` (vLLM's ``cudagraph_capture_sizes``) or the
    defaults, none above ``max_size`` (``max_cudagraph_capture_size``) or
    ``max_num_seqs``, sorted, without repeats."""
    limit = min(max_num_seqs, max_size) if max_size is not None else max_num_seqs
    chosen = sorted({s for s in (sizes if sizes is not None else DEFAULT_CAPTURE_SIZES) if 1 <= s <= limit})
    # A step of max_num_seqs decodes must fit a graph when the defaults stop short of it.
    if sizes is None and max_size is None and limit <= DEFAULT_CAPTURE_SIZES[-1] and limit not in chosen:
        chosen.append(limit)
    return chosen


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [size, E], the graph's output, rewritten by every replay


class DecodeGraphs:
    """The graphs of one model, the static buffers they read, and per size the
    attention metadata built over those buffers.

    ``build_metadata()`` then ``capture()`` (CUDA). Without ``capture()``, ``run``
    runs the forward eagerly over the padded buffers and the same metadata, which
    checks everything but the capture itself on any device (tests)."""

    def __init__(
        self,
        model: nn.Module,
        builder: AttentionMetadataBuilder,
        kv_caches: list[torch.Tensor],
        *,
        sizes: list[int],
        max_model_len: int,
        block_size: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        if not sizes:
            raise ValueError("no batch size to capture")
        self.model, self.builder, self.kv_caches = model, builder, kv_caches
        self.sizes = sizes
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.scratch_block = scratch_block
        self.scratch_slot = scratch_block * block_size
        rows, max_blocks = sizes[-1], -(-max_model_len // block_size)
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((rows,), self.scratch_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(rows, dtype=torch.int32, device=device)
        self.context_lens = torch.zeros(rows, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(rows + 1, dtype=torch.int32, device=device)  # one token a request
        self.block_table = torch.full((rows, max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.metadata: dict[int, Any] = {}  # size -> what the backend built over the buffers
        self.graphs: dict[int, _Graph] = {}
        self.capture_seconds: dict[int, float] = {}  # size -> its warm-up and capture
        self.pool: Any = None

    def _common(self, size: int) -> CommonAttentionMetadata:
        """The metadata of a decode step of ``size`` rows over the static buffers (views)."""
        return CommonAttentionMetadata(
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            context_lens=self.context_lens[:size],
            block_table=self.block_table[:size],
            slot_mapping=self.slot_mapping[:size],
            num_reqs=size,
            num_actual_tokens=size,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
            query_start_loc_cpu=list(range(size + 1)),
            seq_lens_cpu=[1] * size,
        )

    def build_metadata(self) -> None:
        """The backend's metadata of each size, built once over views of the buffers."""
        self.metadata = {size: self.builder.build(self._common(size)) for size in self.sizes}

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self.metadata[size])

    @torch.inference_mode()
    def capture(self) -> float:
        """Capture one graph per size, largest first; returns the seconds it took."""
        t0 = time.perf_counter()
        if not self.metadata:
            self.build_metadata()
        self.pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            start = time.perf_counter()
            # Eagerly first: kernels compile (Triton), libraries set up their handles.
            for _ in range(2):
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                hidden = self._forward(size)
            self.graphs[size] = _Graph(graph, hidden)
            self.capture_seconds[size] = time.perf_counter() - start
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def size_for(self, num_reqs: int) -> int | None:
        """The smallest captured size that holds ``num_reqs`` rows, or None."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self,
        input_ids: torch.Tensor,  # [B] int64
        positions: torch.Tensor,  # [B] int64
        common: CommonAttentionMetadata,  # of a step where every request decodes one token
    ) -> torch.Tensor | None:  # [size, E]: rows 0..B-1 are the step's
        """Replay the graph that holds the step, or None when none does (run it eagerly)."""
        num_reqs = common.num_reqs
        size = self.size_for(num_reqs)
        if (
            size is None or common.max_query_len != 1 or common.num_actual_tokens != num_reqs
            or common.block_table.shape[1] > self.block_table.shape[1]
        ):  # fmt: skip
            return None
        self.input_ids[:num_reqs].copy_(input_ids)
        self.positions[:num_reqs].copy_(positions)
        self.slot_mapping[:num_reqs].copy_(common.slot_mapping[:num_reqs])
        self.seq_lens[:num_reqs].copy_(common.seq_lens)
        self.context_lens[:num_reqs].copy_(common.context_lens)
        self.block_table[:num_reqs, : common.block_table.shape[1]].copy_(common.block_table)
        if size > num_reqs:  # padding rows: a one-token decode in the scratch block
            self.slot_mapping[num_reqs:size].fill_(self.scratch_slot)
            self.seq_lens[num_reqs:size].fill_(1)
            self.context_lens[num_reqs:size].fill_(0)
            self.block_table[num_reqs:size, 0].fill_(self.scratch_block)
        entry = self.graphs.get(size)
        if entry is None:  # nothing captured (off CUDA): the same computation, eagerly
            return self._forward(size)
        entry.graph.replay()
        return entry.hidden
