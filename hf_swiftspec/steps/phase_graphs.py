"""Replayed phases: a whole phase of the device round (the draft's growth and selection; the verification, walk
and both caches' commits) captured once per shape as one graph and replayed with its live inputs copied in.

capture.py's StepRunner replays one forward over a TreeCache; a phase is bigger (d draft forwards, or a forward
and everything after it up to the round's one read), so it is captured as a function of named tensors:
`PhaseRunner.run(key, phase, inputs)` copies `inputs` into the static tensors the graph was captured over and
replays it. Everything else the phase reads (Python ints, the models, the caches' buffers) is part of the graph,
so the key must name it: the caller's key names the static values and the buffers' addresses, and the runner adds
its inputs' shapes and dtypes (a copy into a static input of another shape would fail at replay).

Backends (capture.py's, for the same SwiftSpecConfig.capture):
  "cuda"     torch.cuda.CUDAGraph per key. The first run is an eager run on a side stream (the round's real run:
             phases write the caches in place, so they may run once only) followed by the capture, which records
             without running; its static outputs get the eager run's values.
  "emulate"  CPU, for tests: capturing runs the phase once over the static inputs and keeps that call; a replay
             makes the same call again, so a value the phase took from the host at capture instead of from its
             inputs stays the capture's, and gives wrong tokens instead of passing unnoticed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

Tensors = dict[str, torch.Tensor]


@dataclass
class PhaseGraph:
    """One captured phase: its static inputs, the call over them and its static outputs (overwritten by each replay).

    inputs:  {name: tensor} static copies of what changes between rounds
    outputs: {name: tensor} the phase's outputs, at fixed addresses
    """

    inputs: Tensors
    outputs: Tensors
    call: Callable[[], Tensors]
    graph: object = None
    replays: int = 0


@dataclass
class PhaseRunner:
    """One call's replayed phases, by key (module docstring). fallbacks: why phases ran eagerly instead."""

    backend: str
    graphs: dict[tuple, PhaseGraph] = field(default_factory=dict)
    refused: dict[tuple, str] = field(default_factory=dict)
    fallbacks: set[str] = field(default_factory=set)
    memory_pool: object = None
    setup_s: float = 0.0  # seconds of first runs that captured
    captured: int = 0  # phases captured (a graph dropped later still counts)

    def run(self, key: tuple, phase: Callable[..., Tensors], inputs: Tensors) -> Tensors:
        """phase(**inputs), replayed from the key's graph (captured by this first run). The outputs are the graph's
        static tensors: clone what must outlive the next replay of this key."""
        key = (tuple((name, tuple(t.shape), t.dtype) for name, t in inputs.items()), *key)
        graph = self.graphs.get(key)
        if graph is None:
            if key in self.refused:
                self.fallbacks.add(self.refused[key])
                return phase(**inputs)
            start = time.perf_counter()
            self.captured += 1
            try:
                return self.capture(key, phase, inputs)
            finally:
                self.setup_s += time.perf_counter() - start
        for name, tensor in inputs.items():
            graph.inputs[name].copy_(tensor)
        graph.replays += 1
        if self.backend == "cuda":
            graph.graph.replay()
        else:
            for name, tensor in graph.call().items():
                graph.outputs[name].copy_(tensor)
        return graph.outputs

    def capture(self, key: tuple, phase: Callable[..., Tensors], inputs: Tensors) -> Tensors:
        """The key's first run, which captures its graph (module docstring); its outputs."""
        static = {name: tensor.clone() for name, tensor in inputs.items()}

        def call() -> Tensors:
            return phase(**static)

        if self.backend != "cuda":
            outputs = call()
            self.graphs[key] = PhaseGraph(static, outputs, call)
            return outputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ran = call()  # the round's own run
        torch.cuda.current_stream().wait_stream(side)
        if self.memory_pool is None:
            self.memory_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.memory_pool, capture_error_mode="thread_local"):
                outputs = call()  # recorded, not run
        except Exception as error:  # noqa: BLE001  (any failure: this key runs eagerly from now on, and says why)
            torch.cuda.synchronize()
            self.refused[key] = f"phase capture failed ({type(error).__name__}: {str(error).splitlines()[0][:120]})"
            self.fallbacks.add(self.refused[key])
            return ran
        for name, tensor in ran.items():
            outputs[name].copy_(tensor)
        self.graphs[key] = PhaseGraph(static, outputs, call, graph)
        return outputs

    @property
    def replays(self) -> int:
        return sum(g.replays for g in self.graphs.values())
