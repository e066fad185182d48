"""The Ray workers of a VLM: a vision worker and a text worker, each one rank of its module group.

A worker is a thin shell around a module engine (``dhp.engine``), the same class
the single-process reference trainer runs; the worker adds the process groups
of its layout, loads its own samples by id (pixels never pass through the
driver), and hands tensors to the other group through methods marked
``@produces_tensors`` (Ray Direct Transport, or the object store).

Per micro-batch round ``key``:
  vision rank:     ``forward(key, ids)`` then ``emit(key, ids_for_text_replica_r)``: its pieces of those samples
  text rank:       ``forward_backward(key, ids, *pieces_from_vision_ranks)``;
  text replica head (inner rank 0): ``emit_grads(key, ids_of_vision_replica_q)``
  vision rank:     ``backward(key, *grads_from_text_replicas)``
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from typing import Any

import torch

from dhp.engine import ModuleEngine, Parallel, Piece, TextEngine, VisionEngine
from dhp.parallel.comm import CommCounter
from dhp.runtime.dispatch import Mode, dispatch, produces_tensors
from dhp.runtime.group import WorkerBase
from dhp.runtime.mesh import ModuleLayout, create_mesh_groups, device_mesh


def _nbytes(obj: Any) -> int:
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 0


class EngineWorker(WorkerBase):
    """What both workers share: the layout's process groups, timing, the end of a step."""

    engine: ModuleEngine

    def __init__(self) -> None:
        self.busy: dict[str, float] = defaultdict(float)
        self.bytes_in = 0
        self.bytes_out = 0
        self.par: Parallel | None = None
        self.comm = CommCounter()  # bytes this rank hands to collectives, per kind, in the current step

    def setup_parallel(self, layouts: list[ModuleLayout], backend: str, spec: Any) -> dict[str, int]:
        """Create the mesh groups and keep this rank's ``Parallel``.

        gloo (one default group over all actors): collective over every actor, all modules' groups.
        nccl (a default group per module): each module makes its own groups, ranks module-local."""
        layout = next(x for x in layouts if x.module == self.module)
        if backend == "nccl":
            groups, offset = create_mesh_groups([layout], backend, self.rank), 0
        else:
            groups = create_mesh_groups(layouts, backend, self.global_rank)
            offset = sum(x.size for x in layouts[: layouts.index(layout)])
        mesh = device_mesh(layout, offset, groups, "cuda" if backend == "nccl" else "cpu")
        self.layout = layout
        self.par = Parallel(
            spec=spec,
            inner_kind=layout.inner_name if layout.inner > 1 else "none",
            dp_rank=layout.replica_of(self.rank),
            inner_rank=layout.inner_rank(self.rank),
            dp_group=groups["dp"],
            inner_group=groups[layout.inner_name],
            module_group=self.pg,
            mesh=mesh,
        )
        return {"rank": self.rank, "replica": self.par.dp_rank, "inner_rank": self.par.inner_rank}

    def _dataset(self, spec: dict[str, Any]):
        from dhp.train import open_dataset

        return open_dataset(spec)

    def _timed(self, phase: str, t0: float) -> None:
        self.busy[phase] += time.perf_counter() - t0

    @dispatch(Mode.ONE_TO_ALL)
    def finish_gradients(self, scale: float) -> float:
        """Scale to the global token mean, reduce over the ranks with partial sums; the replica's squared norm.

        Every rank takes part (the norm is collective under TP and FSDP); the driver reads rank 0's."""
        t0 = time.perf_counter()
        with self.comm:
            self.engine.finish_gradients(scale)
            norm_sq = self.engine.grad_norm_sq()
        self._timed("reduce", t0)
        return norm_sq

    @dispatch(Mode.ONE_TO_ALL)
    def step(self, clip_coef: float) -> dict[str, Any]:
        """Optimizer step; returns this rank's timings, transfer bytes and peak memory, then resets them."""
        t0 = time.perf_counter()
        lr = self.engine.lr()  # the rate this step uses
        with self.comm:
            self.engine.step(clip_coef)
        self._timed("optimizer", t0)
        out = {"busy": dict(self.busy), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
               "lr": lr, "memory_gb": _peak_memory_gb(), "comm": self.comm.snapshot()}
        self.busy.clear()
        self.bytes_in = self.bytes_out = 0
        self.comm.reset()
        return out

    def comm_bytes(self) -> dict[str, int]:
        return self.comm.snapshot()

    @dispatch(Mode.RANK_ZERO)
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights (collective when sharded: every rank must take part); the driver keeps rank 0's."""
        return self.engine.state_dict()


