"""The runtime's hop between two groups' calls, measured through the runtime's own call path.

A step of the Ray backend is a chain of calls on different groups, each started by the driver once it has the
one before (``RayBackend.run_step``): an encoder's forward, its ``emit`` queued behind it, the language model's
``forward_backward`` on the emitted refs, its ``emit_grads``, the encoder's backward on those. Between one call's
end on a worker and the next one's start on another, the runtime pays: the result back to the driver, the
driver's ``Pending.get`` / ``wait_tensors`` over every rank's ref, the next call's submission per rank with the
refs as arguments, their resolution on the receiving workers. A no-op actor call's round trip from an idle
driver is a fraction of that: on the 2-core CPU machine, 0.46 ms against 2-4 ms between the spans of a real
collocated step's trace (2026-12-06).

``measure_hop`` times that chain as the backend runs it: two ``WorkerGroup`` s of ``ranks`` actors each (the
runtime's class, dispatch and data plane), a call on the first and its ``emit`` submitted together, then the
second group's call on the emitted refs, then back. The hop is the time from the producing group's last rank's end
to the consuming group's last rank's start, as the workers' own clocks (``time.time()``, one clock per machine)
stamp them; its median over the chain's hops is the profile's ``actor_call_s``, what the step replay
(``dhp.plan.schedule``) charges per call: half on its submission, half on its result. ``calibrate`` also times it
with every core of a CPU host busy (``busy_call_s``): there the driver competes for the cores with the workers.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from dhp.runtime.dispatch import Collect, Split, dispatch, produces_tensors
from dhp.runtime.worker_base import WorkerBase

HOP_BYTES = 2**16  # a router piece of the demo's size (a few hundred rows of embeddings or their gradients)
HOP_CPUS = 0.01  # what each actor reserves: it only stamps the time, and must fit beside whatever Ray already runs


def _elements(nbytes: int) -> int:
    """float32 elements of a piece of ``nbytes`` (at least one)."""
    return max(1, nbytes // torch.float32.itemsize)


class HopWorker(WorkerBase):
    """A worker whose calls do nothing but stamp their start and end."""

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def work(self, *pieces: dict[int, torch.Tensor]) -> dict[str, float]:
        """A call of a step (a forward, a backward), on the refs another group emitted: its start and end."""
        start = time.time()
        n = sum(int(t.numel()) for p in pieces for t in p.values())
        return {"start": start, "end": time.time(), "received": n}

    @produces_tensors
    def emit(self, nbytes: int) -> dict[int, torch.Tensor]:
        """This rank's piece for the other group (the router's ``emit``), by the group's data plane."""
        return {self.rank: torch.ones(_elements(nbytes))}


def measure_hop(ranks: int = 2, reps: int = 15, nbytes: int = HOP_BYTES, worker_cls: type = HopWorker,
                beside: Callable[[], AbstractContextManager] | None = None) -> tuple[float, float]:
    """(the median seconds from one group's call ending to the next group's call starting on its refs, ``nbytes``
    a rank, 0: none, through the runtime's ``WorkerGroup`` calls (see the module docstring); the same inside
    ``beside()``, a context entered once the groups are up, e.g. other processes loading the host; 0.0 without
    one). Ray must be up."""
    import ray

    from dhp.runtime.placement import ActorResources
    from dhp.runtime.worker_group import WorkerGroup

    groups = [WorkerGroup(worker_cls, name, ranks, None, resources=ActorResources(HOP_CPUS, 0.0))
              for name in ("producer", "consumer")]
    try:
        alone = _median_hop(groups, reps, nbytes)
        if beside is None:
            return alone, 0.0
        with beside():
            return alone, _median_hop(groups, reps, nbytes)
    finally:
        for g in groups:
            for a in g.actors:
                ray.kill(a)


def _median_hop(groups: list[Any], reps: int, nbytes: int) -> float:
    """``reps`` hops of the chain between the two groups (each call on the refs the other emitted last), after
    one call of each; their median."""
    hops: list[float] = []
    pieces: list[Any] = []  # the refs the previous call's group emitted
    last_end = 0.0
    for i in range(reps + 2):  # the groups' first calls warm their actors' code paths
        group = groups[i % 2]
        call = group.work.submit(*pieces)  # on the other group's refs; its emit submitted with it, as run_step
        emitted = [group.submit_rank(r, "emit", nbytes) for r in range(group.n_ranks)] if nbytes else []
        stamps = call.get()
        if any(st["received"] != len(pieces) * _elements(nbytes) for st in stamps):
            raise RuntimeError(f"measure_hop: ranks received {[st['received'] for st in stamps]} elements, "
                               f"not the {len(pieces)} pieces of {nbytes} bytes emitted to them")
        if emitted:
            group.wait_tensors("emit", emitted, list(range(group.n_ranks)))
        if i >= 2:
            hops.append(max(st["start"] for st in stamps) - last_end)
        last_end, pieces = max(st["end"] for st in stamps), emitted
    return max(0.0, statistics.median(hops))
