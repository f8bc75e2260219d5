"""The process group of context or tensor parallelism: rank 0 (the user's process) and its
workers, each on its own device (holding the whole model, or its shards of it).

Rank 0 starts the workers itself (`spawn_workers`, torch.multiprocessing with the spawn method)
or, under `torchrun` (WORLD_SIZE set), every rank is started for it. Tensors travel on the data
group (NCCL on GPUs, gloo on CPU); rank 0's messages (a step to run, an adapter to load) on a
gloo control group. A collective that fails or outlasts `timeout` (a rank died or hangs) is a
`CPError`; rank 0 then shuts the group down, terminating every worker it started. The workers'
start (their imports) is bounded by START_TIMEOUT_S instead, a worker that exits first failing it
at once (`_started_store`). Leaving is bounded too (`leave_group`)."""

from __future__ import annotations

import contextlib
import datetime
import gc
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch.distributed as dist
import torch.multiprocessing as mp

import compiled.envs as envs
from compiled.errors import CompiledError


class CPError(CompiledError, RuntimeError):
    """A context- or tensor-parallel rank died, hung or failed."""


# Spawned workers join once they have imported torch and this package: tens of seconds on a
# loaded machine. That wait is bounded here, not by the group's timeout (how long a rank may take
# to answer), so that a short timeout does not fail a slow start; a worker that exits first ends
# it at once.
START_TIMEOUT_S = 300.0
START_POLL_S = 0.05
# How long a rank waits for the process group's teardown (NCCL's waits for every rank of the host
# and for every CUDA graph that captured one of its collectives).
LEAVE_TIMEOUT_S = 30.0

