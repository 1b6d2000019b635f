"""vLLM's ``get_tokenizer`` (``vllm.tokenizers`` / ``vllm.transformers_utils.tokenizer``):
the tokenizer vframe itself would load, from local files only."""

from __future__ import annotations

import os
from typing import Any

from vframe.errors import ConfigError


def get_tokenizer(
    tokenizer_name: str | os.PathLike[str] | None = None,
    *args: Any,
    tokenizer_mode: str = "auto",
    trust_remote_code: bool = False,
    revision: str | None = None,
    **kwargs: Any,
) -> Any:
    """The fast transformers tokenizer of a model directory, a tokenizer directory or a
    ``.gguf`` file (``None``: the embedded SmolLM2's), as ``LLM(tokenizer=...)`` loads it.
    ``tokenizer_mode`` takes vLLM's ``auto``, ``slow`` and ``hf`` (all give the same fast
    tokenizer); ``revision`` must be ``None`` (nothing is downloaded); ``trust_remote_code``
    is accepted and no code shipped with a model is run. Other arguments are refused."""
    if args or kwargs:
        names = [repr(a) for a in args] + sorted(kwargs)
        raise ConfigError(f"get_tokenizer() does not take {', '.join(names)}")
    if tokenizer_mode not in ("auto", "slow", "hf"):
        raise ConfigError(f"tokenizer_mode={tokenizer_mode!r} is not supported; use 'auto', 'slow' or 'hf'")
    if revision is not None:
        raise ConfigError(f"revision={revision!r} is not supported: vframe reads local files only")
    from vframe.models.loader import load_tokenizer, resolve_model

    if tokenizer_name is None:
        return load_tokenizer(resolve_model(None))
    return load_tokenizer(None, tokenizer_override=os.fspath(tokenizer_name))  # type: ignore[arg-type]
