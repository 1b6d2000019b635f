"""Paged attention with PyTorch's FlexAttention (``torch.nn.attention.flex_attention``).

The KV cache of one layer is ``[2, num_blocks, block_size, KVH, D]``, the torch
backend's layout. A step's keys and values are written with ``index_copy_`` at
``slot_mapping``; then one ``flex_attention`` call attends all the step's query
tokens (packed, ``[1, H, T, D]``) over the KV blocks the step's requests hold.

The plan (built once per step, shared by every layer):

* ``used``: the physical blocks any request of the step holds (up to
  ``ceil(seq_len / block_size)`` each), gathered into a compact key/value tensor
  ``[1, KVH, U * block_size, D]``; compact block ``u`` is physical ``used[u]``.
* a ``BlockMask`` built directly with ``BlockMask.from_kv_blocks`` (the mask is
  never evaluated over the cache to find blocks): query tiles of
  ``Q_BLOCK_SIZE`` tokens, KV tiles of one cache block; tile ``i`` lists the
  compact blocks of every request with a token in it;
* a ``mask_mod``: query ``q`` is request ``q_req[q]`` at position ``q_pos[q]``;
  key ``k`` is compact block ``k // block_size``, at logical position
  ``logical[blk] * block_size + k % block_size`` (a block sits at the same
  logical index in every request that holds it); allowed iff ``owner[r, blk]``,
  that position ``<= q_pos`` (hence ``< seq_len``), and inside the sliding
  window when the layer has one.

Slots never written (the tail of a request's last block) may hold anything,
NaN included; masked scores become ``-inf``, but a probability of 0 times a NaN
value is still NaN, so the gathered values of those slots are zeroed (on the
compact copy; the cache itself is left as it is).

That plan is the **eager** path (``enforce_eager=True``, or after a compile
failure): PyTorch's unfused ``flex_attention``, which materialises the
``[H, T, U * block_size]`` scores, correct on CPU and GPU but not fast.

The **compiled** path (the default) runs ``torch.compile(flex_attention)``:
inductor's C++ template on the CPU, its Triton template on a GPU. It reads the
cache **in place**: key and value are the whole layer cache viewed as
``[B, KVH, num_blocks * block_size, D]`` (a stride-0 batch over one
``[1, KVH, S, D]`` view, no copy), and the ``BlockMask`` lists, per request and
query tile, the physical blocks of the request's block table:

* requests are batched by kind, one call each: the decodes
  (``[B_d, H, 1, D]``) and the rest (``[B_p, H, Q_max, D]``, padded), so a
  decode never scores another request's blocks;
* per request ``b`` and query tile: the blocks every query of the tile sees
  whole (``full_kv_indices``, no mask applied) and the blocks it sees in part
  (``kv_indices``: the last ones, and all of them under a sliding window);
* ``mask_mod``: query ``q`` of request ``b`` is at position
  ``q_start[b] + q``; key slot ``k`` at ``logical[k // block_size] *
  block_size + k % block_size`` (``logical`` maps a physical block to its
  index in the block tables that hold it); allowed iff ``q < q_len[b]``, the
  key position ``<=`` the query's, and inside the window.

What inductor's templates need, learnt the hard way with torch 2.13 on the CPU:
the key length (``num_blocks * block_size``) and every tensor ``mask_mod``
captures must keep static sizes (``logical`` is ``[num_blocks]``, ``q_start``
and ``q_len`` are ``[max_num_seqs]``; a dynamic captured size fails to compile,
``cur_kvSplitSize`` / ``cur_qSplitSize`` undeclared); only the batch and the
query length are dynamic. The CPU template also takes the mask's key extent
from ``kv_indices``' width, so its block lists are ``num_blocks`` wide there
(the block-table width on a GPU). Unwritten slots at the tail of a request's
last block are read by the fused kernel (a masked score is ``-inf``, but
``0 * NaN`` is NaN), so the compiled path zeroes them in the cache before
attending; they belong to that request alone and are written only later.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from vframe.core.interfaces import (
    AttentionBackend,
    AttentionImpl,
    AttentionMetadataBuilder,
    CommonAttentionMetadata,
)
from vframe.core.kv_cache_spec import refuse_fp8_kv_cache

Q_BLOCK_SIZE = 128  # query tokens per BlockMask row tile (eager plan, and the compiled prefill call)
DECODE_Q_BLOCK_SIZE = 16  # the compiled decode call's row tile: one query per request
BLOCK_SIZES = (16, 32, 64, 128)  # FlexAttention's KV tiles are one cache block: at least 16
RECOMPILE_LIMIT = 64  # compiled variants of flex_attention per process (dynamo's default is 8)

logger = logging.getLogger(__name__)
_compiled: dict[str, Any] = {}  # "fn": torch.compile(flex_attention); "failed": why the eager path took over


def compile_failure() -> str | None:
    """Why the compiled path gave way to the eager one in this process, or ``None``."""
    return _compiled.get("failed")


@dataclass
class FlexAttentionMetadata:
    """The plan of one step, built once and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_actual_tokens] int64
    num_actual_tokens: int
    block_size: int
    used: torch.Tensor  # [U] int64, physical blocks in compact order
    slot_valid: torch.Tensor  # [U * block_size] bool, written slots of the compact blocks
    q_req: torch.Tensor  # [T] int64, request of each query token
    q_pos: torch.Tensor  # [T] int64, absolute position of each query token
    owner: torch.Tensor  # [B, U] bool, request r holds compact block u
    logical: torch.Tensor  # [U] int64, logical index of each compact block
    kv_num_blocks: torch.Tensor  # [1, 1, num_q_tiles] int32
    kv_indices: torch.Tensor  # [1, 1, num_q_tiles, U] int32
    block_masks: dict[int | None, Any] = field(default_factory=dict)  # per sliding window

    def block_mask(self, sliding_window: int | None) -> Any:
        """The ``BlockMask`` for layers with this sliding window (built once per step)."""
        if sliding_window not in self.block_masks:
            from torch.nn.attention.flex_attention import BlockMask

            self.block_masks[sliding_window] = BlockMask.from_kv_blocks(
                self.kv_num_blocks,
                self.kv_indices,
                BLOCK_SIZE=(Q_BLOCK_SIZE, self.block_size),
                mask_mod=self._mask_mod(sliding_window),
                seq_lengths=(self.num_actual_tokens, self.used.shape[0] * self.block_size),
            )
        return self.block_masks[sliding_window]

    def _mask_mod(self, sliding_window: int | None) -> Callable:
        q_req, q_pos, owner, logical, bs = self.q_req, self.q_pos, self.owner, self.logical, self.block_size

        def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            blk = kv_idx // bs
            pos = logical[blk] * bs + kv_idx % bs
            qp = q_pos[q_idx]
            ok = owner[q_req[q_idx], blk] & (pos <= qp)
            if sliding_window is not None:
                ok = ok & (pos > qp - sliding_window)
            return ok

        return mask_mod

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata) -> FlexAttentionMetadata:
        device = common.slot_mapping.device
        bs = common.block_size
        qsl, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
        table = common.block_table.cpu().tolist()  # one host copy per step
        num_reqs, n = common.num_reqs, common.num_actual_tokens

        req_blocks = [table[r][: -(-seq_lens[r] // bs)] for r in range(num_reqs)]
        used = sorted({p for blocks in req_blocks for p in blocks})
        compact = {p: u for u, p in enumerate(used)}
        num_used = len(used)
        owner = torch.zeros(num_reqs, num_used, dtype=torch.bool)
        logical = torch.zeros(num_used, dtype=torch.long)
        filled = torch.zeros(num_used, dtype=torch.long)  # written slots per compact block
        for r, blocks in enumerate(req_blocks):
            for i, p in enumerate(blocks):
                u = compact[p]
                owner[r, u] = True
                logical[u] = i
                filled[u] = max(int(filled[u]), min(bs, seq_lens[r] - i * bs))
        slot_valid = (torch.arange(bs)[None, :] < filled[:, None]).flatten()

        q_req = torch.zeros(n, dtype=torch.long)
        q_pos = torch.zeros(n, dtype=torch.long)
        for r in range(num_reqs):
            a, b = qsl[r], qsl[r + 1]
            q_req[a:b] = r
            q_pos[a:b] = torch.arange(seq_lens[r] - (b - a), seq_lens[r])

        num_tiles = max(1, -(-n // Q_BLOCK_SIZE))
        kv_num_blocks = torch.zeros(1, 1, num_tiles, dtype=torch.int32)
        kv_indices = torch.zeros(1, 1, num_tiles, max(1, num_used), dtype=torch.int32)
        for t in range(num_tiles):
            lo, hi = t * Q_BLOCK_SIZE, min(n, (t + 1) * Q_BLOCK_SIZE)
            reqs = [r for r in range(num_reqs) if qsl[r] < hi and qsl[r + 1] > lo]
            tile = sorted({compact[p] for r in reqs for p in req_blocks[r]})
            kv_num_blocks[0, 0, t] = len(tile)
            kv_indices[0, 0, t, : len(tile)] = torch.tensor(tile, dtype=torch.int32)

        def dev(x: torch.Tensor) -> torch.Tensor:
            return x.to(device)

        return cls(
            slot_mapping=common.slot_mapping[:n].long(),
            num_actual_tokens=n,
            block_size=bs,
            used=dev(torch.tensor(used, dtype=torch.long)),
            slot_valid=dev(slot_valid),
            q_req=dev(q_req),
            q_pos=dev(q_pos),
            owner=dev(owner),
            logical=dev(logical),
            kv_num_blocks=dev(kv_num_blocks),
            kv_indices=dev(kv_indices),
        )


@dataclass
class _FlexCall:
    """One compiled ``flex_attention`` call: requests of one kind, batched."""

    rows: torch.Tensor  # [B, Q] int64: the step row of request b's query q (padding repeats a real row)
    out_rows: torch.Tensor  # [N] int64: the step rows this call answers
    out_index: torch.Tensor  # [N] int64: where each sits in the call's flattened [B * Q] output
    q_start: torch.Tensor  # [capacity] int64: position of request b's first query (static size)
    q_len: torch.Tensor  # [capacity] int64: request b's queries (static size)
    table: torch.Tensor  # [B, W] int64: the requests' block table rows
    q_block: int  # query tile of the BlockMask
    block_masks: dict[tuple[int | None, int], Any] = field(default_factory=dict)  # per (window, num_blocks)

    def block_mask(self, sliding_window: int | None, num_blocks: int, block_size: int, logical: torch.Tensor) -> Any:
        key = (sliding_window, num_blocks)
        if key not in self.block_masks:
            self.block_masks[key] = self._build(sliding_window, num_blocks, block_size, logical)
        return self.block_masks[key]

    def _build(self, window: int | None, num_blocks: int, bs: int, logical: torch.Tensor) -> Any:
        from torch.nn.attention.flex_attention import BlockMask

        b, q = self.rows.shape
        dev = self.table.device
        q_start, q_len = self.q_start[:b], self.q_len[:b]
        tiles = -(-q // self.q_block)
        lo_q = torch.arange(tiles, device=dev) * self.q_block  # [tiles]
        active = lo_q[None, :] < q_len[:, None]  # [b, tiles]: the tile holds a real query
        lo_pos = q_start[:, None] + lo_q[None, :]
        hi_pos = q_start[:, None] + torch.minimum(lo_q[None, :] + self.q_block, q_len[:, None]) - 1
        last = hi_pos // bs  # the last block a query of the tile sees
        if window is None:
            n_full = (lo_pos + 1) // bs  # blocks before it, seen whole by every query of the tile
            first = n_full
        else:  # every visible block is masked (positions leave the window within a block)
            n_full = torch.zeros_like(last)
            first = ((lo_pos - window + 1) // bs).clamp(min=0)
        n_part = torch.where(active, last - first + 1, 0)
        n_full = torch.where(active, n_full, 0)
        # the CPU template takes the mask's key extent from the lists' width: num_blocks there
        width = num_blocks if dev.type == "cpu" else max(1, self.table.shape[1])

        def lists(start: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            k = torch.arange(max(1, self.table.shape[1]), device=dev)  # a request holds at most W blocks
            col = (start[..., None] + k).clamp(max=self.table.shape[1] - 1)  # [b, tiles, k]
            picked = self.table.gather(1, col.view(b, -1)).view(col.shape)
            picked = torch.where(k < count[..., None], picked, 0).to(torch.int32)
            out = torch.zeros(b, 1, tiles, width, dtype=torch.int32, device=dev)
            out[:, 0, :, : k.shape[0]] = picked
            return count.to(torch.int32)[:, None, :], out

        kv_num, kv_idx = lists(first, n_part)
        full_num, full_idx = lists(torch.zeros_like(first), n_full)
        return BlockMask.from_kv_blocks(
            kv_num,
            kv_idx,
            full_num,
            full_idx,
            BLOCK_SIZE=(self.q_block, bs),
            mask_mod=_paged_mask_mod(self.q_start, self.q_len, logical, bs, window),
            seq_lengths=(q, num_blocks * bs),
            compute_q_blocks=False,
        )


def _paged_mask_mod(
    q_start: torch.Tensor, q_len: torch.Tensor, logical: torch.Tensor, bs: int, window: int | None
) -> Callable:
    def mask_mod(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        pos = logical[kv_idx // bs] * bs + kv_idx % bs
        q_pos = q_start[b] + q_idx
        ok = (q_idx < q_len[b]) & (pos <= q_pos)
        if window is not None:
            ok = ok & (pos > q_pos - window)
        return ok

    return mask_mod


@dataclass
class FlexPagedPlan:
    """The compiled path's plan of one step (see the module docstring), shared by every layer."""

    common: CommonAttentionMetadata
    slot_mapping: torch.Tensor  # [n] int64
    num_actual_tokens: int
    block_size: int
    tail_slots: torch.Tensor  # [S] int64: unwritten slots of the requests' last blocks, zeroed before attending
    held: torch.Tensor  # [B, W] bool: block table entries the requests hold
    table: torch.Tensor  # [B, W] int64
    calls: list[_FlexCall]
    logicals: dict[int, torch.Tensor] = field(default_factory=dict)  # per num_blocks: [num_blocks] int64
    eager: FlexAttentionMetadata | None = None  # built when the compiled path gave way

    def logical(self, num_blocks: int) -> torch.Tensor:
        """``[num_blocks]``: each held block's index in the block tables that hold it."""
        if num_blocks not in self.logicals:
            index = torch.arange(self.table.shape[1], device=self.table.device).expand_as(self.table)
            logical = torch.zeros(num_blocks, dtype=torch.long, device=self.table.device)
            logical[self.table[self.held]] = index[self.held]
            torch._dynamo.mark_static(logical)  # a mask_mod capture: static size
            self.logicals[num_blocks] = logical
        return self.logicals[num_blocks]

    def eager_plan(self) -> FlexAttentionMetadata:
        if self.eager is None:
            self.eager = FlexAttentionMetadata.from_common(self.common)
        return self.eager

    @classmethod
    def from_common(cls, common: CommonAttentionMetadata, capacity: int | None = None) -> FlexPagedPlan:
        device = common.slot_mapping.device
        bs, n, num_reqs = common.block_size, common.num_actual_tokens, common.num_reqs
        qsl, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
        capacity = max(capacity or num_reqs, num_reqs, 1)
        q_lens = [qsl[r + 1] - qsl[r] for r in range(num_reqs)]
        table = common.block_table[:num_reqs].long()
        held_blocks = torch.tensor([-(-s // bs) for s in seq_lens], dtype=torch.long)
        width = table.shape[1]
        held = (torch.arange(width)[None, :] < held_blocks[:, None]).to(device)

        # slots from seq_len to the end of each request's last block: (request, block index, offset)
        tail_req = [r for r, s in enumerate(seq_lens) if s % bs for _ in range(bs - s % bs)]
        tail_blk = [seq_lens[r] // bs for r in tail_req]
        tail_off = [o for s in seq_lens if s % bs for o in range(s % bs, bs)]
        pos = torch.tensor([tail_req, tail_blk], dtype=torch.long).to(device)
        tail_slots = table[pos[0], pos[1]] * bs + torch.tensor(tail_off, dtype=torch.long).to(device)

        calls = []
        decodes = [r for r in range(num_reqs) if q_lens[r] == 1]
        others = [r for r in range(num_reqs) if q_lens[r] > 1]
        for reqs, q_block in ((decodes, DECODE_Q_BLOCK_SIZE), (others, Q_BLOCK_SIZE)):
            if not reqs:
                continue
            q_max = max(q_lens[r] for r in reqs)
            rows = torch.tensor(
                [[qsl[r] + min(j, q_lens[r] - 1) for j in range(q_max)] for r in reqs], dtype=torch.long
            )
            out_rows = torch.tensor([qsl[r] + j for r in reqs for j in range(q_lens[r])], dtype=torch.long)
            out_index = torch.tensor(
                [i * q_max + j for i, r in enumerate(reqs) for j in range(q_lens[r])], dtype=torch.long
            )
            q_start = torch.zeros(capacity, dtype=torch.long)
            q_len = torch.zeros(capacity, dtype=torch.long)
            q_start[: len(reqs)] = torch.tensor([seq_lens[r] - q_lens[r] for r in reqs])
            q_len[: len(reqs)] = torch.tensor([q_lens[r] for r in reqs])
            q_start, q_len = q_start.to(device), q_len.to(device)
            for t in (q_start, q_len):  # mask_mod captures: static sizes
                torch._dynamo.mark_static(t)
            pick = torch.tensor(reqs, dtype=torch.long, device=device)
            calls.append(
                _FlexCall(
                    rows=rows.to(device),
                    out_rows=out_rows.to(device),
                    out_index=out_index.to(device),
                    q_start=q_start,
                    q_len=q_len,
                    table=table.index_select(0, pick),
                    q_block=q_block,
                )
            )
        return cls(
            common=common,
            slot_mapping=common.slot_mapping[:n].long(),
            num_actual_tokens=n,
            block_size=bs,
            tail_slots=tail_slots,
            held=held,
            table=table,
            calls=calls,
        )


class FlexAttentionMetadataBuilder(AttentionMetadataBuilder):
    """The compiled plan, or with ``enforce_eager=True`` the eager one."""

    def build(self, common: CommonAttentionMetadata) -> FlexAttentionMetadata | FlexPagedPlan:
        if self.config.device.enforce_eager:
            return FlexAttentionMetadata.from_common(common)
        return FlexPagedPlan.from_common(common, capacity=self.config.scheduler.max_num_seqs)


class FlexAttentionImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, KVH, D]
        value: torch.Tensor,  # [T, KVH, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, KVH, D]
        attn_metadata: Any,  # FlexPagedPlan (compiled), FlexAttentionMetadata (eager) or CommonAttentionMetadata
    ) -> torch.Tensor:  # [T, H, D]
        meta = attn_metadata
        if isinstance(meta, CommonAttentionMetadata):
            meta = FlexAttentionMetadata.from_common(meta)
        n = meta.num_actual_tokens
        kvh, d = self.num_kv_heads, self.head_size
        kv_cache[0].view(-1, kvh, d).index_copy_(0, meta.slot_mapping, key[:n])
        kv_cache[1].view(-1, kvh, d).index_copy_(0, meta.slot_mapping, value[:n])
        if isinstance(meta, FlexPagedPlan):
            if "failed" not in _compiled:
                try:
                    return self._forward_compiled(query, kv_cache, meta)
                except Exception as exc:  # a compiler that cannot build this step: warn once, go eager
                    if not _is_compile_error(exc):
                        raise
                    _compiled["failed"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"
                    logger.warning(
                        "flex: torch.compile(flex_attention) failed (%s); running flex_attention eagerly from now on",
                        _compiled["failed"],
                    )
            meta = meta.eager_plan()
        return self._forward_eager(query, kv_cache, meta)

    def _forward_compiled(self, query: torch.Tensor, kv_cache: torch.Tensor, plan: FlexPagedPlan) -> torch.Tensor:
        bs = plan.block_size
        kvh, d, h = self.num_kv_heads, self.head_size, self.num_heads
        num_blocks = kv_cache.shape[1]
        if plan.tail_slots.numel():
            kv_cache.view(2, -1, kvh, d).index_fill_(1, plan.tail_slots, 0)
        output = torch.zeros_like(query)  # padding rows past n stay zero
        logical = plan.logical(num_blocks)
        fn = _compiled_flex()
        for call in plan.calls:
            b, q = call.rows.shape
            # the whole layer cache, in place: [b, KVH, num_blocks * block_size, D] (stride 0 over b)
            k = kv_cache[0].view(1, num_blocks * bs, kvh, d).transpose(1, 2).expand(b, -1, -1, -1)
            v = kv_cache[1].view(1, num_blocks * bs, kvh, d).transpose(1, 2).expand(b, -1, -1, -1)
            qq = query.index_select(0, call.rows.flatten()).view(b, q, h, d).transpose(1, 2)
            block_mask = call.block_mask(self.sliding_window, num_blocks, bs, logical)
            for t in (k, v):  # new views each call; the captured tensors are marked where they are made
                for dim in (1, 2, 3):
                    torch._dynamo.mark_static(t, dim)
            options = None
            if query.device.type == "cuda":
                options = {"BLOCK_M": min(call.q_block, 64), "BLOCK_N": min(bs, 64), "FORCE_USE_FLEX_ATTENTION": True}
            with torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT):
                out = fn(qq, k, v, block_mask=block_mask, scale=self.scale, enable_gqa=h != kvh, kernel_options=options)
            flat = out.transpose(1, 2).reshape(b * q, h, d)
            output[call.out_rows] = flat.index_select(0, call.out_index)
        return output

    def _forward_eager(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: FlexAttentionMetadata) -> torch.Tensor:
        from torch.nn.attention.flex_attention import flex_attention

        n = meta.num_actual_tokens
        kvh, d = self.num_kv_heads, self.head_size

        output = torch.zeros_like(query)  # padding rows past n stay zero
        if n == 0:
            return output
        num_keys = meta.used.shape[0] * meta.block_size
        k = kv_cache[0].index_select(0, meta.used).view(1, num_keys, kvh, d).transpose(1, 2)  # [1, KVH, S, D]
        v = kv_cache[1].index_select(0, meta.used).view(1, num_keys, kvh, d)
        v = v.masked_fill(~meta.slot_valid[None, :, None, None], 0).transpose(1, 2)  # unwritten slots: 0, not NaN
        q = query[:n].transpose(0, 1)[None]  # [1, H, T, D]
        block_mask = meta.block_mask(self.sliding_window)
        with warnings.catch_warnings():  # eager on purpose (see the module docstring)
            warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
            out = flex_attention(q, k, v, block_mask=block_mask, scale=self.scale, enable_gqa=True)
        output[:n] = out[0].transpose(0, 1)
        return output


def _compiled_flex() -> Callable:
    fn = _compiled.get("fn")
    if fn is None:
        from torch.nn.attention.flex_attention import flex_attention

        fn = _compiled["fn"] = torch.compile(flex_attention, fullgraph=True)
    return fn


def _is_compile_error(exc: BaseException) -> bool:
    """Whether ``exc`` came from dynamo or inductor failing to build a kernel."""
    module = type(exc).__module__
    return module.startswith(("torch._dynamo", "torch._inductor")) or "CompileError" in type(exc).__name__


class FlexAttentionBackend(AttentionBackend):
    name = "flex"

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @staticmethod
    def get_metadata_builder_cls() -> type[AttentionMetadataBuilder]:
        return FlexAttentionMetadataBuilder

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return FlexAttentionImpl

    @classmethod
    def validate_configuration(
        cls,
        *,
        head_size: int,
        dtype: torch.dtype,
        device: str,
        block_size: int,
        use_mla: bool = False,
        kv_cache_dtype: str = "auto",
    ) -> list[str]:
        reasons = refuse_fp8_kv_cache("flex", kv_cache_dtype)
        if use_mla:
            reasons.append("the flex backend has no multi-head latent attention (MLA) path; use 'torch' or 'triton'")
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            reasons.append(f"the flex backend supports float32, bfloat16 and float16, not {dtype}")
        elif dtype == torch.float16 and device == "cpu":
            reasons.append("the flex backend does not run float16 on the CPU; use dtype='bfloat16' or 'float32'")
        if head_size <= 0:
            reasons.append(f"head_size must be positive, got {head_size}")
        if block_size not in BLOCK_SIZES:
            reasons.append(
                f"block_size {block_size} is not supported by the flex backend (FlexAttention's KV tiles "
                "are one cache block, at least 16 tokens); use one of " + ", ".join(map(str, BLOCK_SIZES))
            )
        return reasons

    @classmethod
    def check_available(cls) -> list[str]:
        try:
            found = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return [
                f"this torch ({torch.__version__}) has no torch.nn.attention.flex_attention; "
                "needs torch 2.5 or newer"
            ]
        return []
