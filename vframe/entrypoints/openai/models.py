"""The names a request's ``model`` may take: the served base model and its LoRA
adapters (``/v1/models``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``).

Adapters given with ``--lora-modules`` get the ids 1, 2, ... in order and are
loaded before the server listens; adapters loaded at run time get the next ids,
never reused, so an adapter loaded again under the same name never shares
prefix-cache blocks with its predecessor.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from vframe.core.async_engine import AsyncLLMEngine
from vframe.entrypoints.openai.errors import APIError
from vframe.entrypoints.openai.protocol import ModelCard
from vframe.errors import InvalidRequestError
from vframe.lora.request import LoRARequest

logger = logging.getLogger(__name__)

# vLLM's variable is honoured too, so that a vLLM deployment's environment works unchanged.
RUNTIME_LORA_UPDATING_ENV = ("VFRAME_ALLOW_RUNTIME_LORA_UPDATING", "VLLM_ALLOW_RUNTIME_LORA_UPDATING")


def runtime_lora_updating_allowed() -> bool:
    """Whether the load/unload endpoints exist (an environment variable set to true or 1)."""
    return any(os.environ.get(name, "").strip().lower() in ("1", "true") for name in RUNTIME_LORA_UPDATING_ENV)


class ServingModels:
    """The base model and the LoRA adapters a request may name, by name."""

    def __init__(
        self, engine: AsyncLLMEngine, base_model_name: str | list[str], root: str, max_model_len: int,
        lora_requests: list[LoRARequest] | None = None,
    ) -> None:
        self.engine = engine
        # vLLM's --served-model-name NAME...: a request may name any of them; responses
        # and errors give the first
        self.base_model_names = [base_model_name] if isinstance(base_model_name, str) else list(base_model_name)
        self.base_model_name = self.base_model_names[0]
        self.root = root
        self.max_model_len = max_model_len
        self.loras: dict[str, LoRARequest] = {r.lora_name: r for r in lora_requests or []}
        self._next_id = itertools.count(max((r.lora_int_id for r in self.loras.values()), default=0) + 1)
        self._updating = asyncio.Lock()  # one load or unload at a time: names stay unique

    # ------------------------------------------------------------------ #
    # requests
    # ------------------------------------------------------------------ #

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter ``model`` names, ``None`` for the base model (or no ``model``); 404 otherwise."""
        if model is None or model in self.base_model_names:
            return None
        lora = self.loras.get(model)
        if lora is None:
            raise self._not_found(model)
        return lora

    def check_served(self, lora: LoRARequest | None) -> None:
        """404 if ``lora`` was unloaded since ``resolve`` returned it; call it just
        before the engine request is queued (no ``await`` between the two)."""
        if lora is not None and self.loras.get(lora.lora_name) is not lora:
            raise self._not_found(lora.lora_name)

    def _not_found(self, model: str) -> APIError:
        adapters = f" and the LoRA adapters {sorted(self.loras)}" if self.loras else ""
        return APIError(
            404,
            f"The model '{model}' does not exist; this server serves '{self.base_model_name}'{adapters} "
            "(see /v1/models)",
            param="model",
            code="model_not_found",
        )

    def cards(self) -> list[ModelCard]:
        bases = [ModelCard(id=name, root=self.root, max_model_len=self.max_model_len) for name in self.base_model_names]
        adapters = [
            ModelCard(id=r.lora_name, root=r.lora_path, parent=r.base_model_name or self.base_model_name)
            for r in self.loras.values()
        ]
        return [*bases, *adapters]

    def card(self, model: str) -> ModelCard:
        lora = self.resolve(model)
        name = model if lora is None else lora.lora_name
        return next(c for c in self.cards() if c.id == name)

    # ------------------------------------------------------------------ #
    # run-time loading
    # ------------------------------------------------------------------ #

    async def load(self, name: str | None, path: str | None) -> str:
        """Load and check an adapter on the engine thread, then serve it under ``name``."""
        if not self.engine.config.lora.enable_lora:
            raise APIError.bad_request(
                "LoRA is not enabled: start the server with --enable-lora to load adapters", param="lora_name"
            )
        if not name or not path:
            raise APIError.bad_request(
                "Both 'lora_name' and 'lora_path' must be provided.", param="lora_path" if name else "lora_name"
            )
        async with self._updating:
            if name in self.loras or name in self.base_model_names:
                raise APIError.bad_request(f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            request = LoRARequest(name, next(self._next_id), path)
            try:
                await self.engine.add_lora(request)
            except InvalidRequestError as e:  # LoRAAdapterError: unreadable, too large a rank, another base
                raise APIError.bad_request(str(e), param="lora_path") from e
            self.loras[name] = request
        logger.info("loaded LoRA adapter %r from %s (id %d)", name, path, request.lora_int_id)
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload(self, name: str | None) -> str:
        """Forget an adapter; refused while requests in flight use it."""
        if not name:
            raise APIError.bad_request("'lora_name' needs to be provided to unload a LoRA adapter.", param="lora_name")
        async with self._updating:
            request = self.loras.get(name)
            if request is None:
                raise APIError(
                    404, f"The lora adapter '{name}' cannot be found.", param="lora_name", code="model_not_found"
                )
            # Unlisted before the engine is asked: a request that resolved the name
            # earlier has queued its add before this remove (one FIFO queue), so the
            # engine sees it in flight and refuses; none can resolve it afterwards.
            served = dict(self.loras)
            del self.loras[name]
            if not await self.engine.remove_lora(request.lora_int_id):
                self.loras = served
                raise APIError.bad_request(
                    f"The lora adapter '{name}' is in use by requests in flight; unload it once they finish.",
                    param="lora_name",
                )
        logger.info("unloaded LoRA adapter %r", name)
        return f"Success: LoRA adapter '{name}' removed successfully."
