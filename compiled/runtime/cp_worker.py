"""A context-parallel worker: ranks 1..N-1 build the same model and KV cache as rank 0 and run
the steps rank 0 sends them (`context_parallel.py`), until it says stop or the group fails.

Started by `LLM` (spawned) or by `torchrun` (every rank runs the user's script; on ranks above 0
`LLM(...)` serves here and exits the process when rank 0 stops)."""

from __future__ import annotations

import logging
import os

import torch

from compiled.parallel.group import CPError, CPGroup, init_group

log = logging.getLogger(__name__)

STOP = ("stop",)


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def worker_device(device: torch.device, rank: int) -> torch.device:
    """Rank r's device: the r-th GPU after rank 0's (one GPU a rank), or the CPU."""
    if device.type != "cuda":
        return device
    first = device.index if device.index is not None else torch.cuda.current_device()
    return torch.device("cuda", (first + rank) % torch.cuda.device_count())


def spawned_worker(rank: int, world: int, model: str, kwargs: dict, device: str, timeout: float) -> None:
    """The entry point of a worker process rank 0 spawned."""
    dev = worker_device(torch.device(device), rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        serve_then_leave(init_group(rank, world, backend_for(dev), timeout), model, dict(kwargs, device=str(dev)))
    except (CPError, KeyboardInterrupt):
        os._exit(1)   # rank 0 is gone or stopping: skip the teardown of a half-closed group
    except Exception:
        log.exception("context-parallel rank %d failed", rank)
        os._exit(1)


def serve_then_leave(group: CPGroup, model: str, kwargs: dict) -> None:
    """`serve` until rank 0 says stop, then leave the process group, as rank 0 does after sending
    it: a worker spawned by `LLM` and one torchrun started end the same way."""
    import torch.distributed as dist
    serve(group, model, kwargs)
    dist.destroy_process_group()


def serve(group: CPGroup, model: str, kwargs: dict) -> None:
    """Build the engine as rank 0 does, then run its messages until "stop"."""
    from compiled.runtime.build import build_models
    from compiled.runtime.engine import Engine
    from compiled.runtime.settings import engine_settings
    path, mcfg, config = engine_settings(model, kwargs)
    models = build_models(mcfg, path, config)
    kind, slots = group.receive()
    assert kind == "kv_slots", kind
    engine = Engine(models.runner_graphs, mcfg, config, slots, None, set(), models.lora_buffers)
    engine.runner.enable_cp(group, models.cp)
    while True:
        message = group.receive()
        kind = message[0]
        if kind == "step":
            step = message[1]
            for slot, name in step.adapters.items():
                engine.loras.place(name, slot)
            engine.runner.cp.run(step.chunks)
        elif kind == "add_lora":
            engine.loras.add(message[1], message[2])
        elif kind == "remove_lora":
            engine.loras.remove(message[1])
        elif kind == "stop":
            return
        else:
            raise CPError(f"context-parallel worker {group.rank}: unknown message {kind!r}")
