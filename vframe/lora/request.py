"""``LoRARequest``: which adapter a request runs with, named as in vLLM."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT adapter for one request: ``LoRARequest("sql", 1, "/adapters/sql")``.

    Attributes:
        lora_name: the adapter's name (what the OpenAI server lists and a
            request's ``model`` selects).
        lora_int_id: a positive integer identifying the adapter within the
            engine; requests with the same id share its loaded weights and
            their prefix-cache blocks, requests with different ids never do.
        lora_path: the adapter directory (``adapter_config.json`` +
            ``adapter_model.safetensors``).
        base_model_name: the base model the adapter was trained on, if known
            (``/v1/models`` lists it as the adapter's ``parent``).
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest: lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest: lora_path must be a non-empty string, got {self.lora_path!r}")

    # vLLM's aliases
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
