"""Worker side of the Ray backend: one rank of one module group (any encoder, or the language model).

A worker is a thin shell around a module engine (``dhp.engine``), the same class
the single-process reference trainer runs; the worker adds the process groups
of its layout, loads its own samples by id (media never pass through the
driver), and hands tensors to the other groups through methods marked
``@produces_tensors`` (Ray Direct Transport, or the object store). Which module
a worker runs is data (its group's name and the family's ``ModuleSpec``): an
encoder group of a new family needs no new worker class.

Per micro-batch round ``key``:
  encoder rank:   ``forward(key, ids)`` then ``emit(key, ids_for_text_replica_r, last)``: its pieces of those samples
  text rank:      ``forward_backward(key, ids, sources, *pieces)``: ``sources[i]`` names the encoder of ``pieces[i]``
  text replica head (inner rank 0): ``emit_grads(key, encoder, ids_of_encoder_replica_q, last)``
  encoder rank:   ``backward(key, *grads_from_text_replicas)``

The driver side is ``dhp.backends.ray_backend``.
"""

from __future__ import annotations

import os
import socket
import time
from collections import defaultdict
from typing import Any

import ray
import torch

from dhp.backends.base import process_memory_gb
from dhp.engine import EncoderEngine, LanguageEngine, ModuleEngine, Parallel, Piece
from dhp.parallel.comm import CommCounter
from dhp.runtime import Collect, Split, WorkerBase, dispatch, produces_tensors
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
    """What every module worker shares: the layout's process groups, timing, the end of a step."""

    engine: ModuleEngine

    def __init__(self, collective_timeout_s: float | None = None) -> None:
        self.collective_timeout_s = collective_timeout_s  # every process group of this worker fails past it
        self.busy: dict[str, float] = defaultdict(float)
        self.bytes_in = 0
        self.bytes_out = 0
        self.par: Parallel | None = None
        self.comm = CommCounter()  # bytes this rank hands to collectives, per kind, in the current step
        self.spans: list[dict[str, Any]] = []  # this step's timeline: phase, round, wall-clock start and end

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def setup_parallel(self, layouts: list[ModuleLayout], backend: str, spec: Any) -> dict[str, int]:
        """Create the mesh groups and keep this rank's ``Parallel``.

        gloo (one default group over all actors): collective over every actor, all modules' groups.
        nccl (a default group per module): each module makes its own groups, ranks module-local."""
        layout = next(x for x in layouts if x.module == self.module)
        if backend == "nccl":
            groups, offset = create_mesh_groups([layout], backend, self.rank, self.collective_timeout()), 0
        else:
            groups = create_mesh_groups(layouts, backend, self.global_rank, self.collective_timeout())
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
        from dhp.inputs import open_dataset

        return open_dataset(spec)

    def _keep_turns_apart(self, spec: dict[str, Any]) -> None:
        self.empty_cache = empties_cache_between_turns(spec["cfg"], spec["device"])

    def _end_turn(self) -> None:
        """Hand this process's cached free blocks back to the device (``empties_cache_between_turns``)."""
        if getattr(self, "empty_cache", False):
            torch.cuda.empty_cache()

    def _timed(self, phase: str, t0: float, key: Any = None, busy: bool = True) -> None:
        """Count ``phase``'s time since ``t0`` (perf_counter) as busy, and record its span for the timeline with
        wall-clock times (``time.time()``: one clock for every worker of a machine, so spans line up)."""
        dur = time.perf_counter() - t0
        if busy:
            self.busy[phase] += dur
        end = time.time()
        self.spans.append({"phase": phase, "round": key, "start": end - dur, "end": end})

    @dispatch(split=Split.ALL, collect=Collect.RANK_ZERO)
    def finish_gradients(self, scale: float) -> float:
        """Scale to the global token mean, reduce over the ranks with partial sums; the replica's squared norm.

        Every rank takes part (the norm is collective under TP and FSDP); rank 0 speaks for the module."""
        t0 = time.perf_counter()
        with self.comm:
            self.engine.finish_gradients(scale)
            norm_sq = self.engine.grad_norm_sq()
        self._timed("reduce", t0)
        return norm_sq

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def step(self, clip_coef: float) -> dict[str, Any]:
        """Optimizer step; returns this rank's timings, transfer bytes and peak memory, then resets them."""
        t0 = time.perf_counter()
        lr = self.engine.lr()  # the rate this step uses
        with self.comm:
            self.engine.step(clip_coef)
        self._end_turn()
        self._timed("optimizer", t0)
        out = {"busy": dict(self.busy), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
               "lr": lr, "memory_gb": process_memory_gb(), "comm": self.comm.snapshot(), "spans": self.spans,
               "device_name": _device_name(), "threads": torch.get_num_threads()}
        self.spans = []
        self.busy.clear()
        self.bytes_in = self.bytes_out = 0
        self.comm.reset()
        return out

    @dispatch(split=Split.ALL, collect=Collect.RANK_ZERO)
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights (collective when sharded: every rank must take part); the driver keeps rank 0's."""
        return self.engine.state_dict()

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def identity(self) -> dict[str, Any]:
        """Where this rank runs: module, rank, node, pid (for workers.json: find or kill a rank's process)."""
        return {"module": self.module, "rank": self.rank, "node": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "pid": os.getpid()}

    @dispatch(split=Split.ALL, collect=Collect.RANK_ZERO)
    def save_checkpoint(self, path: str) -> float:
        """Write this rank's shards of the module to ``path`` (every rank of the group, collectively); seconds."""
        from dhp.engine_checkpoint import save_engine

        t0 = time.perf_counter()
        save_engine(self.engine, path, self.pg, self.rank)
        return time.perf_counter() - t0

    @dispatch(split=Split.ALL, collect=Collect.RANK_ZERO)
    def load_checkpoint(self, path: str, step: int, same_layout: bool) -> None:
        """Read this rank's shards of the module from ``path`` (any layout wrote it); the schedule at ``step``."""
        from dhp.engine_checkpoint import load_engine

        load_engine(self.engine, path, self.pg, self.rank, step, same_layout)

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def rank_state_dict(self) -> dict[str, torch.Tensor]:
        """Every rank's full weights (for checks that all replicas agree)."""
        return self.engine.state_dict()