# NVLink multicast stays off for the group's NCCL collectives (the machines it runs on forbid it).
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def torchrun_rank() -> tuple[int, int] | None:
    """(rank, world size) when `torchrun` started this process, else None."""
    rank, world = envs.read("RANK"), envs.read("WORLD_SIZE")
    return None if rank is None or world is None else (rank, world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_workers(world: int, target, args: tuple) -> list:
    """Start ranks 1..world-1 as `target(rank, world, *args)` in fresh processes, with the
    rendezvous address in the environment they inherit (and this process's)."""
    envs.set_for_children("MASTER_ADDR", "127.0.0.1")
    envs.set_for_children("MASTER_PORT", str(_free_port()))
    ctx = mp.get_context("spawn")
    processes = []
    for rank in range(1, world):
        p = ctx.Process(target=target, args=(rank, world, *args), daemon=True, name=f"compiled-cp-rank{rank}")
        p.start()
        processes.append(p)
    return processes


@dataclass
class CPGroup:
    rank: int
    world: int
    data: dist.ProcessGroup | None       # None once shut down
    control: dist.ProcessGroup | None
    processes: list = field(default_factory=list)   # the workers rank 0 started
    kind: str = "context-parallel"                  # or "tensor-parallel": named in errors
    # The whole group this one is a subgroup of (`mesh.py`): its rank 0 schedules, its errors are named.
    parent: CPGroup | None = None

    @property
    def schedules(self) -> bool:
        """Whether this process is rank 0 of the whole group, which schedules and sends every step."""
        return (self.parent or self).rank == 0

    def send(self, message) -> None:
        """Rank 0: hand `message` to every worker."""
        self._call(dist.broadcast_object_list, [message], src=0, group=self.control)

    def receive(self):
        """A worker: the next message of rank 0."""
        box = [None]
        self._call(dist.broadcast_object_list, box, src=0, group=self.control)
        return box[0]

    def _call(self, fn, *args, **kwargs):
        with self.collectives():
            return fn(*args, **kwargs)

    @contextlib.contextmanager
    def collectives(self) -> Iterator[None]:
        """Collectives inside fail as one-line CPErrors: gloo and NCCL report a dead or stuck peer
        as errors of their own (a closed connection, a timeout)."""
        try:
            yield
        except CPError:
            raise
        except RuntimeError as e:
            if not (isinstance(e, dist.DistError) or self.dead_workers() or _from_backend(e)):
                raise
            whole = self.parent or self
            raise CPError(f"{whole.kind} group of {whole.world}: {self.describe_failure(e)}") from None

    def dead_workers(self) -> list[str]:
        return [f"rank {i + 1} exited with code {p.exitcode}" for i, p in enumerate(self.processes)
                if p.exitcode is not None]

    def describe_failure(self, error: BaseException) -> str:
        dead = self.dead_workers()
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        return ", ".join(dead) if dead else f"a collective failed or timed out ({first[:160]})"

    def shutdown(self, stop_message=None) -> None:
        """Rank 0: ask the workers to stop (when they can still hear it), leave the process group
        while they leave it, then make sure every one of them exits."""
        if stop_message is not None and all(p.exitcode is None for p in self.processes):
            try:
                self.send(stop_message)
            except CPError:
                pass
        if dist.is_initialized():
            leave_group(LEAVE_TIMEOUT_S)
        for p in self.processes:
            p.join(timeout=5)
        for p in self.processes:
            if p.exitcode is None:
                p.kill()
                p.join(timeout=5)
        # Free the groups now, while the interpreter is whole: a gloo group still alive at
        # interpreter exit (this object held it) joins its worker threads during finalization,
        # which can abort the process ("terminate called without an active exception").
        self.data = self.control = None
        gc.collect()


def leave_group(timeout: float) -> None:
    """Destroy the process groups. NCCL frees a communicator together with the other ranks of the
    host: rank 0 leaves as the workers do (after its stop message, not after they exited, which
    would wait for them forever); a peer that died cannot take part, so the wait is bounded and a
    teardown still stuck after `timeout` is left to the process's exit."""
    leaving = threading.Thread(target=dist.destroy_process_group, name="leave-group", daemon=True)
    leaving.start()
    leaving.join(timeout)


def _from_backend(error: BaseException) -> bool:
    text = str(error).lower()
    return any(word in text for word in ("gloo", "nccl", "connection", "timed out", "timeout", "peer"))


def _started_store(rank: int, world: int, processes: list, kind: str) -> dist.TCPStore:
    """The rendezvous store of a group whose workers rank 0 spawned (hosted by rank 0 at
    MASTER_ADDR:MASTER_PORT): each worker marks itself started; rank 0 returns once all have,
    and fails at once, naming the rank, if one exits first (START_TIMEOUT_S bounds the wait)."""
    start = datetime.timedelta(seconds=START_TIMEOUT_S)
    store = dist.TCPStore(envs.read("MASTER_ADDR"), envs.read("MASTER_PORT"), world, is_master=rank == 0,
                          timeout=start, wait_for_workers=False)
    if rank > 0:
        store.set(f"started/{rank}", "1")
        return store
    keys = [f"started/{r}" for r in range(1, world)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.check(keys):
        failure = next((f"{kind} rank {r} exited with code {p.exitcode} before joining the group"
                        for r, p in enumerate(processes, start=1) if not p.is_alive()), None)
        if failure is None and time.monotonic() > deadline:
            failure = f"{kind} group: not every rank started within {START_TIMEOUT_S:g} s"
        if failure is not None:
            for p in processes:   # the others would wait for the group in vain
                if p.is_alive():
                    p.terminate()
            raise CPError(failure)
        time.sleep(START_POLL_S)
    return store


def init_group(rank: int, world: int, backend: str, timeout: float, processes: list | None = None,
               kind: str = "context-parallel") -> CPGroup:
    """Join the group (MASTER_ADDR / MASTER_PORT from the environment)."""
    # Imported before the group exists: its functions take `group=WORLD` as a default argument,
    # which, bound after (torch.compile imports it), would keep the group alive until the
    # interpreter's finalization, whose teardown of a gloo group can abort the process.
    import torch.distributed.nn  # noqa: F401
    delta = datetime.timedelta(seconds=timeout)
    if backend == "nccl":
        for name, value in MULTICAST_OFF.items():
            if not envs.is_set(name):
                envs.set_for_children(name, value)
    if torchrun_rank() is None:
        store = _started_store(rank, world, processes or [], kind)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=delta)
    else:   # torchrun's ranks start together, at its rendezvous
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=delta)
    control = dist.group.WORLD if backend == "gloo" else dist.new_group(backend="gloo", timeout=delta)
    return CPGroup(rank, world, dist.group.WORLD, control, list(processes or []), kind)
