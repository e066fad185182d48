"""Worker side of the Ray backend: one rank of one module group (any encoder, or the language model).

A worker is a thin shell around a module engine (``dhp.engine``), the same class
the single-process reference trainer runs; the worker adds the process groups
of its layout, loads its own samples by id (media never pass through the
driver), and hands tensors to the other groups through methods marked
``@produces_tensors`` (Ray Direct Transport, or the object store). Which module
a worker runs is data (its group's name and the family's ``Module``): an
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
from contextlib import nullcontext
from typing import Any

import ray
import torch

from dhp.backends.base import process_memory_gb
from dhp.data.batch import padded_length
from dhp.data.loader import AheadLoader
from dhp.engine import (
    EncoderEngine,
    LanguageEngine,
    ModuleEngine,
    Parallel,
    Piece,
    pack_multiple,
    sequence_slice,
    slot_positions,
)
from dhp.inputs import EngineInit
from dhp.parallel.comm import CommCounter
from dhp.runtime import Collect, Split, WorkerBase, dispatch, produces_tensors
from dhp.runtime.data_plane import (
    Incoming,
    Named,
    P2PChannel,
    dtype_name,
    open_cuda,
    output_layout,
    pack_rows,
    rows_by_receiver,
    send_order,
    share_cuda,
    split_named,
    split_rows,
)
from dhp.runtime.gc_policy import GcPolicy
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
        self.waiting: dict[str, float] = defaultdict(float)  # seconds waiting for the router ("router") per step
        self.data_plane = "ray"  # p2p | cuda_ipc | ray (``dhp.runtime.cluster.resolve_data_plane``)
        self.channel: P2PChannel | None = None
        self.par: Parallel | None = None
        # bytes this rank hands to collectives, per kind, in the current step: only where runtime.count_collectives
        # asks (dhp bench), since its dispatch mode puts every op of the step through Python (docs/performance.md)
        self.comm: CommCounter | None = None
        self.spans: list[dict[str, Any]] = []  # this step's timeline: phase, round, wall-clock start and end
        self.gc: GcPolicy | None = None

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def setup_parallel(self, layouts: list[ModuleLayout], backend: str, spec: Any) -> dict[str, int]:
        """Create the mesh groups and keep this rank's ``Parallel``.

        gloo (one default group over all actors): collective over every actor, all modules' groups.
        nccl (a default group per module): each module makes its own groups, ranks module-local."""
        layout = next(x for x in layouts if x.module == self.module)
        if self.module_world:  # a default group per module (GPU, data plane not p2p)
            groups, offset = create_mesh_groups([layout], backend, self.rank, self.collective_timeout()), 0
        else:
            groups = create_mesh_groups(layouts, backend, self.global_rank, self.collective_timeout())
            offset = sum(x.size for x in layouts[: layouts.index(layout)])
        mesh = device_mesh(layout, offset, groups, "cuda" if backend == "nccl" else "cpu")
        self.layout = layout
        self.par = Parallel(
            config=spec,
            inner_kind=layout.inner_name if layout.inner > 1 else "none",
            dp_rank=layout.replica_of(self.rank),
            inner_rank=layout.inner_rank(self.rank),
            dp_group=groups["dp"],
            inner_group=groups[layout.inner_name],
            module_group=self.pg,
            mesh=mesh,
        )
        return {"rank": self.rank, "replica": self.par.dp_rank, "inner_rank": self.par.inner_rank}

    def _dataset(self, init: EngineInit):
        from dhp.inputs import open_dataset

        return open_dataset(init.dataset)

    def _keep_turns_apart(self, init: EngineInit) -> None:
        self.empty_cache = empties_cache_between_turns(init.cfg, init.device)

    def _settle_gc(self, init: EngineInit) -> None:
        """The engine is built: Python's collector from now on as ``runtime.gc_*`` say (``GcPolicy``)."""
        if self.gc is not None:  # a second init in this process (a restart): the last policy's schedule ends
            self.gc.close()
        self.gc = GcPolicy(init.cfg.runtime.gc_freeze, init.cfg.runtime.gc_every_steps)
        self.gc.after_init()

    def _open_data_plane(self, init: EngineInit) -> None:
        """This rank's end of the data plane the runtime chose (``init.data_plane``)."""
        self.data_plane = init.data_plane
        if self.data_plane == "p2p":
            if not self.data_plane_groups:
                raise RuntimeError(f"{self.module} rank {self.rank}: p2p data plane without its process groups")
            self.channel = P2PChannel(self.data_plane_groups, self.engine.device)

    def _wait_router(self, seconds: float, key: Any) -> None:
        """Count time spent waiting for the router (a receive, or the end of this rank's sends)."""
        self.waiting["router"] += seconds
        end = time.time()
        self.spans.append({"phase": "router_wait", "round": key, "start": end - seconds, "end": end})

    def _set_counting(self, init: EngineInit) -> None:
        self.comm = CommCounter() if init.cfg.runtime.count_collectives else None

    def counting(self) -> Any:
        """The comm counter's context where it is on (``runtime.count_collectives``), else nothing at all."""
        return self.comm if self.comm is not None else nullcontext()

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

    def arm_gradient_reduction(self) -> None:
        """The next backward is this rank's last of the step: it starts the bucketed gradient all-reduces."""
        self.engine.arm_gradient_reduction()

    @dispatch(split=Split.ALL, collect=Collect.RANK_ZERO)
    def finish_gradients(self, scale: float) -> float:
        """Scale to the global token mean, reduce over the ranks with partial sums; the replica's squared norm.

        Every rank takes part (the norm is collective under TP and FSDP); rank 0 speaks for the module."""
        if self.channel is not None:  # every send of the step was matched by its peer's receive by now
            self._wait_router(self.channel.drain(), None)
        t0 = time.perf_counter()
        with self.counting():
            self.engine.finish_gradients(scale)
            norm_sq = float(self.engine.grad_norm_sq())  # the one host read of the norm per step
        self._timed("reduce", t0)
        return norm_sq

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def step(self, clip_coef: float) -> dict[str, Any]:
        """Optimizer step; returns this rank's timings, transfer bytes and peak memory, then resets them."""
        t0 = time.perf_counter()
        lr = self.engine.lr()  # the rate this step uses
        with self.counting():
            self.engine.step(clip_coef)
        self._end_turn()
        self._timed("optimizer", t0)
        out = {"busy": dict(self.busy), "bytes_in": self.bytes_in, "bytes_out": self.bytes_out,
               "waiting": dict(self.waiting),
               "lr": lr, "memory_gb": process_memory_gb(), "spans": self.spans,
               "comm": self.comm.snapshot() if self.comm is not None else {},
               "device_name": _device_name(), "threads": torch.get_num_threads()}
        self.spans = []
        self.busy.clear()
        self.waiting.clear()
        self.bytes_in = self.bytes_out = 0
        if self.comm is not None:
            self.comm.reset()
        if self.gc is not None:  # between steps, on every rank at once: the driver waits for this call
            self.gc.after_step()
        return out

    @dispatch(split=Split.ALL, collect=Collect.RANK_ZERO)
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full weights (collective when sharded: every rank must take part); the driver keeps rank 0's."""
        return self.engine.state_dict()

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def gc_state(self) -> dict[str, Any]:
        """This rank's garbage collector as ``runtime.gc_*`` left it (``GcPolicy``): objects frozen, whether Python
        collects on its own, steps ended, seconds of the policy's own collections."""
        import gc

        policy = self.gc or GcPolicy(freeze=False)
        return {"frozen_objects": gc.get_freeze_count(), "automatic": gc.isenabled(), "steps": policy.steps,
                "collect_s": policy.collect_s}

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def identity(self) -> dict[str, Any]:
        """Where this rank runs: module, rank, node (its IP), Ray node id, pid (for workers.json: find or kill a
        rank's process, see which node pool a group landed on)."""
        ip = ray.util.get_node_ip_address()
        return {"module": self.module, "rank": self.rank, "node": ip, "ip": ip,
                "node_id": ray.get_runtime_context().get_node_id(), "hostname": socket.gethostname(),
                "pid": os.getpid()}

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
    def init_engine(self, init: EngineInit) -> None:
        family = init.family
        self.dataset = self._dataset(init)
        self.loader = AheadLoader(self.dataset.get, init.cfg.data.loader_workers)
        text = init.cfg.module(family.language.name).parallel
        # Megatron SP on the text side: each of its TP ranks gets the rows of its sequence slice only (p2p)
        self.text_slices = text.sequence_parallel and text.tp > 1
        self.text_multiple = pack_multiple(init.cfg, family.language.name)  # the padding of the text's packed rows
        self.slots: dict[int, torch.Tensor] = {}  # sample id -> its placeholder positions (text_slices only)
        self.engine = EncoderEngine(family.module(self.module), family, init.model_cfg, init.cfg, self._take,
                                    par=self.par, device=init.device)
        self._keep_turns_apart(init)
        self._set_counting(init)
        self._open_data_plane(init)
        self._settle_gc(init)
        self.outputs: dict[Any, dict[int, Piece]] = {}
        # key -> (text rank, rows, their token index: under Megatron SP, where a sample's rows may go to two)
        self.sent: dict[Any, list[tuple[int, tuple[tuple[int, int], ...], torch.Tensor | None]]] = {}

    def _take(self, i: int, pixels: bool = True) -> Any:
        """The loader's sample ``i``; where text ranks get sequence slices, its placeholder positions noted."""
        sample = self.loader.take(i, pixels)
        if self.text_slices:
            ids = self.engine.definition.placeholder_ids(self.engine.model_cfg)
            self.slots[i] = slot_positions(sample.input_ids, ids)
        return sample

    @dispatch(split=Split.REPLICA, collect=Collect.ALL)
    def prefetch(self, key: Any, sample_ids: list[int]) -> None:
        """Start decoding round ``key``'s samples of this replica in the background (``data.loader_workers``);
        returns at once, so the forward queued behind this call runs while they decode."""
        self.loader.prefetch(key, list(sample_ids))

    @dispatch(split=Split.REPLICA, collect=Collect.ALL)
    def forward(self, key: Any, sample_ids: list[int],
                targets: list[tuple[list[int], list[int]]] | None = None) -> dict[str, Any]:
        """Encode this rank's part of its replica's samples of round ``key``; the rows it holds per sample.

        ``targets`` (p2p data plane): (global ranks of a text replica, its sample ids) for every text replica
        that needs some of them: the rows are sent to those ranks at once (asynchronously). Otherwise they are
        kept until ``emit`` hands them out. The result is the receivers' metadata: rows per sample, and the
        (name, width, dtype) of each named output (``Encoder.outputs``)."""
        t0 = time.perf_counter()
        with self.counting():
            out = self.engine.forward(key, list(sample_ids))
        self._end_turn()
        self._timed("forward", t0, key)
        self.spans.extend(self.loader.finished_spans())  # the background's loads, on this rank's row
        self.waiting["data"] += self.loader.pop_waited()  # part of the forward: its samples were not ready
        outputs = output_layout(next(iter(out.values()))[1]) if out else ()
        result = {"rows": {sid: len(index) for sid, (index, _) in out.items()}, "outputs": outputs}
        if targets is not None:
            to = self._send_pieces(key, out, targets)
            if self.text_slices:  # what each text rank receives: its sequence slice's rows
                result["to"] = to
        elif out:  # kept until the last text replica's emit; a rank with nothing to hand out keeps nothing
            self.outputs[key] = out
        self.slots = {}
        return result

    def _shared(self, obj: Any) -> Any:
        """What goes through Ray: the tensors themselves, or (``cuda_ipc``) their CUDA IPC handles."""
        return share_cuda(obj) if self.data_plane == "cuda_ipc" else obj

    def _send_pieces(self, key: Any, out: dict[int, Piece],
                     targets: list[tuple[list[int], list[int], list[int]]]) -> dict[int, dict[int, int]]:
        """Send each text replica the rows of its samples: to every one of its ranks (under TP each needs them),
        or, where its ranks keep sequence slices (Megatron SP), to each rank the rows of its slice; remember
        what went where: the gradients come back from there (the replica's head, or each slice's rank).
        A target is (the replica's global ranks, its samples this rank's replica encodes, all its samples in
        the order it packs them). Returns {text rank: {sample id: rows}} of the sliced sends."""
        sends = self.par is None or self.par.inner_kind != "tp" or self.par.inner_rank == 0  # TP ranks agree
        sent, to = [], {}
        for ranks, ids, batch in targets:
            if self.text_slices:
                parts = self._slices(out, list(ids), list(ranks), list(batch))
            else:
                counts, index, rows = pack_rows(out, list(ids), self.engine.device)
                parts = [(peer, counts, index, rows) for peer in ranks] if counts else []
            for peer, counts, index, rows in parts:
                if sends:  # the token index, then each named output in its own dtype and width
                    self.bytes_out += self.channel.send("forward", peer, [index, *send_order(rows)])
                to[peer] = dict(counts)
            if self.text_slices:
                sent += [(peer, counts, index) for peer, counts, index, _ in parts]
            elif parts:
                sent.append((ranks[0], parts[0][1], None))
        if self.engine.needs_backward:
            self.sent[key] = sent
        return to

    def _slices(self, out: dict[int, Piece], ids: list[int], ranks: list[int],
                batch: list[int]) -> list[tuple[int, tuple[tuple[int, int], ...], torch.Tensor, Named]]:
        """(text rank, rows, token index, rows) for each rank of a text replica that packs ``batch``: the rows
        of ``ids`` that fall in its Megatron-SP sequence slice (sample lengths from the data set's index)."""
        offsets, n = {}, 0
        for i in batch:
            offsets[i] = n
            n += self.dataset.info(i).num_tokens
        n = padded_length(n, self.text_multiple)  # the row the text ranks pack, padding included
        receivers = [(peer, *sequence_slice(n, len(ranks), t)) for t, peer in enumerate(ranks)]
        return rows_by_receiver(out, ids, offsets, self.slots, receivers, self.engine.device)

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
        return self._shared(out)

    def backward(self, key: Any, *grads: dict[int, Named]) -> None:
        """Backward of round ``key`` from the gradients of this rank's rows, by output name: received from the
        text replicas' heads (p2p), or handed in by the driver (whole per-sample gradients; this rank takes its
        rows)."""
        if self.channel is not None:
            return self._backward_p2p(key)
        t0 = time.perf_counter()
        received: dict[int, Named] = {}
        for g in grads:
            received.update(open_cuda(g) if self.data_plane == "cuda_ipc" else g)
        self.bytes_in += _nbytes(received)
        with self.counting():
            self.engine.backward(key, received)
        self._end_turn()
        self._timed("backward", t0, key)

    def _backward_p2p(self, key: Any) -> None:
        sent = self.sent.pop(key, [])
        outputs = tuple((n, w, dtype_name(d)) for n, w, d in self.engine.output_layout(key))  # the gradients' shapes
        incoming = [Incoming(self.module, head, counts, outputs) for head, counts, _ in sent]
        got, waited = self.channel.receive("backward", incoming, with_index=False)
        self._wait_router(waited, key)
        t0 = time.perf_counter()
        self.bytes_in += sum(_nbytes(grad) for _, grad in got)
        with self.counting():
            if self.text_slices:  # a sample's rows may come back from two text ranks: placed by token index
                parts = [(sid, token_index, named)
                         for (_, counts, index), (_, grad) in zip(sent, got, strict=True)
                         for (sid, named), token_index in zip(split_named(counts, grad).items(),
                                                              index.split([n for _, n in counts]), strict=True)]
                self.engine.backward_parts(key, parts)
            else:
                rows: dict[int, Named] = {}
                for inc, (_, grad) in zip(incoming, got, strict=True):
                    rows.update(split_named(inc.rows, grad))
                self.engine.backward_rows(key, rows)
        self._end_turn()
        self._timed("backward", t0, key)


