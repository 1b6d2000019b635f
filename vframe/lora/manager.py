"""``LoRAManager``: which adapters a model can serve, which sit in host memory, which in device slots.

Three levels, each bounded and least-recently-used first out::

    added      every LoRARequest given to add_adapter (id -> request): unbounded, tiny
    host       loaded, checked and sharded weights, at most max_cpu_loras: reloaded
               from the request's path when needed after eviction
    slots      max_loras device slots in every LoRALinear of the model; a step can
               use at most max_loras distinct adapters (the scheduler's promise)

Each step the runner calls ``prepare_step`` with the token ranges that use each
adapter id; the manager makes every id resident (evicting the least recently
used slot this step does not need) and sets the shared ``LoRAStepContext`` that
every ``LoRALinear`` reads::

    prepare_step([(0, 5, 7), (9, 12, 3)])     ids 7 and 3 -> slots, say 1 and 0
    context.segments = starts [0, 9], ends [5, 12], slots [1, 0]; tokens 5..8 get no delta
"""

from __future__ import annotations

from collections import OrderedDict

import torch
from torch import nn

from vframe.errors import ConfigError, LoRAAdapterError
from vframe.layers.binding import bind_model
from vframe.layers.linear import LinearBase
from vframe.lora.layers import LoRALinear, LoRAStepContext
from vframe.lora.ops import LoRAKernel, LoRASegments, add_lora
from vframe.lora.peft import LoRAWeights, adapter_error, load_peft_adapter
from vframe.lora.request import LoRARequest

# layer name -> one entry per output slice (None: the adapter leaves the slice alone)
_ShardedAdapter = dict[str, list[LoRAWeights | None]]

# Never adapted: the vocabulary side of the model.
_EXCLUDED = ("lm_head",)


