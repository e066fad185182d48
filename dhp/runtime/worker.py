"""The Ray workers of a VLM: a vision worker and a text worker, each one rank of its module group.

A worker is a thin shell around a module engine (``dhp.engine``), the same class
the single-process reference trainer runs; the worker adds the process group,
loads its own samples by id (pixels never pass through the driver), and hands
tensors to the other group through methods marked ``@produces_tensors`` (Ray
Direct Transport, or the object store).

Per micro-batch round ``key``:
  vision: ``forward(key, ids)`` -> ``emit(key, ids_for_text_replica_r)`` (tensors) ...
  text:   ``forward_backward(key, ids, *embeds_from_vision)`` -> ``emit_grads(key, ids_from_vision_q)``
  vision: ``backward(key, ids, *grads_from_text)``
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from typing import Any

import torch

from dhp.engine import ModuleEngine, TextEngine, VisionEngine
from dhp.runtime.dispatch import Mode, dispatch, produces_tensors
from dhp.runtime.group import WorkerBase


def _nbytes(tensors: dict[int, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _merge(parts: tuple[dict[int, torch.Tensor], ...]) -> dict[int, torch.Tensor]:
    out: dict[int, torch.Tensor] = {}
    for p in parts:
        out.update(p)
    return out


class EngineWorker(WorkerBase):
    """What both workers share: building the engine, timing, the end of a step."""

    engine: ModuleEngine

    def __init__(self) -> None:
        self.busy: dict[str, float] = defaultdict(float)
        self.bytes_in = 0
        self.bytes_out = 0

    def _dataset(self, spec: dict[str, Any]):
        from dhp.train import open_dataset

        return open_dataset(spec)

    def _timed(self, phase: str, t0: float) -> None:
        self.busy[phase] += time.perf_counter() - t0

    @dispatch(Mode.ONE_TO_ALL)
    def finish_gradients(self, scale: float) -> float:
        """Scale to the global token mean, reduce over the module's ranks; this rank's squared norm share."""
        t0 = time.perf_counter()
        self.engine.finish_gradients(scale)
        self._timed("reduce", t0)
        # replicated (data-parallel) ranks hold equal gradients after the reduction: count rank 0 only
        return self.engine.grad_norm_sq() if self.rank == 0 else 0.0

    @dispatch(Mode.ONE_TO_ALL)
    def step(self, clip_coef: float) -> dict[str, Any]:
        """Optimizer step; returns this rank's timings, transfer bytes and peak memory, then resets them."""
        t0 = time.perf_counter()
        self.engine.step(clip_coef)
        self._timed("optimizer", t0)
        out = {"busy": dict(self.busy), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
               "lr": self.engine.lr(), "memory_gb": _peak_memory_gb()}
        self.busy.clear()
        self.bytes_in = self.bytes_out = 0
        return out

    @dispatch(Mode.RANK_ZERO)
    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.engine.state_dict()


class VisionWorker(EngineWorker):
    module = "vision"

    def init_engine(self, spec: dict[str, Any]) -> None:
        self.engine = VisionEngine(spec["model_cfg"], spec["cfg"], self._dataset(spec).get,
                                   dp_group=self.pg, state=spec["state"])
        self.outputs: dict[Any, dict[int, torch.Tensor]] = {}

    def forward(self, key: Any, sample_ids: list[int]) -> int:
        """Encode this rank's samples of round ``key``; keeps them until ``emit`` hands them out."""
        t0 = time.perf_counter()
        self.outputs[key] = self.engine.forward(key, sample_ids)
        self._timed("forward", t0)
        return len(self.outputs[key])

    @produces_tensors
    def emit(self, key: Any, sample_ids: list[int], last: bool) -> dict[int, torch.Tensor]:
        """The embeddings of ``sample_ids`` (a subset of round ``key``), for one text replica."""
        out = {i: self.outputs[key][i] for i in sample_ids if i in self.outputs[key]}
        if last:
            del self.outputs[key]
        self.bytes_out += _nbytes(out)
        return out

    def backward(self, key: Any, sample_ids: list[int], *grads: dict[int, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        received = _merge(grads)
        self.bytes_in += _nbytes(received)
        self.engine.backward(key, received, sample_ids)
        self._timed("backward", t0)


class TextWorker(EngineWorker):
    module = "text"

    def init_engine(self, spec: dict[str, Any]) -> None:
        self.engine = TextEngine(spec["model_cfg"], spec["cfg"], self._dataset(spec).get,
                                 dp_group=self.pg, state=spec["state"])
        self.grads: dict[Any, dict[int, torch.Tensor]] = {}

    def forward_backward(self, key: Any, sample_ids: list[int], *embeds: dict[int, torch.Tensor]) -> tuple[float, int]:
        """Loss of this replica's micro-batch (summed) and its supervised-token count."""
        t0 = time.perf_counter()
        received = _merge(embeds)
        self.bytes_in += _nbytes(received)
        loss, n, grads = self.engine.forward_backward(sample_ids, received)
        self.grads[key] = grads
        self._timed("forward_backward", t0)
        return loss, n

    @produces_tensors
    def emit_grads(self, key: Any, sample_ids: list[int], last: bool) -> dict[int, torch.Tensor]:
        """d(loss)/d(embeddings) of ``sample_ids``, for the vision replica that produced them."""
        out = {i: self.grads[key][i] for i in sample_ids if i in self.grads[key]}
        if last:
            del self.grads[key]
        self.bytes_out += _nbytes(out)
        return out


def _peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
