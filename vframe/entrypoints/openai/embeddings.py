"""``POST /v1/embeddings``: OpenAI's embeddings API on a pooling model (``--runner pooling``).

``input`` is a text, a list of texts, a list of token ids or a list of those;
``data[i]`` is the embedding of the ``i``-th input, a list of floats or, with
``encoding_format: "base64"``, its little-endian float32 bytes in base64 (what
the ``openai`` client asks for by default and decodes itself).
"""

from __future__ import annotations

import base64
import time
from typing import Any, Literal

import numpy as np
from pydantic import Field, field_validator

from vframe.core.pooling_params import PoolingParams
from vframe.entrypoints.openai.errors import REQUEST_ERRORS, APIError
from vframe.entrypoints.openai.prompts import Prompt
from vframe.entrypoints.openai.protocol import (
    NonEmptyText,
    TokenIds,
    UsageInfo,
    _Body,
    _is_token_ids,
    _NonEmpty,
    _Response,
)
from vframe.entrypoints.openai.serving import ServingContext


class EmbeddingRequest(_Body):
    model: str | None = None
    input: NonEmptyText | _NonEmpty[list[NonEmptyText]] | _NonEmpty[TokenIds] | _NonEmpty[list[_NonEmpty[TokenIds]]] = (
        Field(description="a text, a list of texts, a list of token ids, or a list of those; none of them empty")
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="only for Matryoshka models (refused otherwise)")
    user: str | None = None
    # vLLM's extra parameters
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description="keep the last k tokens; -1: max_model_len")
    add_special_tokens: bool = True
    normalize: bool | None = Field(None, description="L2-normalise; null: as the model's pooler does")

    @field_validator("input", mode="before")
    @classmethod
    def _input_shape(cls, value: Any) -> Any:
        ok = isinstance(value, str) or _is_token_ids(value) or (
            isinstance(value, list)
            and (all(isinstance(p, str) for p in value) or all(_is_token_ids(p) for p in value))
        )
        if not ok:
            raise ValueError(
                "must be a string, a list of strings, a list of token ids or a list of those "
                f"(got {type(value).__name__})"
            )
        if not value or (isinstance(value, list) and not all(value)):
            raise ValueError("the input is empty: give a non-empty text or token ids")
        return value


class EmbeddingData(_Response):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: list[float] | str


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: UsageInfo


async def create_embedding(ctx: ServingContext, request: EmbeddingRequest) -> EmbeddingResponse:
    model, lora_request = ctx.check_model(request.model)
    if ctx.engine.runner_type != "pooling":
        raise APIError.bad_request(
            f"The model does not support Embeddings API: {model!r} runs with runner='generate'; "
            "serve an embedding model (vframe serve MODEL --runner pooling)",
            param="model",
        )
    if lora_request is not None:
        raise APIError.bad_request("LoRA adapters are not supported by the pooling runner", param="model")
    if isinstance(request.input, str) or isinstance(request.input[0], str):
        texts = [request.input] if isinstance(request.input, str) else request.input
        prompts = await ctx.prompts.texts(texts, request.add_special_tokens, field="input")  # type: ignore[arg-type]
    else:
        ids = [request.input] if isinstance(request.input[0], int) else request.input
        prompts = [Prompt(None, list(p)) for p in ids]  # type: ignore[arg-type]
    try:
        params = PoolingParams(
            normalize=request.normalize,
            dimensions=request.dimensions,
            truncate_prompt_tokens=request.truncate_prompt_tokens,
            task="embed",
        )
        outputs = await ctx.engine.encode([{"prompt_token_ids": p.token_ids} for p in prompts], [params] * len(prompts))
    except REQUEST_ERRORS as e:
        error = APIError.from_request_error(e, "input")
        raise APIError.bad_request(error.message, param="dimensions" if "dimensions" in error.message else error.param)
    num_tokens = sum(len(out.prompt_token_ids) for out in outputs)
    return EmbeddingResponse(
        id=ctx.new_id("embd"),
        model=model,
        data=[
            EmbeddingData(index=i, embedding=_encode(out.outputs.data.tolist(), request.encoding_format))
            for i, out in enumerate(outputs)
        ],
        usage=UsageInfo(prompt_tokens=num_tokens, total_tokens=num_tokens),
    )


def _encode(embedding: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype="<f4").tobytes()).decode("ascii")