class VisionWorker(EngineWorker):
    module = "vision"

    def init_engine(self, spec: dict[str, Any]) -> None:
        self.engine = VisionEngine(spec["model_cfg"], spec["cfg"], self._dataset(spec).get, par=self.par,
                                   device=spec["device"], state=spec["state"])
        self.outputs: dict[Any, dict[int, Piece]] = {}

    def forward(self, key: Any, sample_ids: list[int]) -> int:
        """Encode this rank's part of its replica's samples of round ``key``; kept until ``emit`` hands it out."""
        t0 = time.perf_counter()
        with self.comm:
            self.outputs[key] = self.engine.forward(key, sample_ids)
        self._timed("forward", t0)
        return len(self.outputs[key])

    @produces_tensors
    def emit(self, key: Any, sample_ids: list[int], last: bool) -> dict[int, Piece]:
        """This rank's pieces of ``sample_ids`` (a subset of round ``key``), for one text replica."""
        if key not in self.outputs:
            raise RuntimeError(f"vision rank {self.rank}: no output for micro-batch {key}: its forward failed")
        out = {i: self.outputs[key][i] for i in sample_ids if i in self.outputs[key]}
        if last:
            del self.outputs[key]
        self.bytes_out += _nbytes(out)
        return out

    def backward(self, key: Any, *grads: dict[int, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        received: dict[int, torch.Tensor] = {}
        for g in grads:
            received.update(g)
        self.bytes_in += _nbytes(received)
        with self.comm:
            self.engine.backward(key, received)
        self._timed("backward", t0)


class TextWorker(EngineWorker):
    module = "text"

    def init_engine(self, spec: dict[str, Any]) -> None:
        self.engine = TextEngine(spec["model_cfg"], spec["cfg"], self._dataset(spec).get, par=self.par,
                                 device=spec["device"], state=spec["state"])
        self.grads: dict[Any, dict[int, torch.Tensor]] = {}

    def forward_backward(self, key: Any, sample_ids: list[int], *pieces: dict[int, Piece]) -> tuple[float, int]:
        """Loss of this replica's micro-batch (summed) and its supervised-token count."""
        t0 = time.perf_counter()
        received: dict[int, list[Piece]] = defaultdict(list)
        for part in pieces:
            for sid, piece in part.items():
                received[sid].append(piece)
        self.bytes_in += _nbytes(pieces)
        with self.comm:
            loss, n, grads = self.engine.forward_backward(sample_ids, received)
        if self.par is None or self.par.inner_rank == 0:  # the replica head hands gradients back
            self.grads[key] = grads
        self._timed("forward_backward", t0)
        return loss, n

    @produces_tensors
    def emit_grads(self, key: Any, sample_ids: list[int], last: bool) -> dict[int, torch.Tensor]:
        """d(loss)/d(embeddings) of ``sample_ids``, for the vision replica that produced them."""
        if key not in self.grads:
            raise RuntimeError(f"text rank {self.rank}: no gradients for micro-batch {key}: its step failed")
        out = {i: self.grads[key][i] for i in sample_ids if i in self.grads[key]}
        if last:
            del self.grads[key]
        self.bytes_out += _nbytes(out)
        return out


def _peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
