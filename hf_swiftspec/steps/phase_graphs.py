"""Replayed phases: a whole phase of the device round (the draft's growth and selection; the verification, walk
and both caches' commits) captured once per shape as one graph and replayed with its live inputs copied in.

capture.py's StepRunner replays one forward over a TreeCache; a phase is bigger (d draft forwards, or a forward
and everything after it up to the round's one read), so it is captured as a function of named tensors:
`PhaseRunner.run(key, phase, inputs)` copies `inputs` into the static tensors the graph was captured over and
replays it. Everything else the phase reads (Python ints, the models, the caches' buffers) is part of the graph,
so the key must name it: the caller's key names the static values and the buffers' addresses, and the runner adds
its inputs' shapes and dtypes (a copy into a static input of another shape would fail at replay).

Both runners are replay.py's ReplayRunner (static inputs, one memory pool, the capture after a warm-up on a side
stream, the "emulate" backend, a refused key run eagerly with its reason). What is a phase's own: it writes the
caches in place, so it may run once only: on CUDA the warm-up is the round's real run and the capture records
without running (its static outputs get the warm-up's values); a capture that fails keeps the warm-up's outputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from .replay import Replay, ReplayRunner, Tensors


@dataclass
class PhaseRunner(ReplayRunner):
    """One call's replayed phases, by key (module docstring): `graphs` holds a Replay per key (its static inputs, the
    phase over them and its static outputs). fallbacks: why phases ran eagerly instead. The "compiled" backend (a CPU
    with compile=True: no graph) runs every phase as it is, its decoder layers compiled by the caller; a key's first
    run compiles them for its shapes and counts as setup (`ran`: the keys run so far)."""

    ran: set = field(default_factory=set)

    def run(self, key: tuple, phase: Callable[..., Tensors], inputs: Tensors) -> Tensors:
        """phase(**inputs), replayed from the key's graph (captured by this first run). The outputs are the graph's
        static tensors: clone what must outlive the next replay of this key."""
        key = (tuple((name, tuple(t.shape), t.dtype) for name, t in inputs.items()), *key)
        if self.backend == "compiled":
            if key in self.ran:
                return phase(**inputs)
            self.ran.add(key)
            with self.setting_up():
                return phase(**inputs)
        graph = self.graphs.get(key)
        if graph is not None:
            graph.load(inputs)
            return self.replay(graph)
        if self.refusal(key) is not None:
            return phase(**inputs)
        with self.setting_up():
            return self.capture(key, phase, inputs)

    def capture(self, key: tuple, phase: Callable[..., Tensors], inputs: Tensors) -> Tensors:
        """The key's first run, which captures its graph (module docstring); its outputs."""
        graph = Replay({name: tensor.clone() for name, tensor in inputs.items()})
        graph.call = lambda: phase(**graph.inputs)
        if self.backend != "cuda":
            graph.outputs = graph.call()
            return self.keep(key, graph).outputs
        ran = self.warm_up(graph.call)  # the round's own run
        try:
            graph.graph, graph.outputs = self.record(graph.call)
        except Exception as error:  # noqa: BLE001  (any failure: this key runs eagerly from now on, and says why)
            self.refuse(key, "phase capture", error)
            self.refusal(key)
            return ran
        for name, tensor in ran.items():
            graph.outputs[name].copy_(tensor)
        return self.keep(key, graph).outputs
