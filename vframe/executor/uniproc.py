"""``distributed_executor_backend="uni"``: the one rank in the engine's own
process, called directly (the default at ``tensor_parallel_size=1``)."""

from __future__ import annotations

from typing import Any

from vframe.core.config import EngineConfig
from vframe.core.interfaces import Executor, RunnerInfo
from vframe.core.outputs import ModelRunnerOutput, SchedulerOutput
from vframe.errors import ConfigError
from vframe.executor.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        size = config.parallel.tensor_parallel_size
        if size != 1:
            raise ConfigError(
                f"distributed_executor_backend='uni' runs one rank in this process, not "
                f"tensor_parallel_size={size}; use 'mp' (one process per rank on this machine) or 'ray'"
            )
        self.worker = Worker(config)
        self.driver_runner = self.worker.runner

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [self.worker.call(method, args)]

    def load_model(self) -> RunnerInfo:
        return self.worker.load_model_info()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.runner.execute_model(scheduler_output)
