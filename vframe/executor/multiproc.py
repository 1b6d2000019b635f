"""``distributed_executor_backend="mp"``: one worker process per tensor-parallel
rank on this machine (the default at ``tensor_parallel_size > 1``).

    engine (driver)  --pipe-->  worker rank 0  <--gloo/NCCL all-reduce-->  worker rank 1 ...
                     <--rank 0's output--

The driver keeps the scheduler and the KV cache manager; every step it sends
the scheduler output to each rank over that rank's ``multiprocessing`` pipe
and waits for the replies, watching every worker's process (a pidfd) at the same
time, so a worker that dies (killed, out of memory, a crash in C++) is seen at
once. The ranks exchange activations through torch.distributed only.

Workers are fresh interpreters (``python -m vframe.executor.multiproc``), not
forks (a forked copy of a process with OpenMP or CUDA threads is not safe) and
not ``multiprocessing`` spawns (which re-run the user's main script, so a script
without an ``if __name__ == "__main__"`` guard would start engines recursively).
They rendezvous through a file in a private temporary directory (no port to
pick or leak), and exit by themselves when the driver goes away (their pipe
reaches end of file).
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from typing import Any

from vframe.core.config import EngineConfig
from vframe.executor import transport
from vframe.executor.remote import DESYNC_TIMEOUT_S, RemoteRanksExecutor
from vframe.executor.worker import describe, error_reply

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 5.0


class MultiprocExecutor(RemoteRanksExecutor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._tmpdir = tempfile.mkdtemp(prefix="vframe-tp-")
        init_method = f"file://{os.path.join(self._tmpdir, 'rendezvous')}"
        self._procs: list[subprocess.Popen[bytes]] = []
        self._conns: list[multiprocessing.connection.Connection] = []
        self._sentinels: list[int] = []  # pidfds: readable once the process has exited
        for rank in range(self.world_size):
            parent_end, child_end = multiprocessing.Pipe()
            proc = subprocess.Popen(
                self.worker_command(rank, child_end.fileno()), pass_fds=[child_end.fileno()], stdin=subprocess.DEVNULL
            )
            child_end.close()
            self._procs.append(proc)
            self._conns.append(parent_end)
            self._sentinels.append(os.pidfd_open(proc.pid))
            parent_end.send_bytes(transport.dumps((config, rank, init_method)))
        self.pids = [proc.pid for proc in self._procs]
        # Runs on shutdown(), on garbage collection and at interpreter exit, whichever comes first.
        self._finalizer = weakref.finalize(
            self, _stop_workers, self._procs, self._conns, self._sentinels, self._tmpdir
        )
        logger.info("started %d tensor-parallel workers: pids %s", self.world_size, self.pids)
        try:
            self._gather()  # each rank reports it joined the group and built its runner
        except BaseException:
            self.shutdown()
            raise

    # ------------------------------------------------------------------ #

    def _call(self, payload: bytes) -> list[Any]:
        for rank, conn in enumerate(self._conns):
            try:
                conn.send_bytes(payload)
            except OSError:
                self._die(self._exit_message(rank) or f"the pipe to tensor-parallel rank {rank} is closed")
        return self._gather()

    def worker_command(self, rank: int, fd: int) -> list[str]:
        """The command that starts rank ``rank``'s worker, which talks to the driver
        over the inherited file descriptor ``fd``. A subclass may wrap it (pin each
        rank to its cores or NUMA node with ``taskset`` / ``numactl``, say)."""
        return [sys.executable, "-m", "vframe.executor.multiproc", str(fd)]

    def shutdown(self) -> None:
        self._finalizer()

    # ------------------------------------------------------------------ #

    def _gather(self) -> list[Any]:
        """Every rank's reply, in rank order. All succeeded: their results. All
        failed alike: rank 0's exception, raised here. A rank died, or some
        failed while others succeeded: the executor is dead."""
        replies: dict[int, tuple[str, Any]] = {}
        failed_at: float | None = None
        while len(replies) < self.world_size:
            waiting = [r for r in range(self.world_size) if r not in replies]
            pending = {self._conns[r]: r for r in waiting}
            sentinels = {self._sentinels[r]: r for r in waiting}
            timeout = None if failed_at is None else max(0.0, failed_at + DESYNC_TIMEOUT_S - time.monotonic())
            ready = multiprocessing.connection.wait([*pending, *sentinels], timeout)
            for conn in [c for c in ready if c in pending]:
                rank = pending[conn]
                try:
                    data = conn.recv_bytes()
                except (EOFError, OSError):
                    continue  # the sentinel says why
                replies[rank] = transport.loads(data)
                if replies[rank][0] == "error" and failed_at is None:
                    failed_at = time.monotonic()
            for rank in sorted(r for s, r in sentinels.items() if s in ready and r not in replies):
                self._die(self._exit_message(rank) or f"tensor-parallel rank {rank} closed its pipe")
            if not ready and failed_at is not None:
                rank, (_, error) = next((r, v) for r, v in sorted(replies.items()) if v[0] == "error")
                stuck = sorted(set(range(self.world_size)) - replies.keys())
                self._die(
                    f"tensor-parallel rank {rank} failed ({describe(error)}) while ranks {stuck} did not answer "
                    f"within {DESYNC_TIMEOUT_S:.0f} s: the ranks are out of step"
                )
        return self._combine([replies[rank] for rank in range(self.world_size)])

    def _exit_message(self, rank: int) -> str | None:
        proc = self._procs[rank]
        try:
            code = proc.wait(0.5)  # the pipe may close just before the exit
        except subprocess.TimeoutExpired:
            return None
        how = f"was killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"


def _stop_workers(
    procs: list[subprocess.Popen[bytes]],
    conns: list[multiprocessing.connection.Connection],
    sentinels: list[int],
    tmpdir: str,
) -> None:
    """Ask each worker to exit, then terminate and kill what is left."""
    for conn in conns:
        try:
            conn.send_bytes(transport.dumps(("shutdown", ())))
        except OSError:
            pass
    deadline = time.monotonic() + _JOIN_TIMEOUT_S
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                proc.wait(1.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for conn in conns:
        conn.close()
    for fd in sentinels:
        os.close(fd)
    sentinels.clear()
    shutil.rmtree(tmpdir, ignore_errors=True)


# --------------------------------------------------------------------------- #
# the worker process
# --------------------------------------------------------------------------- #


def _worker_main(conn: multiprocessing.connection.Connection) -> None:
    # Ctrl-C reaches the whole process group: the driver decides, and stops us.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from vframe.executor.worker import start_rank

    try:
        config, rank, init_method = transport.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return  # the driver is gone already
    try:
        worker = start_rank(config, rank, init_method, local_rank=rank)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, which fails the engine's start
        conn.send_bytes(error_reply(e))
        return
    conn.send_bytes(transport.dumps(("ok", None)))
    while True:
        try:
            method, args = transport.loads(conn.recv_bytes())
        except (EOFError, OSError):
            break  # the driver is gone
        if method == "shutdown":
            break
        try:
            reply = transport.dumps(("ok", worker.call(method, args)))
        except BaseException as e:  # noqa: BLE001 - the driver decides what a failure means
            reply = error_reply(e)
        try:
            conn.send_bytes(reply)
        except OSError:
            break  # the driver is gone
    from vframe.distributed.parallel_state import destroy_tensor_parallel

    destroy_tensor_parallel()


if __name__ == "__main__":  # a worker: python -m vframe.executor.multiproc FD
    _worker_main(multiprocessing.connection.Connection(int(sys.argv[1])))
