"""A context- or tensor-parallel worker: ranks 1..N-1 build the same model (or, tensor-parallel,
their shards of it) and KV cache as rank 0 and run the steps rank 0 sends them
(`context_parallel.py`, `tensor_parallel.py`; the messages in `cp_messages.py`), until it says
stop or the group fails.

Started by `LLM` (spawned) or by `torchrun` (every rank runs the user's script; on ranks above 0
`LLM(...)` serves here and exits the process when rank 0 stops)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable

import torch

from compiled.parallel.group import LEAVE_TIMEOUT_S, CPError, CPGroup, init_group, leave_group
from compiled.parallel.mesh import roles
from compiled.runtime.cp_messages import AddLora, KVSlots, RemoveLora, StepMessage, Stop, TPStep
from compiled.runtime.model_runner import select_rows
from compiled.runtime.tensor_parallel import point_rows, received_feed, worker_batch

log = logging.getLogger(__name__)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def worker_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after rank 0's (one GPU a rank), or the CPU."""
    if device.type != "cuda":
        return device
    first = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", (first + rank) % torch.cuda.device_count())


def spawned_worker(rank: int, world: int, model: str, kwargs: dict, device: str, timeout: float,
                   kind: str = "context-parallel") -> None:
    """The entry point of a worker process rank 0 spawned."""
    dev = worker_device(torch.device(device), rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        serve_then_leave(init_group(rank, world, backend_for(dev), timeout, kind=kind), model,
                         dict(kwargs, device=str(dev)))
    except (CPError, KeyboardInterrupt):
        exit_now(1)   # rank 0 is gone or stopping: skip the teardown of a half-closed group
    except Exception:
        log.exception("%s rank %d failed", kind, rank)
        exit_now(1)


def serve_then_leave(group: CPGroup, model: str, kwargs: dict) -> None:
    """`serve` until rank 0 says stop, leave the process group, as rank 0 does after sending it,
    and end the process: a worker spawned by `LLM` and one torchrun started end the same way."""
    serve(group, model, kwargs)
    leave_group(LEAVE_TIMEOUT_S)
    exit_now(0)


def exit_now(code: int) -> None:
    """End a worker without the interpreter's teardown: C++ threads of the process group (gloo's)
    destroyed at exit can abort it ("terminate called without an active exception") on a busy host."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(group: CPGroup, model: str, kwargs: dict) -> None:
    """Build the engine as rank 0 does, then run its messages until `Stop`."""
    from compiled.runtime.build import build_models
    from compiled.runtime.engine import Engine
    from compiled.runtime.settings import engine_settings
    path, mcfg, config = engine_settings(model, kwargs)
    tp, cp = roles(group, config.tensor_parallel_size, config.context_parallel_size, config.cp_timeout)
    models = build_models(mcfg, path, config, tp_rank=tp.rank if tp is not None else 0)
    sizes = group.receive()
    if not isinstance(sizes, KVSlots):
        raise CPError(f"{group.kind} worker {group.rank}: expected the KV cache's size first, got {sizes!r}")
    engine = Engine(models.runner_graphs, mcfg, config, sizes.num_slots, None, set(), models.lora_buffers)
    if tp is not None:
        engine.enable_tp(tp)
        if config.use_cuda_graphs:   # as rank 0 does: the captures' forwards all-reduce together
            engine.capture_graphs(config.artifact is not None and models.report.compiled_now == 0)
    if cp is not None:
        engine.runner.enable_cp(cp, models.cp)
    worker = _Worker(engine, group)
    while worker.serving:
        message = group.receive()
        handler = worker.handlers.get(type(message))
        if handler is None:
            raise CPError(f"{group.kind} worker {group.rank}: unknown message {type(message).__name__}")
        handler(message)
    if tp is not None:   # its graphs hold the communicators the group's teardown frees next
        engine.runner.release_graphs()


class _Worker:
    """What a worker does with each of rank 0's messages, by type."""

    def __init__(self, engine, group: CPGroup) -> None:
        self.engine, self.group, self.serving = engine, group, True
        self.handlers: dict[type, Callable] = {StepMessage: self._step, TPStep: self._tp_step, AddLora: self._add_lora,
                                               RemoveLora: self._remove_lora, Stop: self._stop}

    def _step(self, message: StepMessage) -> None:
        runner = self.engine.runner
        for slot, name in message.adapters.items():
            self.engine.loras.place(name, slot)
        point_rows(self.engine.req_pool.table, message.table_writes)
        hidden = runner.cp.run(message.chunks)
        if runner.tp is not None and runner.cp.group.rank == 0:
            # rank 0's tensor-parallel group: the logits rank 0 computes next gather every shard's
            if message.sample_rows:
                runner.logits(select_rows(hidden, message.sample_rows))
            for start, stop in message.logit_rows:
                runner.logits(hidden[start:stop])

    def _tp_step(self, message: TPStep) -> None:
        runner = self.engine.runner
        if runner.cp is not None and runner.cp.group.rank > 0:
            return   # a step that does not split runs on rank 0's tensor-parallel group alone
        for slot, name in message.adapters.items():
            self.engine.loras.place(name, slot)
        point_rows(self.engine.req_pool.table, message.table_writes)
        feed = received_feed(runner.tp, message, self.engine.cfg.device)
        out = runner.forward(worker_batch(message), message.sample_rows, feed)
        for start, stop in message.logit_rows:   # rank 0's prompt logprobs: the head gathers every shard's
            runner.logits(out.hidden[start:stop])

    def _add_lora(self, message: AddLora) -> None:
        self.engine.loras.add(message.adapter, message.pinned)

    def _remove_lora(self, message: RemoveLora) -> None:
        self.engine.loras.remove(message.name)

    def _stop(self, _: Stop) -> None:
        self.serving = False


