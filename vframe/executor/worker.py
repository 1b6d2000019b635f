"""One rank's side of an executor: the configured model runner, and the few
calls an executor makes beyond the ``ModelRunner`` interface."""

from __future__ import annotations

import os
import traceback
from typing import Any

import torch

from vframe.core.config import EngineConfig
from vframe.core.interfaces import ModelRunner, RunnerInfo
from vframe.core.outputs import ModelRunnerOutput, SchedulerOutput
from vframe.core.plugin_context import PluginContext
from vframe.executor import transport
from vframe.plugins import get_registry


class Worker:
    """Holds rank ``rank``'s ``ModelRunner``. ``collective_rpc(method, args)``
    reaches ``Worker.call``: the names below are answered here, every other one
    by the runner.

    ``remote``: this worker lives in another process than the engine, so the
    ``SamplingParams`` of new requests arrive without the plugin objects the
    engine attached to them (logits processors, compiled grammars; see
    ``vframe/executor/transport.py``): they are rebuilt here, once per request."""

    _OWN = frozenset({"load_model_info", "set_plugin_context", "execute_model"})

    def __init__(self, config: EngineConfig, rank: int = 0, *, remote: bool = False) -> None:
        self.config = config
        self.rank = rank
        self.remote = remote
        self.runner: ModelRunner = get_registry("model_runner").load(config.device.model_runner)(config)
        self._sampling_setup: Any = None

    def call(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        target = self if method in self._OWN else self.runner
        return getattr(target, method)(*args)

    def load_model_info(self) -> RunnerInfo:
        self.runner.load_model()
        return RunnerInfo.of(self.runner)

    def set_plugin_context(self, context: PluginContext) -> None:
        self.runner.set_plugin_context(context)
        if self.remote:
            from vframe.core.sample.request_setup import SamplingSetup

            self._sampling_setup = SamplingSetup(context)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self._sampling_setup is not None:
            for new in scheduler_output.scheduled_new_reqs:
                self._sampling_setup.restore(new.sampling_params)
        return self.runner.execute_model(scheduler_output)


def threads_per_rank(config: EngineConfig) -> int:
    """Torch threads of one CPU rank: ``num_threads`` when set, else this
    process's CPUs shared evenly among the ranks on this machine."""
    if config.device.num_threads:
        return config.device.num_threads
    return max(1, len(os.sched_getaffinity(0)) // config.parallel.tensor_parallel_size)


def collective_backend(config: EngineConfig) -> str:
    """``nccl`` for CUDA ranks, ``gloo`` for CPU ones."""
    from vframe.core.worker.model_runner import resolve_device

    return "nccl" if resolve_device(config.device.device).type == "cuda" else "gloo"


def start_rank(config: EngineConfig, rank: int, init_method: str, local_rank: int) -> Worker:
    """Everything a worker process does before its first call: pick its device
    and threads, join the tensor-parallel group, build its runner."""
    from vframe.distributed.parallel_state import init_tensor_parallel
    from vframe.plugins.manager import load_plugins

    load_plugins(config.plugins.plugins)  # the engine's plugins, here too
    backend = collective_backend(config)
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(threads_per_rank(config))
    init_tensor_parallel(rank, config.parallel.tensor_parallel_size, init_method, backend=backend)
    return Worker(config, rank, remote=True)


# --------------------------------------------------------------------------- #
# replies
# --------------------------------------------------------------------------- #


def error_reply(error: BaseException) -> bytes:
    """A rank's failed call, for the driver: the exception itself when it makes
    the round trip (the driver re-raises its type), else a ``RuntimeError``
    with its text and traceback."""
    try:
        reply = transport.dumps(("error", error))
        transport.loads(reply)  # an exception whose __init__ takes other arguments does not come back
        return reply
    except Exception:  # noqa: BLE001 - an exception holding something unpicklable
        text = "".join(traceback.format_exception(error))
        return transport.dumps(("error", RuntimeError(f"{describe(error)}\n{text}")))


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"
