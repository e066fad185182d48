"""The data plane between module groups, worker side: point-to-point sends and receives, and CUDA IPC handles.

Why: the embeddings an encoder rank makes and the gradients that come back are
the largest tensors that cross groups (a 65k-patch image at width 5120 in bf16
is 640 MB). Through Ray's object store each piece goes device to host, through
pickle and shared memory, and back; from one text rank to every SP rank. Here
they go rank to rank instead:

- ``p2p`` (``P2PChannel``): ``torch.distributed.batch_isend_irecv`` between the
  sending and the receiving rank, over two process groups that span every
  actor of every module (NCCL between GPUs, gloo on CPU: CI runs the same
  code). One group per direction (embeddings forward, gradients backward):
  point-to-point messages between two ranks are matched in the order they were
  posted, per group, and an encoder running ahead posts the sends of round k+1
  before it receives the gradients of round k. Sends are asynchronous (the
  sender keeps the buffers until they complete, ``drain`` at the end of the
  step), so a rank never waits for its peer to reach its receive.
  Receives are sized from host metadata the driver hands on (``Incoming``):
  rows per sample and, per named output of the encoder (``Encoder.outputs``),
  its width and dtype, which the sender reported when its forward finished.
  Each named output travels as its own tensor, in its own dtype and width (no
  padding to a common width); its gradient comes back by name the same way.
  No tensor passes through the driver, and no receive needs a host read of a
  device value.
- Under the language model's Megatron sequence parallelism each TP rank keeps
  only its slice of the packed sequence (``dhp.engine.sequence_slice``) from the first
  layer on, so it receives only the placeholder rows that fall in that slice
  (``rows_by_receiver``: the sender knows its samples' placeholder positions and
  the text micro-batch's sample lengths, host metadata), 1/tp of its replica's
  rows, and sends back the gradients of exactly those rows.
- ``cuda_ipc`` (``share_cuda``/``open_cuda``): workers that share one GPU
  (collocated, where NCCL cannot join two ranks of a device) hand each other
  CUDA IPC handles through Ray: ``torch.multiprocessing``'s own reduction, which
  carries the producer's interprocess event (the consumer's stream waits on it)
  and a reference count that keeps the producer's block alive until the consumer
  is done. The consumer copies into its own memory, so the producer may free.

A wait that never ends is a hang: every receive waits at most the process
group's timeout (``runtime.collective_timeout_s``) and then fails, naming the peer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

DIRECTIONS = ("forward", "backward")  # embeddings to the language model; their gradients back


Outputs = tuple[tuple[str, int, str], ...]  # (name, width, dtype) of each named output, in the order sent


@dataclass(frozen=True)
class Incoming:
    """What one rank receives from one peer rank for one micro-batch round: the driver's small metadata.

    ``rows``: (sample id, rows) in the order the sender packed them; ``outputs``: (name, width, dtype) of each
    named output of those rows, in the order sent. The sender sends the token index of every row (int64 [n]),
    then one tensor [n, width] per output. Under an encoder's TP (the uniform baseline) the ranks of a replica
    agree: one sends, all take gradients."""

    module: str  # the sending group
    peer: int  # its global rank (the data plane's process groups span every actor)
    rows: tuple[tuple[int, int], ...]
    outputs: Outputs
    reply_to: tuple[int, ...] = ()  # global ranks the gradients of these rows go to (empty: ``peer``)
    # each receiving rank's own rows, where the ranks of a replica get different rows (Megatron SP: their
    # sequence slices): ((global rank, rows)...); empty: every rank of the replica receives ``rows``
    parts: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()

    @property
    def gradient_peers(self) -> tuple[int, ...]:
        return self.reply_to or (self.peer,)

    @property
    def sliced(self) -> bool:
        """Whether each receiving rank gets only its own rows (and sends back their gradients itself)."""
        return bool(self.parts)

    def for_receiver(self, rank: int) -> Incoming | None:
        """What global rank ``rank`` receives of this: itself (no ``parts``), its own part, or None (nothing)."""
        if not self.parts:
            return self
        rows = dict(self.parts).get(rank, ())
        return replace(self, rows=rows) if rows else None

    @property
    def n_rows(self) -> int:
        return sum(n for _, n in self.rows)

    @property
    def nbytes(self) -> int:
        return self.n_rows * (sum(w * _dtype(d).itemsize for _, w, d in self.outputs) + 8)


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"not a torch dtype: {name!r}")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class P2PChannel:
    """This rank's end of the point-to-point data plane: one process group per direction, pending sends."""

    def __init__(self, groups: dict[str, Any], device: torch.device) -> None:
        missing = set(DIRECTIONS) - set(groups)
        if missing:
            raise ValueError(f"data plane: no process group for {sorted(missing)}")
        self.groups, self.device = groups, device
        self._sending: list[tuple[list[Any], list[torch.Tensor]]] = []  # works and the buffers they read

    def send(self, direction: str, peer: int, tensors: list[torch.Tensor]) -> int:
        """Starts sending ``tensors`` to global rank ``peer``; returns the bytes. Never waits for the peer."""
        tensors = [t.detach().contiguous() for t in tensors]
        ops = [dist.P2POp(dist.isend, t, peer, self.groups[direction]) for t in tensors]
        self._sending.append((dist.batch_isend_irecv(ops), tensors))
        self._reap()
        return sum(t.numel() * t.element_size() for t in tensors)

    def receive(self, direction: str, incoming: list[Incoming],
                with_index: bool = True) -> tuple[list[tuple[torch.Tensor | None, dict[str, torch.Tensor]]], float]:
        """(token index, {output name: rows}) from each of ``incoming``'s peers, in its order; and the seconds
        spent waiting.

        ``with_index=False``: the peers send the rows only (gradients, in the order of rows already known)."""
        ops, out = [], []
        for inc in incoming:
            index = torch.empty(inc.n_rows, dtype=torch.int64, device=self.device) if with_index else None
            rows = {name: torch.empty(inc.n_rows, width, dtype=_dtype(dtype), device=self.device)
                    for name, width, dtype in inc.outputs}
            ops += [dist.P2POp(dist.irecv, t, inc.peer, self.groups[direction])
                    for t in ([index] if index is not None else []) + list(rows.values())]
            out.append((index, rows))
        t0 = time.perf_counter()
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        return out, time.perf_counter() - t0

    def _reap(self) -> None:
        """Forget sends that have completed (their buffers may go)."""
        self._sending = [(works, ts) for works, ts in self._sending if not all(w.is_completed() for w in works)]

    def drain(self) -> float:
        """Waits for every pending send (each was matched by its peer's receive within the step); seconds."""
        t0 = time.perf_counter()
        for works, _ in self._sending:
            for w in works:
                w.wait()
        self._sending = []
        return time.perf_counter() - t0


