"""The offline Python API, modelled on vLLM's: `LLM(...)` then `llm.generate(prompts, params)`."""

from __future__ import annotations

import atexit
import contextlib
import functools
import gc
import os
import time
from typing import Iterator, Sequence

import torch

import compiled.envs as envs
from compiled.errors import ConfigError
from compiled.json_file import read_json_object
from compiled.parallel.mesh import roles
from compiled.parallel.tensor import set_tp_group
from compiled.passes.variant import LORA
from compiled.runtime.build import artifact_manifest, build_models
from compiled.runtime.cp_messages import AddLora, KVSlots, RemoveLora, Stop
from compiled.runtime.engine import Engine
from compiled.lora.merged import MergedLoRA
from compiled.runtime.memory import num_kv_slots
from compiled.runtime.request import Request, RequestOutput
from compiled.runtime.settings import engine_settings
from compiled.runtime.sampling_params import SamplingParams
from compiled.runtime.tokenizer import Tokenizer, has_tokenizer, load_tokenizer

Prompt = str | list[int]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic garbage collection inside: start-up builds ~0.5M long-lived objects, and each
    full collection the growing heap sets off walks all of them (trace and passes of the 30B
    shape: 1.39 s with it, 0.90 s without, on a development CPU). `freeze_startup_heap` collects
    once after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_startup_heap() -> None:
    """Collect once, then move everything start-up left alive (the traced graph, compiled pieces,
    configs: ~0.5M objects for the 30B shape) out of the garbage collector's reach. A full
    collection walks them all (0.16 s on a development CPU), and one landing inside a step stalls
    the host, and a GPU waiting for its launches, that long; vLLM's engine core freezes its
    start-up heap for the same reason."""
    gc.collect()
    gc.freeze()
    _unfreeze_at_exit()


@functools.cache
def _unfreeze_at_exit() -> None:
    """Hand the frozen heap back to the collector when the interpreter exits. The collections
    Python runs at shutdown never look at frozen objects, so reference cycles through Triton's
    modules would outlive them, and Triton's nanobind extension (triton._C.libtriton) reports every
    type, function and instance of it still alive at exit: ~30 lines of "nanobind: leaked ..." on
    stderr after every run, whatever its outcome. atexit handlers run before those collections."""
    atexit.register(gc.unfreeze)


def release_frozen_heap() -> None:
    """Give the frozen start-up heaps back to the collector and collect: what frees an LLM that
    was dropped (its model and engine sit in reference cycles, which only the collector breaks)."""
    gc.unfreeze()
    gc.collect()


