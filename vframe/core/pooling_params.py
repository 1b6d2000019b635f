"""``PoolingParams``: what a pooling request asks for, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass

from vframe.errors import InvalidRequestError

POOLING_TASKS = ("embed", "token_embed")


@dataclass
class PoolingParams:
    """Per-request settings of ``LLM.embed`` / ``LLM.encode`` and ``/v1/embeddings``.

    Attributes:
        normalize: L2-normalise the output; ``None``: the model's pooler decides
            (all-MiniLM-L6-v2 and decoder models normalise).
        dimensions: the output size of a Matryoshka model; other models refuse it.
        truncate_prompt_tokens: keep only the last ``k`` prompt tokens (``-1``:
            the last ``max_model_len``).
        task: ``"embed"`` (one vector per prompt) or ``"token_embed"`` (one per
            token); set by the ``LLM`` method that runs the request.
    """

    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    task: str | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not isinstance(self.dimensions, int) or self.dimensions < 1):
            raise InvalidRequestError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or (k < 1 and k != -1)):
            raise InvalidRequestError(f"truncate_prompt_tokens must be a positive integer or -1, got {k!r}")
        if self.task is not None and self.task not in POOLING_TASKS:
            raise InvalidRequestError(
                f"pooling task {self.task!r} is not supported; vframe's pooling runner serves {POOLING_TASKS} "
                "(no classification or reward heads yet)"
            )