Named = dict[str, torch.Tensor]  # rows of each named output, every one [n, width_name]
Pieces = dict[int, tuple[torch.Tensor, Named]]  # sample id -> (token index, named rows)


def output_layout(named: Named) -> Outputs:
    """(name, width, dtype) of each named output, in its order: what a receiver sizes its buffers from."""
    return tuple((name, t.shape[-1], dtype_name(t.dtype)) for name, t in named.items())


def send_order(named: Named) -> list[torch.Tensor]:
    """The named rows as the wire carries them: one tensor per output, in the outputs' order."""
    return list(named.values())


def pack_rows(pieces: Pieces, sample_ids: list[int],
              device: torch.device) -> tuple[tuple[tuple[int, int], ...], torch.Tensor | None, Named | None]:
    """The rows of ``sample_ids`` this rank holds, in that order: ((sid, rows)...), token index, {name: rows}
    (or None)."""
    held = [i for i in sample_ids if i in pieces and len(pieces[i][0])]
    if not held:
        return (), None, None
    counts = tuple((i, len(pieces[i][0])) for i in held)
    index = torch.cat([pieces[i][0].to(device) for i in held])
    rows = {name: torch.cat([pieces[i][1][name] for i in held]) for name in pieces[held[0]][1]}
    return counts, index, rows


def split_named(counts: tuple[tuple[int, int], ...], rows: Named) -> dict[int, Named]:
    """{sample id: {name: its rows}} from rows packed sample after sample (split by host counts)."""
    sizes = [n for _, n in counts]
    parts = {name: t.split(sizes) for name, t in rows.items()}
    return {sid: {name: p[k] for name, p in parts.items()} for k, (sid, _) in enumerate(counts)}


