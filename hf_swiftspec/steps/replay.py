"""The runner that captures a call once and replays it: what the host round's replayed steps (capture.py's
StepRunner, one forward over a TreeCache) and the device round's replayed phases (phase_graphs.py's PhaseRunner,
a phase over named tensors) share, as SGLang's draft runner extends its one CudaGraphRunner.

A replayed call reads fixed addresses: its live inputs are copied into static tensors before each replay, and its
outputs are static tensors the next replay overwrites. A runner keeps one `Replay` per key (the key names every
shape and every address the call bakes in), shares one CUDA memory pool across them, captures a key the first time
it runs, and runs a key whose capture failed eagerly from then on, with the reason in `fallbacks`.

Backends (capture.capture_backend, for SwiftSpecConfig.capture):
  "cuda"     torch.cuda.CUDAGraph per key: the call runs once on a side stream (the warm-up: the first run's
             outputs, and what a call that may run only once returns), then is recorded in the runner's pool.
  "emulate"  CPU, for tests: a stand-in with a graph's semantics. Capturing runs the call once over the static
             inputs and keeps it; a replay makes the same call again and copies its outputs into the static ones, so a
             value the call took from the host at capture instead of from its inputs stays the capture's, and gives
             wrong tokens instead of passing unnoticed.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

Tensors = dict[str, torch.Tensor]


@dataclass
class Replay:
    """One captured call.

    inputs:  {name: tensor} static copies of what changes between runs, which the call reads
    outputs: {name: tensor} the call's outputs at fixed addresses, overwritten by each replay
    call:    the captured call (the "emulate" backend runs it again to replay)
    graph:   the CUDA graph ("cuda"), else None
    """

    inputs: Tensors
    outputs: Tensors = field(default_factory=dict)
    call: Callable[..., Tensors] | None = None
    graph: object = None
    replays: int = 0

    def load(self, live: Tensors) -> None:
        """Copy the live inputs into the static ones."""
        for name, tensor in live.items():
            self.inputs[name].copy_(tensor)


@dataclass
class ReplayRunner:
    """Replays by key (module docstring). refused: why a key's capture failed (it then runs eagerly, the reason added
    to fallbacks); setup_s: seconds spent on first runs that captured (not what a run costs: the goodput policy prices
    nothing by a round that paid some); captured: first runs that captured (a capture that failed, and a graph dropped
    later, still count: a round whose count grew paid a capture)."""

    backend: str
    graphs: dict[tuple, Replay] = field(default_factory=dict)
    refused: dict[tuple, str] = field(default_factory=dict)
    fallbacks: set[str] = field(default_factory=set)
    memory_pool: object = None
    setup_s: float = 0.0
    captured: int = 0

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.graphs.values())

    def refusal(self, key: tuple) -> str | None:
        """Why `key` runs eagerly (noted in fallbacks), or None: it replays, or captures now."""
        reason = self.refused.get(key)
        if reason is not None:
            self.fallbacks.add(reason)
        return reason

    def refuse(self, key: tuple, what: str, error: Exception) -> None:
        """`key`'s capture failed: it runs eagerly from now on, saying why."""
        self.refused[key] = f"{what} failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
        if self.backend == "cuda":
            torch.cuda.synchronize()

    def keep(self, key: tuple, replay: Replay) -> Replay:
        self.graphs[key] = replay
        return replay

    @contextlib.contextmanager
    def setting_up(self):
        """A first run that captures (or first compiles): counted, its time added to setup_s."""
        self.captured += 1
        start = time.perf_counter()
        try:
            yield
        finally:
            self.setup_s += time.perf_counter() - start

    def warm_up(self, call: Callable[[], Tensors]) -> Tensors:
        """call() once on a side stream ("cuda"), before its capture: its outputs."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ran = call()
        torch.cuda.current_stream().wait_stream(side)
        return ran

    def record(self, call: Callable[[], Tensors]) -> tuple[torch.cuda.CUDAGraph, Tensors]:
        """(graph, its static outputs) of call(), recorded in the runner's memory pool, not run."""
        if self.memory_pool is None:
            self.memory_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the asynchronous engine's other worker (a thread, or a thread waiting on a message) keeps
        # launching and syncing on its own stream meanwhile; only this thread's calls could break this capture
        with torch.cuda.graph(graph, pool=self.memory_pool, capture_error_mode="thread_local"):
            out = call()
        return graph, out

    def replay(self, replay: Replay, *live) -> Tensors:
        """Run a captured call again over its static inputs; its static outputs. live: what the emulated call takes
        besides (capture.py's: the live cache and tap)."""
        replay.replays += 1
        if replay.graph is not None:
            replay.graph.replay()
        else:
            for name, tensor in replay.call(*live).items():
                replay.outputs[name].copy_(tensor)
        return replay.outputs
