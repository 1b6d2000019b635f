"""Debug mode ``cache.debug_verify_kv_tokens``: is every KV slot a request reads its own?

The KV cache holds vectors, not tokens, so a prefix-cache hit on a block that was
never written (or was written for other tokens) produces plausible but wrong
text. This check keeps, beside the cache, the token id whose KV went into each
slot, and before every forward pass compares the slots each request is about to
attend to (positions ``0 .. context_len - 1`` through its block table) with the
request's own token ids::

    block table  [ 7 | 2 | 9 ]     block_size 4, context_len 10
    slots        28..31 8..11 36,37
    written      t0..t3 t4..t7 t8,t9   must equal the request's token_ids[0:10]

A mismatch, or a slot never written, raises ``KVCacheCorruptionError`` naming
the request, the position and both token ids. Swapped blocks carry their
record with them. It costs a gather over every context token each step: a
test and debugging aid, off by default.
"""

from __future__ import annotations

import numpy as np

from vframe.core.worker.input_batch import InputBatch, StepInputs


class KVCacheCorruptionError(RuntimeError):
    """A request would attend to KV that was not computed from its own tokens."""


class KVTokenCheck:
    def __init__(self, num_slots: int) -> None:
        self.tokens = np.zeros(num_slots, np.int64)  # token id written to each slot
        self.written = np.zeros(num_slots, bool)
        self.swap_tokens: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # swap block -> record

    def verify_and_record(self, inputs: StepInputs, batch: InputBatch) -> None:
        """Check every request's context slots, then record this step's writes."""
        bs = batch.block_size
        common = inputs.common
        context_lens = common.context_lens.cpu().numpy()
        for i, req_id in enumerate(inputs.req_ids):
            context_len = int(context_lens[i])
            if context_len == 0:
                continue
            state = batch.requests[req_id]
            positions = np.arange(context_len)
            slots = np.asarray(state.block_ids, np.int64)[positions // bs] * bs + positions % bs
            expected = np.asarray(state.token_ids[:context_len], np.int64)
            bad = ~self.written[slots] | (self.tokens[slots] != expected)
            if bad.any():
                pos = int(np.argmax(bad))
                found = int(self.tokens[slots[pos]]) if self.written[slots[pos]] else "nothing (never written)"
                raise KVCacheCorruptionError(
                    f"request {req_id!r} would attend at position {pos} (block {state.block_ids[pos // bs]}) "
                    f"to the KV of token {found} instead of its token {int(expected[pos])}"
                )
        slots = common.slot_mapping.cpu().numpy()
        self.tokens[slots] = inputs.input_ids.cpu().numpy()
        self.written[slots] = True

    def swap(self, pairs: list[tuple[int, int]], block_size: int, out: bool) -> None:
        """Carry the record along with swapped blocks (``out``: device -> swap)."""
        for src, dst in pairs:
            if out:
                rows = slice(src * block_size, (src + 1) * block_size)
                self.swap_tokens[dst] = (self.tokens[rows].copy(), self.written[rows].copy())
            else:
                rows = slice(dst * block_size, (dst + 1) * block_size)
                self.tokens[rows], self.written[rows] = self.swap_tokens.pop(src)