def split_rows(counts: tuple[tuple[int, int], ...], index: torch.Tensor, rows: Named) -> Pieces:
    """Undo ``pack_rows``: {sample id: (token index, {name: rows})} (split by host counts: no device read)."""
    sizes = [n for _, n in counts]
    named = split_named(counts, rows)
    return {sid: (i, named[sid]) for (sid, _), i in zip(counts, index.split(sizes), strict=True)}


# ---- Megatron sequence parallelism: each text TP rank receives the rows of its own sequence slice -------------

def rows_by_receiver(pieces: Pieces, sample_ids: list[int], offsets: dict[int, int], slots: dict[int, torch.Tensor],
                     receivers: list[tuple[int, int, int]],
                     device: torch.device) -> list[tuple[int, tuple[tuple[int, int], ...], torch.Tensor, Named]]:
    """What each TP rank of a text replica under Megatron SP receives of this rank's rows of ``sample_ids``:
    (receiver, ((sid, rows)...), token index, {name: rows}) for every receiver that gets some, the rows of its
    sequence slice only (every named output cut the same way), in the order of ``sample_ids`` and of each
    sample's token index here.

    ``pieces``: {sid: (token index (host), {name: rows})} as ``pack_rows`` takes them; ``offsets[sid]``: where sample
    ``sid`` starts in the text replica's packed sequence; ``slots[sid]``: its placeholder positions in
    token-index order (``dhp.engine.slot_positions``); ``receivers``: (global rank, start, end) of each TP rank's
    slice of that sequence (``dhp.engine.sequence_slice``). Host metadata only: the selection is made on the
    host, the rows taken on the device with one ``index_select`` per sample and receiver."""
    out = []
    held = [i for i in sample_ids if i in pieces and len(pieces[i][0])]
    for receiver, lo, hi in receivers:
        counts, index, rows = [], [], []
        for sid in held:
            token_index, named = pieces[sid]
            pos = offsets[sid] + slots[sid][token_index]
            mine = ((pos >= lo) & (pos < hi)).nonzero().flatten()
            if len(mine):
                counts.append((sid, len(mine)))
                index.append(token_index[mine])
                rows.append({name: t.index_select(0, mine.to(t.device)) for name, t in named.items()})
        if counts:
            out.append((receiver, tuple(counts), torch.cat(index).to(device),
                        {name: torch.cat([r[name] for r in rows]) for name in rows[0]}))
    return out


# ---- CUDA IPC (workers sharing one GPU) --------------------------------------------------------------------

@dataclass(frozen=True)
class SharedCuda:
    """A CUDA tensor of another process on this GPU: ``torch.multiprocessing``'s rebuild function and its
    arguments (the memory handle, the producer's event, the reference count's handle)."""

    rebuild: Any
    args: tuple


def share_cuda(obj: Any) -> Any:
    """``obj`` with every CUDA tensor replaced by a ``SharedCuda`` handle (small: it travels through Ray)."""
    if isinstance(obj, torch.Tensor):
        if not obj.is_cuda:
            return obj
        from torch.multiprocessing.reductions import reduce_tensor

        rebuild, args = reduce_tensor(obj.detach().contiguous())
        return SharedCuda(rebuild, args)
    if isinstance(obj, dict):
        return {k: share_cuda(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(share_cuda(v) for v in obj)
    return obj


def open_cuda(obj: Any) -> Any:
    """Undo ``share_cuda`` in the consumer: each handle opened (after the producer's event) and copied into
    this process's memory, so the producer's block is released once the copy is made."""
    if isinstance(obj, SharedCuda):
        return obj.rebuild(*obj.args).clone()
    if isinstance(obj, dict):
        return {k: open_cuda(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(open_cuda(v) for v in obj)
    return obj


__all__ = ["DIRECTIONS", "Incoming", "Named", "Outputs", "P2PChannel", "Pieces", "SharedCuda", "dtype_name",
           "open_cuda", "output_layout", "pack_rows", "rows_by_receiver", "send_order", "share_cuda", "split_named",
           "split_rows"]
