"""How calls and results cross to a worker in another process: pickle, with
one exception. The engine completes every request's ``SamplingParams`` with
plugin objects (``_logits_processor_factories``, a compiled ``_grammar``) that
belong to its process and may not pickle; they are left out here, and the
worker rebuilds them from the request's own fields
(``SamplingParams.restore`` via ``SamplingSetup.restore``).

A request's own ``logits_processors`` travel as a separate pickle: a callable
that the worker cannot import (defined in the user's ``__main__`` or a test
module) becomes a processor that fails that request alone, instead of a step
that no rank can read.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

from vframe.core.sampling_params import SamplingParams
from vframe.errors import InvalidRequestError

_ENGINE_SIDE = {"_logits_processor_factories": [], "_grammar": None}


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, SamplingParams):
            state = {**obj.__dict__, **_ENGINE_SIDE}
            processors = state.pop("logits_processors")
            return _rebuild, (type(obj), state, pickle.dumps(processors) if processors else processors)
        return NotImplemented


def _rebuild(cls: type[SamplingParams], state: dict[str, Any], processors: bytes | list | None) -> SamplingParams:
    params = cls.__new__(cls)
    params.__dict__.update(state)
    if isinstance(processors, bytes):
        try:
            processors = pickle.loads(processors)
        except Exception as e:  # noqa: BLE001 - this request fails when its processor runs
            processors = [_Unloadable(f"{type(e).__name__}: {e}")]
    params.logits_processors = processors
    return params


class _Unloadable:
    """Stands for a logits processor the worker could not import."""

    def __init__(self, why: str) -> None:
        self.why = why

    def __call__(self, token_ids: list[int], logits: Any) -> Any:
        raise RuntimeError(
            f"this request's logits processor could not be loaded in the tensor-parallel worker ({self.why}); "
            "pass a registered processor name, or a function defined in an importable module"
        )


def check_sendable(params: SamplingParams) -> None:
    """Refuse, before it is queued, a request whose logits processors cannot be
    sent to a worker process at all."""
    if not params.logits_processors:
        return
    try:
        pickle.dumps(params.logits_processors)
    except Exception as e:  # noqa: BLE001 - pickle raises several types
        raise InvalidRequestError(
            f"SamplingParams.logits_processors cannot be sent to the tensor-parallel workers ({e}); "
            "pass a registered processor name, or a function defined at module level"
        ) from None


def dumps(obj: Any) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buffer.getvalue()


loads = pickle.loads
