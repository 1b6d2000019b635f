"""``distributed_executor_backend="ray"``: one Ray actor per tensor-parallel
rank, placed by a placement group, so ranks may sit on several machines of a
Ray cluster (``pip install 'vframe[ray]'``).

The engine joins the cluster named by ``RAY_ADDRESS`` (or one started on this
machine with ``ray start --head``); with none, ``ray.init()`` starts a local
one. The placement group asks for one bundle per rank (a GPU each on CUDA,
else ``num_threads`` CPUs, 1 by default) with the ``PACK`` strategy: on one
machine when it fits, spread over machines when it does not. The ranks then
rendezvous over TCP at rank 0's node address and exchange activations
through torch.distributed (NCCL or gloo); Ray carries only each step's call
and rank 0's result, as bytes made by ``vframe/executor/transport.py``.

Every machine must see the model at the same path (a shared file system, or
the same copy on each).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from vframe.core.config import EngineConfig
from vframe.errors import ConfigError
from vframe.executor import transport
from vframe.executor.remote import DESYNC_TIMEOUT_S, RemoteRanksExecutor
from vframe.executor.worker import collective_backend, error_reply, start_rank

logger = logging.getLogger(__name__)

_PLACEMENT_TIMEOUT_S = 60.0


class RayWorker:
    """What each actor runs: a ``Worker`` built once the group's address is known."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node_address(self) -> tuple[str, int]:
        """This node's IP address and a port free on it now (for rank 0's rendezvous)."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def pid(self) -> int:
        return os.getpid()

    def start(self, payload: bytes) -> bytes:
        config, rank, init_method = transport.loads(payload)
        try:
            # Ray shows each actor only its own GPU: it is device 0 here.
            self.worker = start_rank(config, rank, init_method, local_rank=0)
        except BaseException as e:  # noqa: BLE001 - the driver decides
            return error_reply(e)
        return transport.dumps(("ok", None))

    def call(self, payload: bytes) -> bytes:
        method, args = transport.loads(payload)
        try:
            return transport.dumps(("ok", self.worker.call(method, args)))
        except BaseException as e:  # noqa: BLE001 - the driver decides
            return error_reply(e)


class RayExecutor(RemoteRanksExecutor):
    def __init__(self, config: EngineConfig) -> None:
        try:
            import ray
            from ray.util.placement_group import placement_group, remove_placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError:
            raise ConfigError(
                "distributed_executor_backend='ray' needs Ray: pip install 'vframe[ray]'"
            ) from None
        super().__init__(config)
        self._ray = ray
        self._remove_placement_group = remove_placement_group
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
        on_gpu = collective_backend(config) == "nccl"
        bundle = {"GPU": 1.0, "CPU": 1.0} if on_gpu else {"CPU": float(config.device.num_threads or 1)}
        self._placement = placement_group([dict(bundle) for _ in range(self.world_size)], strategy="PACK")
        try:
            ray.get(self._placement.ready(), timeout=_PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._placement)
            raise ConfigError(
                f"tensor_parallel_size={self.world_size} with Ray: the cluster cannot place "
                f"{self.world_size} ranks of {bundle} within {_PLACEMENT_TIMEOUT_S:.0f} s "
                f"(it has {ray.cluster_resources()}); add machines or lower tensor_parallel_size"
            ) from None
        actor_cls = ray.remote(RayWorker)
        self._actors = [
            actor_cls.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self._placement, placement_group_bundle_index=rank
                ),
            ).remote()
            for rank in range(self.world_size)
        ]
        try:
            host, port = ray.get(self._actors[0].node_address.remote())
            init_method = f"tcp://{host}:{port}"
            self.pids = ray.get([actor.pid.remote() for actor in self._actors])
            logger.info("started %d tensor-parallel Ray actors (rendezvous %s)", self.world_size, init_method)
            self._gather([
                actor.start.remote(transport.dumps((config, rank, init_method)))
                for rank, actor in enumerate(self._actors)
            ])
        except BaseException:
            self.shutdown()
            raise

    def _call(self, payload: bytes) -> list[Any]:
        return self._gather([actor.call.remote(payload) for actor in self._actors])

    def shutdown(self) -> None:
        actors, self._actors = getattr(self, "_actors", []), []
        for actor in actors:
            self._ray.kill(actor)
        if getattr(self, "_placement", None) is not None:
            self._remove_placement_group(self._placement)
            self._placement = None

    def _gather(self, refs: list[Any]) -> list[Any]:
        """As ``MultiprocExecutor._gather``: every rank's reply, the ranks' common
        exception, or the executor dead (an actor died, or the ranks fell out of step)."""
        ray = self._ray
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        replies: dict[int, tuple[str, Any]] = {}
        pending, failed_at = list(refs), None
        while pending:
            timeout = None if failed_at is None else max(0.0, failed_at + DESYNC_TIMEOUT_S - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not ready:
                stuck = sorted(rank_of[ref] for ref in pending)
                self._die(f"tensor-parallel ranks {stuck} did not answer within {DESYNC_TIMEOUT_S:.0f} s of a "
                          "failure on another rank: the ranks are out of step")
            try:
                reply = transport.loads(ray.get(ready[0]))
            except ray.exceptions.RayActorError as e:
                rank, first_line = rank_of[ready[0]], str(e).strip().splitlines()[0]
                self._die(f"tensor-parallel rank {rank} (pid {self.pids[rank]}): its Ray actor died ({first_line})")
            replies[rank_of[ready[0]]] = reply
            if reply[0] == "error" and failed_at is None:
                failed_at = time.monotonic()
        return self._combine([replies[rank] for rank in range(len(refs))])
