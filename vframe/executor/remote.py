"""The driver's side of the executors whose ranks are other processes (``mp``,
``ray``, a plugin's): calls go out as bytes, replies are combined, and a rank
that dies or falls out of step ends the executor."""

from __future__ import annotations

import logging
from abc import abstractmethod
from typing import Any

from vframe.core.config import EngineConfig
from vframe.core.interfaces import Executor
from vframe.core.sampling_params import SamplingParams
from vframe.errors import ExecutorDeadError
from vframe.executor import transport
from vframe.executor.worker import describe

logger = logging.getLogger(__name__)

# How long ranks that have answered wait for the others once one of them failed:
# past it, the ones still running are stuck in a collective their peer left.
DESYNC_TIMEOUT_S = 30.0


class RanksOutOfStep(Exception):
    """Some ranks failed a call that others completed: their states differ now."""


def combine_replies(replies: list[tuple[str, Any]]) -> list[Any]:
    """Every rank's ``("ok", result)`` or ``("error", exception)``, in rank order
    -> the results. Every rank failed: rank 0's exception is raised (the ranks
    agree; the engine goes on). Some failed: ``RanksOutOfStep``."""
    errors = {rank: value for rank, (status, value) in enumerate(replies) if status == "error"}
    if not errors:
        return [value for _, value in replies]
    if len(errors) == len(replies):
        raise errors[0]
    rank, error = min(errors.items())
    succeeded = sorted(set(range(len(replies))) - errors.keys())
    raise RanksOutOfStep(
        f"tensor-parallel rank {rank} failed ({describe(error)}) while ranks {succeeded} succeeded: "
        "the ranks are out of step"
    )


class RemoteRanksExecutor(Executor):
    """Subclasses start the ranks (each runs ``worker.start_rank`` and answers
    ``Worker.call``), set ``pids``, and implement ``_call``; ``_die`` ends them."""

    pids: list[int]

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel.tensor_parallel_size
        self._dead: ExecutorDeadError | None = None
        _prepare_model_files(config)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        if self._dead is not None:
            raise self._dead
        try:
            payload = transport.dumps((method, args))
        except Exception as e:  # noqa: BLE001 - something in the call does not pickle
            raise RuntimeError(f"cannot send {method}() to the tensor-parallel workers: {e}") from e
        return self._call(payload)

    @abstractmethod
    def _call(self, payload: bytes) -> list[Any]:
        """Send ``payload`` to every rank; ``_combine`` their replies."""

    def check_request(self, params: SamplingParams) -> None:
        transport.check_sendable(params)

    def _combine(self, replies: list[tuple[str, Any]]) -> list[Any]:
        try:
            return combine_replies(replies)
        except RanksOutOfStep as e:
            self._die(str(e))
            raise AssertionError("unreachable") from e

    def _die(self, why: str) -> None:
        """Stop every rank and raise, now and on every later call."""
        self._dead = ExecutorDeadError(f"{why}; the engine stopped every worker and cannot run more steps")
        logger.error("%s", self._dead)
        self.shutdown()
        raise self._dead


def _prepare_model_files(config: EngineConfig) -> None:
    """Convert a GGUF once, in the driver, before the ranks would race to do it."""
    from vframe.models.loader import resolve_model

    resolve_model(config.model.model, convert_weights=config.quantization.quantization != "gguf")
