"""Engine-wide batch-level logits processors, as vLLM v1 defines them.

``LLM(logits_processors=[cls or "module:Class"])`` names ``LogitsProcessor``
subclasses. The model runner (the process that samples: a worker process with
``tensor_parallel_size > 1``) builds each one once, as
``cls(vllm_config, device, is_pin_memory)``, where ``vllm_config`` is vframe's
``EngineConfig``. Every step that samples, each processor first hears
``update_state(batch_update)`` (``None`` when the batch did not change), then
``apply(logits [B, V])`` gets the logits of the step's sampled rows: row ``i``
is the request at batch index ``i``.

The batch is the step's sampled requests, in row order. From one step to the
next the runner reports how it changed, in vLLM's order::

    removed  indices whose request left (finished, preempted, or not sampled
             this step: it is added again, with its live lists, when it samples)
    added    (index, SamplingParams, prompt_token_ids, output_token_ids): the
             output list is live: it grows by the sampled token every step
    moved    (a, b, UNIDIRECTIONAL): the request at a goes to the empty slot b
             (a, b, SWAP): the requests at a and b trade places

An added request takes the index of a removed one (that index is then not in
``removed``) or one past the end; moves then bring every request to its row.

Non-argmax-invariant processors run before vframe's per-request rewrites
(docs/decoding.md has the order); argmax-invariant ones run after temperature
and only matter for random rows, since greedy rows have taken their argmax
already (vLLM does the same; in an all-greedy step they are not called).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum, auto
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from vframe.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vframe.core.config import EngineConfig
    from vframe.core.sample.batch_state import RequestSamplingState


class MoveDirectionality(Enum):
    UNIDIRECTIONAL = auto()  # a -> b, a becomes empty
    SWAP = auto()  # a <-> b


RemovedRequest = int
AddedRequest = tuple[int, SamplingParams, list[int] | None, list[int]]
MovedRequest = tuple[int, int, MoveDirectionality]


@dataclass(frozen=True)
class BatchUpdate:
    """How the batch changed since the last ``update_state``; apply removed, added, moved."""

    batch_size: int  # requests in the batch after the update
    removed: Sequence[RemovedRequest]
    added: Sequence[AddedRequest]
    moved: Sequence[MovedRequest]


class LogitsProcessor(ABC):
    """vLLM v1's batch-level logits processor (``vllm.v1.sample.logits_processor``)."""

    @classmethod
    def validate_params(cls, sampling_params: SamplingParams) -> None:
        """Raise ``ValueError`` for sampling params this processor cannot serve;
        the request then fails with that message."""
        return None

    @abstractmethod
    def __init__(self, vllm_config: EngineConfig, device: torch.device, is_pin_memory: bool) -> None:
        raise NotImplementedError

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Rewrite ``logits [B, V]`` (in place or not) and return them."""
        raise NotImplementedError

    @abstractmethod
    def is_argmax_invariant(self) -> bool:
        """True if the processor never changes which token has the largest logit."""
        raise NotImplementedError

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate | None) -> None:
        """Called every sampling step before ``apply``; ``None``: the batch is unchanged."""
        raise NotImplementedError


T = TypeVar("T")


def process_dict_updates(
    req_entries: dict[int, T],
    batch_update: BatchUpdate | None,
    new_state: Callable[[SamplingParams, list[int] | None, list[int]], T | None],
) -> bool:
    """Keep ``index -> per-request state`` in step with the batch (vLLM's helper for
    sparse processors). ``new_state`` returns ``None`` for requests the processor
    leaves alone. Returns whether ``req_entries`` changed."""
    if not batch_update:
        return False
    updated = False
    for index, params, prompt_ids, output_ids in batch_update.added:
        if (state := new_state(params, prompt_ids, output_ids)) is not None:
            req_entries[index] = state
            updated = True
        elif req_entries.pop(index, None) is not None:
            updated = True
    if req_entries:
        for index in batch_update.removed:
            if req_entries.pop(index, None) is not None:
                updated = True
        for a, b, direction in batch_update.moved:
            a_entry = req_entries.pop(a, None)
            b_entry = req_entries.pop(b, None)
            if a_entry is not None:
                req_entries[b] = a_entry
                updated = True
            if b_entry is not None and direction == MoveDirectionality.SWAP:
                req_entries[a] = b_entry
                updated = True
    return updated


def load_processor_class(spec: Any) -> type[LogitsProcessor]:
    """A ``LogitsProcessor`` subclass, or its ``"module:Class"`` / ``"module.Class"`` name."""
    cls = spec
    if isinstance(spec, str):
        module_name, sep, attr = spec.partition(":") if ":" in spec else spec.rpartition(".")
        if not sep or not module_name or not attr:
            raise ValueError(f"logits_processors: {spec!r} is not 'module:Class' or 'module.Class'")
        try:
            cls = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"logits_processors: cannot import {spec!r}: {e}") from None
    if not (isinstance(cls, type) and issubclass(cls, LogitsProcessor)):
        raise ValueError(
            f"logits_processors: {spec!r} is not a subclass of vframe.v1.sample.logits_processor.LogitsProcessor"
        )
    return cls


class BatchLogitsProcessors:
    """The runner's engine-wide processors and the batch layout they were told of."""

    def __init__(self, config: EngineConfig, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.classes = [load_processor_class(s) for s in config.sampler.logits_processors]
        self.processors = [cls(config, device, pin) for cls in self.classes]
        self.non_argmax_invariant = [p for p in self.processors if not p.is_argmax_invariant()]
        self.argmax_invariant = [p for p in self.processors if p.is_argmax_invariant()]
        self._slots: list[RequestSamplingState | None] = []  # batch index -> request

    def validate(self, params: SamplingParams) -> None:
        for cls in self.classes:
            cls.validate_params(params)

    def update(self, states: list[RequestSamplingState]) -> None:
        """Tell every processor how the batch changed to ``states`` (row order)."""
        batch_update = self._diff(states)
        for processor in self.processors:
            processor.update_state(batch_update)

    def _diff(self, states: list[RequestSamplingState]) -> BatchUpdate | None:
        slots = self._slots
        wanted = {id(s) for s in states}
        removed: list[int] = []
        for i, s in enumerate(slots):
            if s is not None and id(s) not in wanted:
                removed.append(i)
                slots[i] = None
        present = {id(s) for s in slots if s is not None}
        added: list[AddedRequest] = []
        for row, state in enumerate(states):
            if id(state) in present:
                continue
            # Its own row if free, else the first free slot; a free slot that was just
            # removed is replaced (the add reports it), so it leaves `removed`.
            index = row if row < len(slots) and slots[row] is None else _first_free(slots)
            if index == len(slots):
                slots.append(None)
            if index in removed:
                removed.remove(index)
            slots[index] = state
            live = state.live_output_token_ids()
            added.append((index, state.params, state.token_ids[: state.num_prompt_tokens], live))
        moved: list[MovedRequest] = []
        position = {id(s): i for i, s in enumerate(slots) if s is not None}
        for row, state in enumerate(states):
            current = position[id(state)]
            if current == row:
                continue
            occupant = slots[row]
            direction = MoveDirectionality.UNIDIRECTIONAL if occupant is None else MoveDirectionality.SWAP
            moved.append((current, row, direction))
            slots[row], slots[current] = state, occupant
            position[id(state)] = row
            if occupant is not None:
                position[id(occupant)] = current
        del slots[len(states) :]
        if not (removed or added or moved):
            return None
        return BatchUpdate(batch_size=len(states), removed=removed, added=added, moved=moved)


def _first_free(slots: list[Any]) -> int:
    return next((i for i, s in enumerate(slots) if s is None), len(slots))


def apply_processors(processors: list[LogitsProcessor], logits: torch.Tensor) -> torch.Tensor:
    """Run ``processors`` in order over ``logits [B, V]``; each must return a ``[B, V]`` tensor."""
    for processor in processors:
        new = processor.apply(logits)
        if not isinstance(new, torch.Tensor) or new.shape != logits.shape:
            raise TypeError(
                f"logits processor {type(processor).__qualname__}.apply returned "
                f"{type(new).__name__} {tuple(getattr(new, 'shape', ()))}, not a {tuple(logits.shape)} tensor"
            )
        logits = new
    return logits