class LanguageWorker(EngineWorker):
    """One rank of the language-model group."""

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def init_engine(self, init: EngineInit) -> None:
        # no pinning: the samples' tensors are packed into new ones, which the engine pins (CUDA) and copies
        self.loader = AheadLoader(self._dataset(init).get, init.cfg.data.loader_workers, pixels=False, pin=False)
        self.engine = LanguageEngine(init.family, init.model_cfg, init.cfg, self.loader.take, par=self.par,
                                     device=init.device)
        self._keep_turns_apart(init)
        self._set_counting(init)
        self._open_data_plane(init)
        self._settle_gc(init)
        self.grads: dict[tuple[Any, str], dict[int, Named]] = {}

    @dispatch(split=Split.REPLICA, collect=Collect.ALL)
    def prefetch(self, key: Any, sample_ids: list[int]) -> None:
        """Start reading round ``key``'s samples of this replica (placeholders, no pixels) in the background."""
        self.loader.prefetch(key, list(sample_ids))

    @dispatch(split=Split.RANK, collect=Collect.REPLICA_HEADS)  # one loss per replica: its head's
    def forward_backward(self, key: Any, sample_ids: list[int], sources: list[str],
                         *pieces: dict[int, Piece]) -> tuple[float, int]:
        """Loss of this replica's micro-batch (summed) and its supervised-token count.

        ``pieces[i]`` came from a rank of encoder ``sources[i]``: its pieces themselves (through Ray), or an
        ``Incoming`` (p2p data plane): what to receive from that rank, which sends it directly. A sliced
        ``Incoming`` (Megatron SP) says what each rank of the replica receives: this rank takes its own part
        (nothing, where none of that sender's rows fall in its sequence slice) and sends back its gradients."""
        sliced = any(isinstance(p, Incoming) and p.sliced for p in pieces)
        kept = [(source, p.for_receiver(self.global_rank) if isinstance(p, Incoming) else p)
                for source, p in zip(sources, pieces, strict=True)]
        kept = [(source, p) for source, p in kept if p is not None]
        sources, pieces = [source for source, _ in kept], tuple(p for _, p in kept)
        incoming = [p for p in pieces if isinstance(p, Incoming)]
        got: list[tuple[torch.Tensor, Named]] = []
        if incoming:
            got, waited = self.channel.receive("forward", incoming)
            self._wait_router(waited, key)
        t0 = time.perf_counter()
        received: dict[str, dict[int, list[Piece]]] = defaultdict(lambda: defaultdict(list))
        arrived = iter(got)
        for source, part in zip(sources, pieces, strict=True):
            if isinstance(part, Incoming):
                index, rows = next(arrived)
                self.bytes_in += _nbytes(index) + _nbytes(rows)
                part = split_rows(part.rows, index, rows)
            else:
                part = open_cuda(part) if self.data_plane == "cuda_ipc" else part
                self.bytes_in += _nbytes(part)
            for sid, piece in part.items():
                received[source][sid].append(piece)
        with self.counting():
            loss, n, grads = self.engine.forward_backward(sample_ids, received, sequence_slice=sliced)
        if sliced:  # each rank hands back the gradients of its own slice's rows
            self._send_grads(grads, incoming, got)
        elif self.par is None or self.par.inner_rank == 0:  # the replica head hands gradients back
            if incoming:
                self._send_grads(grads, incoming, got)
            else:
                for encoder, per_sample in grads.items():
                    self.grads[(key, encoder)] = per_sample
        self._end_turn()
        self._timed("forward_backward", t0, key)
        self.loader.finished_spans()  # the text side's reads are not drawn (they read no pixels)
        self.waiting["data"] += self.loader.pop_waited()
        return float(loss), n  # the driver sums the losses: one read per micro-batch, after its backward

    def _send_grads(self, grads: dict[str, dict[int, Named]], incoming: list[Incoming],
                    got: list[tuple[torch.Tensor, Named]]) -> None:
        """To each encoder rank that sent rows: the gradients of exactly those rows, one tensor per named output,
        in its order and dtype."""
        for inc, (index, _) in zip(incoming, got, strict=True):
            if inc.module not in grads:  # a frozen encoder takes no gradients
                continue
            per_sample = grads[inc.module]
            sizes = [n for _, n in inc.rows]
            at = [(sid, self.engine.gradient_rows(inc.module, sid, token_index))
                  for (sid, _), token_index in zip(inc.rows, index.split(sizes), strict=True)]
            grad = [torch.cat([per_sample[sid][name][rows] for sid, rows in at]).to(_dtype_of(dtype))
                    for name, _, dtype in inc.outputs]
            for peer in inc.gradient_peers:
                self.bytes_out += self.channel.send("backward", peer, grad)

    @produces_tensors
    def emit_grads(self, key: Any, encoder: str, sample_ids: list[int], last: bool) -> dict[int, Named]:
        """d(loss)/d(output) of ``sample_ids`` by output name, for the ``encoder`` replica that produced them."""
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
        return share_cuda(out) if self.data_plane == "cuda_ipc" else out


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


def _dtype_of(name: str) -> torch.dtype:
    return getattr(torch, name)


def _device_name() -> str:
    """The accelerator's name (for its peak FLOP/s in the device table), or "cpu"."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