class LoRAManager:
    """Wraps ``model``'s linear layers in ``LoRALinear`` (in place, once its weights are
    loaded) and keeps adapters resident for them."""

    def __init__(
        self,
        model: nn.Module,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device | str,
        kernel: LoRAKernel = add_lora,
    ) -> None:
        for name, value in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if value < 1:
                raise ConfigError(f"{name}={value}: must be at least 1")
        if max_cpu_loras < max_loras:
            raise ConfigError(
                f"max_cpu_loras={max_cpu_loras} < max_loras={max_loras}: the host cache must hold at "
                "least the adapters resident on the device; raise max_cpu_loras"
            )
        self.model_name = type(model).__name__
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.device = torch.device(device)
        self._no_lora = LoRASegments.from_lists([], [], [], device=self.device)
        self.context = LoRAStepContext(self._no_lora)
        self._layers: dict[str, LoRALinear] = {}
        self._targets: dict[str, tuple[str, int]] = {}  # HF module path -> (layer name, slice)
        self._wrap(model, kernel)
        bind_model(model)  # the model's modules changed: what was bound to the old ones (a decode plan) is rebuilt

        self._requests: dict[int, LoRARequest] = {}
        self._host: OrderedDict[int, _ShardedAdapter] = OrderedDict()  # least recently used first
        self._slots: list[int | None] = [None] * max_loras
        self._slot_last_used = [0] * max_loras
        self._step = 0

    # ------------------------------------------------------------------ #
    # Wrapping
    # ------------------------------------------------------------------ #

    def _wrap(self, model: nn.Module, kernel: LoRAKernel) -> None:
        packed = getattr(type(model), "packed_modules_mapping", None)
        if packed is None:
            raise ConfigError(
                f"LoRA is not supported for {self.model_name}: it declares no packed_modules_mapping "
                "(which of its layers fuse which checkpoint modules); disable LoRA for this model"
            )
        if any(isinstance(m, LoRALinear) for m in model.modules()):
            raise ValueError(f"{self.model_name} already has LoRA layers; build one LoRAManager per model")
        found = [
            (name, m)
            for name, m in model.named_modules()
            if isinstance(m, LinearBase) and name.rsplit(".", 1)[-1] not in _EXCLUDED
        ]
        for name, base in found:
            layer = LoRALinear(
                base,
                self.context,
                max_loras=self.max_loras,
                max_lora_rank=self.max_lora_rank,
                dtype=self.dtype,
                device=self.device,
                kernel=kernel,
            )
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, layer)
            self._layers[name] = layer
            parent_prefix = f"{parent_name}." if parent_name else ""
            sub_modules = packed.get(child, [child])
            if len(sub_modules) != layer.num_slices:
                if len(sub_modules) == 1:
                    continue  # fused, but not named in packed_modules_mapping: no adapter can target it
                raise ValueError(
                    f"{self.model_name}.packed_modules_mapping[{child!r}] names {len(sub_modules)} modules, "
                    f"but {name} has {layer.num_slices} output slices"
                )
            for i, sub in enumerate(sub_modules):
                self._targets[parent_prefix + sub] = (name, i)

    # ------------------------------------------------------------------ #
    # Adapters
    # ------------------------------------------------------------------ #

    def list_adapters(self) -> list[LoRARequest]:
        """Every added adapter (cached on the host or not), by id."""
        return [self._requests[i] for i in sorted(self._requests)]

    def add_adapter(self, request: LoRARequest) -> None:
        """Load, check and cache ``request``'s adapter; raises ``LoRAAdapterError`` if it cannot be
        served. Adding an id again refreshes its place in the host cache."""
        lora_id = request.lora_int_id
        known = self._requests.get(lora_id)
        if known is not None and (known.lora_name, known.lora_path) != (request.lora_name, request.lora_path):
            raise adapter_error(
                request,
                f"has lora_int_id {lora_id}, already used by adapter {known.lora_name!r} ({known.lora_path}); "
                "give each adapter its own id",
            )
        if lora_id in self._host:
            self._host.move_to_end(lora_id)
        else:
            self._cache(lora_id, self._load(request))
        self._requests[lora_id] = request

    def remove_adapter(self, lora_int_id: int) -> bool:
        """Forget an adapter; False if it was not added. A slot the current step uses keeps its
        weights until the step has run, but is free for the next one."""
        request = self._requests.pop(lora_int_id, None)
        self._host.pop(lora_int_id, None)
        in_use = set(self.context.segments.slots_cpu)
        for slot, slot_id in enumerate(self._slots):
            if slot_id == lora_int_id:
                self._slots[slot] = None
                if slot not in in_use:
                    for layer in self._layers.values():
                        layer.clear_slot(slot)
        return request is not None

    def _load(self, request: LoRARequest) -> _ShardedAdapter:
        adapter = load_peft_adapter(request, max_lora_rank=self.max_lora_rank)
        sharded: _ShardedAdapter = {}
        for module, weights in adapter.modules.items():
            target = self._targets.get(module)
            if target is None:
                raise adapter_error(
                    request,
                    f"was trained for a different base model: it adapts {module}, which is not a layer "
                    f"LoRA can adapt in {self.model_name}",
                )
            layer_name, i = target
            layer = self._layers[layer_name]
            expected_a, expected_b = layer.full_shapes(i, weights.rank)
            for which, tensor, expected in (("A", weights.lora_a, expected_a), ("B", weights.lora_b, expected_b)):
                if list(tensor.shape) != expected:
                    raise adapter_error(
                        request,
                        f"was trained for a different base model: {module}.lora_{which} has shape "
                        f"{list(tensor.shape)}, this model expects {expected}",
                    )
            shard = layer.shard(i, weights)
            entry = sharded.setdefault(layer_name, [None] * layer.num_slices)
            entry[i] = LoRAWeights(
                shard.lora_a.to(self.dtype).contiguous(), shard.lora_b.to(self.dtype).contiguous(), shard.scaling
            )
        return sharded

    def _cache(self, lora_id: int, sharded: _ShardedAdapter) -> None:
        self._host[lora_id] = sharded
        self._host.move_to_end(lora_id)
        while len(self._host) > self.max_cpu_loras:
            self._host.popitem(last=False)

    def _host_adapter(self, lora_id: int) -> _ShardedAdapter:
        """The adapter's weights from the host cache, reloaded from its path if evicted."""
        sharded = self._host.get(lora_id)
        if sharded is None:
            sharded = self._load(self._requests[lora_id])
        self._cache(lora_id, sharded)
        return sharded

    # ------------------------------------------------------------------ #
    # Steps
    # ------------------------------------------------------------------ #

    def prepare_step(self, segments: list[tuple[int, int, int]]) -> None:
        """Make the adapters of this step's ``(start, end, lora_int_id)`` token ranges (sorted,
        non-overlapping) resident and point every LoRA layer at their slots. ``[]``: no LoRA."""
        if not segments:
            self.context.segments = self._no_lora
            return
        ids = list(dict.fromkeys(lora_id for _, _, lora_id in segments))
        if len(ids) > self.max_loras:
            raise RuntimeError(
                f"a step uses {len(ids)} adapters ({ids}) but max_loras={self.max_loras}; "
                "the scheduler must not schedule more distinct adapters than max_loras"
            )
        for lora_id in ids:
            if lora_id not in self._requests:
                raise LoRAAdapterError(f"adapter id {lora_id} is not loaded (never added, or removed)")
        self._step += 1
        slot_of = {slot_id: slot for slot, slot_id in enumerate(self._slots) if slot_id is not None}
        for lora_id in ids:
            if lora_id in slot_of:
                self._slot_last_used[slot_of[lora_id]] = self._step
                if lora_id in self._host:
                    self._host.move_to_end(lora_id)
        for lora_id in ids:
            if lora_id in slot_of:
                continue
            needed = {slot_of[i] for i in ids if i in slot_of}
            slot = self._free_slot(needed)
            self._activate(slot, lora_id)
            slot_of[lora_id] = slot
        starts, ends, lora_ids = zip(*segments, strict=True)
        self.context.segments = LoRASegments.from_lists(
            starts, ends, [slot_of[i] for i in lora_ids], device=self.device
        )

    def _free_slot(self, needed: set[int]) -> int:
        """An empty slot, else the least recently used one this step does not need."""
        candidates = [s for s in range(self.max_loras) if s not in needed]
        assert candidates, "prepare_step checked there are at most max_loras adapters"
        empty = [s for s in candidates if self._slots[s] is None]
        return empty[0] if empty else min(candidates, key=lambda s: self._slot_last_used[s])

    def _activate(self, slot: int, lora_id: int) -> None:
        sharded = self._host_adapter(lora_id)
        for name, layer in self._layers.items():
            layer.set_slot(slot, sharded.get(name) or [None] * layer.num_slices)
        self._slots[slot] = lora_id
        self._slot_last_used[slot] = self._step

    # ------------------------------------------------------------------ #
    # Introspection
    # ------------------------------------------------------------------ #

    def target_shapes(self, rank: int) -> dict[str, tuple[list[int], list[int]]]:
        """Every module an adapter may target (checkpoint path, e.g. ``model.layers.0.self_attn.q_proj``)
        -> the shapes of its ``lora_A`` and ``lora_B`` at ``rank``, as a PEFT file holds them."""
        return {
            module: self._layers[layer_name].full_shapes(i, rank) for module, (layer_name, i) in self._targets.items()
        }

    def slot_ids(self) -> list[int | None]:
        """The adapter id in each device slot."""
        return list(self._slots)

    def host_ids(self) -> list[int]:
        """The adapters in the host cache, least recently used first."""
        return list(self._host)