class LLM:
    """Loads a Qwen3 / Qwen3-MoE folder (or the shipped demo model when `model` is None).

    Every keyword argument is a field of `EngineConfig` (runtime/config.py), which holds each
    default; an unknown name is an error listing the valid ones. By default the model is traced
    and every graph pass runs (`passes` picks a list, `[]` none); `use_graph=False` runs the
    plain eager module instead. On CUDA the passed graph is compiled with Inductor (`compile=`);
    decode replays one CUDA graph per batch bucket and prefill or mixed batches one graph per
    compiled piece and token bucket (`piecewise_buckets`); `enforce_eager=True` turns all of that
    off. `artifact=DIR` loads compiled pieces written by `export_artifact` instead of compiling.
    `overlap_schedule` launches each decode step before the previous step's tokens are read back
    (see runtime/engine.py)."""

    def __init__(self, model: str | None = None, **kwargs) -> None:
        with collector_paused():
            self._start(model, kwargs)
        start = time.perf_counter()
        freeze_startup_heap()
        self.build_report.seconds["gc_freeze"] = time.perf_counter() - start

    def _start(self, model: str | None, kwargs: dict) -> None:
        envs.check_all()
        self.model_path, self.model_config, self.config = engine_settings(model, kwargs)
        tok_path = self.config.tokenizer or self.model_path
        self.tokenizer: Tokenizer | None = load_tokenizer(tok_path) if has_tokenizer(tok_path) else None
        eos_token_ids = self._eos_token_ids()  # before the (slow) build: a bad file fails fast
        # The context- or tensor-parallel group, while it runs.
        self._cp = self._join_cp_group(model, kwargs) if self.config.world_size > 1 else None
        try:
            tp, cp = (None, None) if self._cp is None else roles(
                self._cp, self.config.tensor_parallel_size, self.config.context_parallel_size, self.config.cp_timeout)
            models = build_models(self.model_config, self.model_path, self.config)
            self.model, self.build_report = models.base, models.report
            start = time.perf_counter()
            # The merge's weight copies before the KV cache takes what memory is left.
            merged = MergedLoRA(models.lora_buffers or models.graphs[LORA], self.model_config) \
                if self.config.merge_lora and LORA in models.graphs else None
            self.engine = Engine(models.runner_graphs, self.model_config, self.config,
                                 num_kv_slots(self.model_config, self.config), self.tokenizer, eos_token_ids,
                                 models.lora_buffers, merged)
            self.build_report.seconds["kv_cache"] = time.perf_counter() - start
            if self._cp is not None:
                self._cp.send(KVSlots(self.engine.kv.num_slots))
                if tp is not None:
                    self.engine.enable_tp(tp)
                if cp is not None:
                    self.engine.runner.enable_cp(cp, models.cp)
        except BaseException:
            self.shutdown()
            raise
        for name, path in (self.config.lora_modules or {}).items():
            self.load_lora(name, path)
        if self.config.use_cuda_graphs:
            from_artifact = self.config.artifact is not None and self.build_report.compiled_now == 0
            self.build_report.seconds.update(self.engine.capture_graphs(from_artifact))

    def _join_cp_group(self, model: str | None, kwargs: dict):
        """Rank 0 of the context- or tensor-parallel group: its workers spawned here, or, under
        torchrun, the ranks torchrun started (on whose ranks above 0 this serves as a worker, then
        exits)."""
        from compiled.parallel.group import init_group, spawn_workers, torchrun_rank
        from compiled.runtime import cp_worker
        world, device = self.config.world_size, self.config.device
        sizes = [name for name in ("tensor_parallel_size", "context_parallel_size") if getattr(self.config, name) > 1]
        size_name = " x ".join(f"{name}={getattr(self.config, name)}" for name in sizes)
        kind = {(True, False): "tensor-parallel", (False, True): "context-parallel",
                (True, True): "tensor- and context-parallel"}[(self.config.tp, self.config.cp)]
        backend = cp_worker.backend_for(device)
        launched = torchrun_rank()
        if launched is not None:
            rank, size = launched
            if size != world:
                raise ConfigError(f"{size_name} takes {world} processes but torchrun started {size}")
            if rank > 0:
                dev = cp_worker.worker_device(device, rank)
                if dev.type == "cuda":
                    torch.cuda.set_device(dev)
                cp_worker.serve_then_leave(init_group(rank, world, backend, self.config.cp_timeout, kind=kind),
                                           self.model_path, dict(kwargs, device=str(dev)))
            processes = []
        else:
            processes = spawn_workers(world, cp_worker.spawned_worker,
                                      (self.model_path, kwargs, str(device), self.config.cp_timeout, kind))
        group = init_group(0, world, backend, self.config.cp_timeout, processes, kind)
        atexit.register(self.shutdown)
        return group

    def shutdown(self) -> None:
        """Stop the context- or tensor-parallel workers (nothing to do without them); a
        context-parallel LLM then prefills on this process alone, a tensor-parallel one cannot
        run any more."""
        group, self._cp = self._cp, None
        if group is None:
            return
        engine = getattr(self, "engine", None)
        tp = engine.runner.tp if engine is not None else None
        if engine is not None:
            engine.runner.cp = None
            if tp is not None and engine.runner.tp_failure is None:
                # Before the group's communicators, which they hold (after a failure the GPU may still
                # wait on a peer: the teardown's bound covers that case instead).
                engine.runner.release_graphs()
                engine.runner.tp_failure = f"the tensor-parallel group of {group.world} was shut down"
        if self.config.tp:
            set_tp_group(None)
        group.shutdown(Stop())
        if tp is not None and tp is not group:   # a subgroup view (`mesh.py`): freed as the group is
            tp.data = tp.control = None
            gc.collect()

    @property
    def context_parallel(self) -> int:
        """The processes prefill is split over now: context_parallel_size, or 1 once the group
        stopped (`shutdown`, or a rank that failed)."""
        return 1 if self.engine.runner.cp is None else self.engine.runner.cp.group.world

    def _tell_workers(self, message: AddLora | RemoveLora) -> None:
        runner = self.engine.runner
        group = runner.cp.group if runner.cp is not None else runner.tp
        if group is not None:
            group.send(message)

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.model_config.eos_token_ids)
        gen_file = os.path.join(self.model_path, "generation_config.json")
        if os.path.exists(gen_file):
            gen = read_json_object(gen_file)
            eos = gen.get("eos_token_id")
            eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
            if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t for t in eos):
                raise ConfigError(f"{gen_file}: field 'eos_token_id' must be an int or a list of ints >= 0, "
                                  f"got {gen.get('eos_token_id')!r}")
            ids |= set(eos)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs come back in prompt order.
        `lora`: the adapter every prompt runs with, or one name (or None: the base model) per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        params = sampling_params if sampling_params is not None else SamplingParams()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif not isinstance(params, (list, tuple)):
            raise TypeError(f"sampling_params: expected a SamplingParams or a list of them (one per prompt), "
                            f"got {type(params).__name__}")
        elif len(params) != len(prompts):
            raise ValueError(f"got {len(params)} SamplingParams for {len(prompts)} prompts")
        adapters = _per_prompt(lora, len(prompts))
        # Validate everything before queueing anything.
        requests = [self.engine.make_request(i, p, sp, a)
                    for i, (p, sp, a) in enumerate(zip(prompts, params, adapters))]
        try:
            for request in requests:
                self.engine.add(request)
            self._run_to_completion(requests)
        except BaseException:
            # Interrupted (Ctrl-C, an error in a step): this call's requests must not outlive it,
            # holding KV slots and rows or running again inside the next call.
            for request in requests:
                self.engine.abort(request.id)
            raise
        return [r.to_output() for r in requests]

    def _run_to_completion(self, requests: list[Request]) -> None:
        pending = {r.id for r in requests}
        while pending:
            for request in self.engine.step():
                pending.discard(request.id)

    def chat(self, messages: str | Sequence[str],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             lora: str | Sequence[str | None] | None = None) -> list[RequestOutput]:
        """Like `generate`, with each prompt wrapped as one user turn by the chat template."""
        if self.tokenizer is None:
            raise ConfigError(f"{self.model_path}: no tokenizer, so no chat template")
        messages = [messages] if isinstance(messages, str) else list(messages)
        return self.generate([self.tokenizer.apply_chat_template(m) for m in messages], sampling_params, lora)

    @property
    def startup_seconds(self) -> dict[str, float]:
        """Seconds per start-up stage: trace, passes, load, inductor_import and artifact_load (from an
        artifact), split and compile (compiled paths), kv_cache, capture, gc_freeze."""
        return dict(self.build_report.seconds)

    def export_artifact(self, folder: str) -> None:
        """Write the compiled pieces, every Triton kernel in this process's cache folders and the
        manifest to `folder` (needs a compiled model). `compiled export` compiles into an empty
        Triton cache, so its artifact holds exactly the engine's kernels."""
        from compiled.compilation.artifact import save_artifact
        if not self.build_report.compiled:
            raise ConfigError("nothing to export: this LLM was not compiled (compile=True, not enforce_eager)")
        manifest = artifact_manifest(self.model_config, self.config)
        buckets = None
        if self.config.use_cuda_graphs:
            buckets = {"decode": self.engine.graph_buckets(), "piecewise": self.engine.piecewise_buckets()}
        save_artifact(folder, manifest, self.build_report.compiled, buckets, self.config.device)

    # ---- adapters ------------------------------------------------------------------------------

    def load_lora(self, name: str, path: str, pinned: bool = False) -> None:
        """Load the PEFT adapter at `path` under `name` into the CPU tier; requests name it in
        `generate(..., lora=)`. A pinned adapter is never evicted from the CPU tier."""
        self.add_lora(self.read_lora(name, path), pinned)

    def read_lora(self, name: str, path: str):
        """The PEFT adapter at `path`, read, checked against the model and packed for the CPU
        tier, but not yet served (`add_lora` serves it); touches no engine state, so it may run
        beside a step."""
        if self.engine.loras is None:
            raise ConfigError("LoRA is off: start the LLM with enable_lora=True (or lora_modules) to load adapters")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"adapter name {name!r}: expected a non-empty string")
        from compiled.lora.adapter import load_adapter
        adapter = load_adapter(name, path, self.model_config, self.config.max_lora_rank)
        # Tensor-parallel: the whole adapter, which `add_lora` cuts to this rank's share and sends whole to the others.
        return adapter if self.config.tp else self.engine.loras.prepare(adapter)

    def add_lora(self, adapter, pinned: bool = False) -> None:
        """Serve an adapter already in memory (`compiled.lora.Adapter`, e.g. `lora.random_adapter`);
        tensor-parallel, a whole one (not cut for a rank)."""
        if self.engine.loras is None:
            raise ConfigError("LoRA is off: start the LLM with enable_lora=True (or lora_modules) to load adapters")
        self.engine.loras.add(adapter, pinned, busy=frozenset(self.engine.adapters_in_use()))
        self._tell_workers(AddLora(adapter, pinned))

    def unload_lora(self, name: str) -> None:
        """Forget adapter `name`. Refused while a queued or running request uses it: those
        requests would otherwise run without it."""
        if self.engine.loras is None:
            raise ConfigError("LoRA is off: there is no adapter to unload")
        users = sum(r.lora == name for r in self.engine.live_requests())
        if users:
            raise ConfigError(f"adapter {name!r} is used by {users} queued or running requests: abort or finish "
                              "them first")
        self.engine.loras.remove(name)
        if self.engine.scheduler.cache is not None:   # its cached prefixes were computed with the old weights
            self.engine.scheduler.cache.drop(name)
        self._tell_workers(RemoveLora(name))

    @property
    def loras(self) -> list[str]:
        """The names of the loaded adapters."""
        return [] if self.engine.loras is None else list(self.engine.loras.adapters)


def _per_prompt(lora: str | Sequence[str | None] | None, n: int) -> list[str | None]:
    if lora is None or isinstance(lora, str):
        return [lora] * n
    lora = list(lora)
    if len(lora) != n:
        raise ValueError(f"got {len(lora)} adapter names in lora= for {n} prompts")
    return lora
