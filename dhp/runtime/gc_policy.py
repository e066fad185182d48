"""Python's garbage collector in a training worker: frozen after start-up, and, where asked, run by the step.

A worker holds some 340 thousand objects that the collector tracks once torch, Ray and the model are imported and
built, and nearly all of them live as long as the process. Python's full collection walks every one: about 110 ms
on this project's CPU machine (``docs/performance.md``, "Python's garbage collector"), run by the interpreter
whenever enough objects have survived, in whatever call happens to allocate at that moment: a forward, a
backward, the middle of a TP layer. A rank that pauses there holds up every rank of its group at their next
collective, and the step with the pause measures 20-50 % slower than its neighbours.

``GcPolicy`` does what large-scale trainers do (Megatron-LM's ``--manual-gc``, torchtitan's ``gc_freq``):

* ``freeze``: after the engine is built, and again after the first step (which creates the optimizer's state and
  the dispatch caches), collect once and move every surviving object to the permanent generation
  (``gc.freeze``). Later collections, automatic or not, walk only what was made since.
* ``every_steps`` > 0: automatic collection off, and a full collection (of the unfrozen objects) at the end of
  every ``every_steps``-th step, on every rank of every group at the same step: the pause lands between steps
  and not inside a collective. 0 keeps Python's automatic collection.

A leaf: imports nothing of dhp.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass


@dataclass
class GcPolicy:
    freeze: bool = True
    every_steps: int = 0
    steps: int = 0  # steps this process has ended
    collect_s: float = 0.0  # seconds this policy's own collections took (startup's and the steps')

    def after_init(self) -> None:
        """The engine is built: its objects go to the permanent generation; the manual schedule starts."""
        if self.freeze:
            self._collect(freeze=True)
        if self.every_steps > 0:
            gc.disable()

    def after_step(self) -> None:
        """A step ended (its optimizer step taken): the first step's objects frozen; a scheduled collection."""
        self.steps += 1
        if self.freeze and self.steps == 1:
            self._collect(freeze=True)
        elif self.every_steps > 0 and self.steps % self.every_steps == 0:
            self._collect(freeze=False)

    def close(self) -> None:
        """Python's own collection back, for whatever runs in this process next."""
        if self.every_steps > 0:
            gc.enable()

    def _collect(self, freeze: bool) -> None:
        t0 = time.perf_counter()
        gc.collect()
        if freeze:
            gc.freeze()
        self.collect_s += time.perf_counter() - t0