class EncoderWorker(EngineWorker):
    """One rank of an encoder group (vision, audio, ...): which encoder is its group's module name."""

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def init_engine(self, spec: dict[str, Any]) -> None:
        family = spec["family"]
        self.engine = EncoderEngine(family.module(self.module), family, spec["model_cfg"], spec["cfg"],
                                    self._dataset(spec).get, par=self.par, device=spec["device"])
        self._keep_turns_apart(spec)
        self.outputs: dict[Any, dict[int, Piece]] = {}

    @dispatch(split=Split.REPLICA, collect=Collect.ALL)
    def forward(self, key: Any, sample_ids: list[int]) -> int:
        """Encode this rank's part of its replica's samples of round ``key``; kept until ``emit`` hands it out."""
        t0 = time.perf_counter()
        with self.comm:
            out = self.engine.forward(key, list(sample_ids))
        if out:  # kept until the last text replica's emit; a rank with nothing to hand out keeps nothing
            self.outputs[key] = out
        self._end_turn()
        self._timed("forward", t0, key)
        return len(out)

    @produces_tensors
    def emit(self, key: Any, sample_ids: list[int], last: bool) -> dict[int, Piece]:
        """This rank's pieces of ``sample_ids`` (a subset of round ``key``), for one text replica."""
        t0 = time.perf_counter()
        held = self.outputs.get(key, {})  # empty: this rank's slice holds none of these samples' tokens
        out = {i: held[i] for i in sample_ids if i in held}
        if last:
            self.outputs.pop(key, None)
        self.bytes_out += _nbytes(out)
        self._timed("emit", t0, key, busy=False)
        return out

    def backward(self, key: Any, *grads: dict[int, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        received: dict[int, torch.Tensor] = {}
        for g in grads:
            received.update(g)
        self.bytes_in += _nbytes(received)
        with self.comm:
            self.engine.backward(key, received)
        self._end_turn()
        self._timed("backward", t0, key)


class LanguageWorker(EngineWorker):
    """One rank of the language-model group."""

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def init_engine(self, spec: dict[str, Any]) -> None:
        family = spec["family"]
        self.engine = LanguageEngine(family, spec["model_cfg"], spec["cfg"], self._dataset(spec).get, par=self.par,
                                     device=spec["device"])
        self._keep_turns_apart(spec)
        self.grads: dict[tuple[Any, str], dict[int, torch.Tensor]] = {}

    @dispatch(split=Split.RANK, collect=Collect.REPLICA_HEADS)  # one loss per replica: its head's
    def forward_backward(self, key: Any, sample_ids: list[int], sources: list[str],
                         *pieces: dict[int, Piece]) -> tuple[float, int]:
        """Loss of this replica's micro-batch (summed) and its supervised-token count.

        ``pieces[i]`` came from a rank of encoder ``sources[i]``."""
        t0 = time.perf_counter()
        received: dict[str, dict[int, list[Piece]]] = defaultdict(lambda: defaultdict(list))
        for source, part in zip(sources, pieces, strict=True):
            for sid, piece in part.items():
                received[source][sid].append(piece)
        self.bytes_in += _nbytes(pieces)
        with self.comm:
            loss, n, grads = self.engine.forward_backward(sample_ids, received)
        if self.par is None or self.par.inner_rank == 0:  # the replica head hands gradients back
            for encoder, per_sample in grads.items():
                self.grads[(key, encoder)] = per_sample
        self._end_turn()
        self._timed("forward_backward", t0, key)
        return loss, n

    @produces_tensors
    def emit_grads(self, key: Any, encoder: str, sample_ids: list[int], last: bool) -> dict[int, torch.Tensor]:
        """d(loss)/d(embeddings) of ``sample_ids``, for the ``encoder`` replica that produced them."""
        t0 = time.perf_counter()
        if (key, encoder) not in self.grads:
            raise RuntimeError(f"{self.module} rank {self.rank}: no {encoder} gradients for micro-batch {key}: "
                               "its step failed")
        held = self.grads[(key, encoder)]
        out = {i: held[i] for i in sample_ids if i in held}
        if last:
            del self.grads[(key, encoder)]
        self.bytes_out += _nbytes(out)
        self._timed("emit", t0, key, busy=False)
        return out


def empties_cache_between_turns(cfg: Any, device: Any) -> bool:
    """Whether a worker empties its CUDA cache after each turn (forward, backward, forward-backward, step).

    Collocated groups share a GPU from separate processes, each with its own caching allocator: without it
    each process would keep the free blocks of its own peak reserved while the other runs, and the GPU would
    need the sum of both peaks. Emptied, an idle group holds only what it keeps (weights, gradients, optimizer
    state, activations saved for its backward), which is what ``dhp plan`` counts for a collocated GPU. The
    price is a fresh ``cudaMalloc`` for each turn's blocks. ``runtime.empty_cache_between_turns``: auto
    (collocated placement on CUDA), always (on CUDA), never."""
    mode = cfg.runtime.empty_cache_between_turns
    if mode == "never" or str(device).split(":")[0] != "cuda":
        return False
    return mode == "always" or cfg.runtime.placement == "collocated"


def _device_name() -> str:
    """The accelerator's name (for its peak FLOP/s in the device table), or "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


