"""A group's step time from what its rank dispatched (``GroupResult.ops``) and a device profile (``profile``).

Per micro-batch of a rank:

* each region between host syncs costs its device work (matmuls by shape from the profile's GEMM table,
  attention by kernel and shape, every other data-moving op's bytes over HBM) and its host work (ops x
  ``cpu_op_s`` + DTensor dispatches x ``dtensor_op_s`` + a sync): ``max(host, device)`` where the host runs
  ahead of the device (CUDA), their sum where it does the work itself (CPU);
* its collectives, ``alpha + bytes / beta`` per kind over the group they run in (TP/SP ranks; FSDP2's
  all-gathers and reduce-scatters over the data-parallel ranks), each by the fit of the path it was called by
  (the tally's functional collectives, DTensor's, by the profile's ``functional`` fits; the rest of the
  collective counter's by its ``c10d`` ones): exposed, except FSDP2's, which its prefetch overlaps with the
  compute on a device with streams (``async_launch``): hidden up to the compute's length;
* the router's transfer of the embeddings and their gradients (two transfers: point-to-point, or through Ray's
  object store for the ``ray`` data plane).

Per step: the replica's micro-batches, the gradient reduction's collectives (over dp, x sp for SP; the
engine runs it after the backward: exposed; back to back, the first in situ and the rest aligned:
``Profile.burst_s``) and the ops of ``finish_gradients`` and the optimizer step
(``GroupResult.step_ops``), priced as above.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dhp.plan.ops import functional_comm, parse_gemm_key
from dhp.plan.profile import C10D, FUNCTIONAL, Profile

_FSDP = ("all_gather", "reduce_scatter")


@dataclass
class GroupCost:
    """Seconds of one group's rank: per micro-batch (``*_mb``) and per step."""

    micro_batches: int = 0
    device_mb: float = 0.0  # matmuls, attention, memory-bound ops of one micro-batch
    host_mb: float = 0.0  # dispatch and host syncs of one micro-batch
    compute_mb: float = 0.0  # the regions: max or sum of the two above, region by region
    comm_exposed_mb: float = 0.0
    comm_hidden_mb: float = 0.0
    router_mb: float = 0.0
    micro_batch_s: float = 0.0  # compute + exposed collectives + router
    forward_mb: float = 0.0  # the forward's part of ``micro_batch_s`` less the router (an encoder's own call)
    backward_mb: float = 0.0  # the backward's part (the rest)
    forward_compute_mb: float = 0.0  # the forward's compute (what a full CPU host slows: ``Profile.busy_slowdown``)
    backward_compute_mb: float = 0.0
    reduce_s: float = 0.0  # the gradient reduction's collectives, once per step
    optimizer_s: float = 0.0  # finish_gradients' and the optimizer's ops, once per step
    step_s: float = 0.0
    # calls that wait for a peer rank (collectives of both paths; a point-to-point router transfer): what an
    # oversubscribed host adds to (``Profile.contention_wait_coefficient``, ``dhp.plan.schedule``)
    forward_waits_mb: float = 0.0
    backward_waits_mb: float = 0.0
    router_waits_mb: float = 0.0  # the router's two transfers, point-to-point only (``ray``: no peer waits)
    reduce_waits: float = 0.0  # the step's collectives (gradient reduction, ZeRO)

    def breakdown(self) -> dict[str, float]:
        """Per step: compute, communication exposed and hidden, router, gradient reduction, optimizer."""
        n = self.micro_batches
        return {"compute_s": n * self.compute_mb, "device_s": n * self.device_mb, "host_s": n * self.host_mb,
                "comm_exposed_s": n * self.comm_exposed_mb + self.reduce_s, "comm_hidden_s": n * self.comm_hidden_mb,
                "router_s": n * self.router_mb, "optimizer_s": self.optimizer_s, "busy_s": self.step_s}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def region_device_s(region: dict[str, float], p: Profile) -> float:
    """Device seconds of one region's tally (``ops.OpTally``)."""
    t = 0.0
    for key, v in region.items():
        if key.startswith("gemm|"):
            t += v * p.gemm_s(*parse_gemm_key(key))
        elif key.startswith("attn|"):
            _, kernel, s, d, dtype = key.split("|")
            t += p.attention_s(kernel, int(s), int(d), dtype, v)
        elif key == "mem_bytes":
            t += p.memory_s(v)
    return t


def regions_s(regions: list[dict[str, float]], p: Profile) -> tuple[float, float, float]:
    """(seconds, device seconds, host seconds) of a sequence of regions, each ended by a host sync but the
    last."""
    total = dev = host = 0.0
    for i, r in enumerate(regions):
        d = region_device_s(r, p)
        h = (r.get("ops", 0) * p.cpu_op_s + r.get("dtensor_ops", 0) * p.dtensor_op_s
             + (p.sync_s if i < len(regions) - 1 else 0.0))
        dev, host = dev + d, host + h
        total += max(d, h) if p.async_launch else d + h
    return total, dev, host


def collectives_s(comm: dict[str, float], calls: dict[str, float], ranks: int, p: Profile,
                  path: str = C10D) -> float:
    return sum(p.collective_s(kind, ranks, b, calls.get(kind, 1), path) for kind, b in comm.items())


def by_path(comm: dict[str, int], calls: dict[str, int],
            regions: list[dict[str, float]]) -> dict[str, tuple[dict[str, float], dict[str, float]]]:
    """``{path: (bytes per kind, calls per kind)}`` of a phase's collectives (``CommCounter``'s, every path
    together): the functional ones its tally ``regions`` saw (``ops.functional_comm``), ``c10d`` the rest."""
    f_bytes, f_calls = functional_comm(regions)
    rest = {k: b - f_bytes.get(k, 0) for k, b in comm.items() if b - f_bytes.get(k, 0) > 0}
    rest_calls = {k: max(0, c - f_calls.get(k, 0)) for k, c in calls.items()}
    return {C10D: (rest, rest_calls), FUNCTIONAL: (f_bytes, f_calls)}


def step_collectives_s(comm: dict[str, int], calls: dict[str, int], regions: list[dict[str, float]], ranks: int,
                       p: Profile) -> float:
    """Seconds of the collectives of a step's end (the gradient reduction, ZeRO-1's broadcasts, the norm): its
    ``c10d`` calls of each kind back to back (``Profile.burst_s``), its functional ones as any."""
    (c10d_bytes, c10d_calls), (f_bytes, f_calls) = (by_path(comm, calls, regions)[k] for k in (C10D, FUNCTIONAL))
    return (sum(p.burst_s(k, ranks, b, c10d_calls.get(k, 1)) for k, b in c10d_bytes.items())
            + collectives_s(f_bytes, f_calls, ranks, p, FUNCTIONAL))


def _phase(regions: list[dict[str, float]], comm: dict[str, int], calls: dict[str, int], job: Any,
           p: Profile) -> tuple[float, float, float, float, float]:
    """(compute, device, host, exposed collectives, hidden collectives) seconds of one phase of a micro-batch."""
    compute, device, host = regions_s(regions, p)
    fsdp_s = inner_s = 0.0
    for path, (b, c) in by_path(comm, calls, regions).items():
        b = dict(b)
        fsdp = {k: b.pop(k) for k in _FSDP if k in b} if job.zero == 3 else {}
        fsdp_s += collectives_s(fsdp, c, job.dp, p, path)
        if job.dp > 1:  # FSDP2's own work around each of its collectives (hooks, copies)
            fsdp_s += p.fsdp_call_s * sum(c.get(k, 1) for k, v in fsdp.items() if v > 0)
        inner_s += collectives_s(b, c, job.inner, p, path)
        if path == FUNCTIONAL and job.inner > 1:  # DTensor's redistributions around each TP collective
            inner_s += p.tp_call_s * sum(c.get(k, 1) for k, v in b.items() if v > 0)
    hidden = min(fsdp_s, compute) if p.async_launch else 0.0
    return compute, device, host, fsdp_s - hidden + inner_s, hidden


def _waits(comm: dict[str, int], calls: dict[str, int], ranks: int) -> float:
    """Collective calls that wait for a peer: those of kinds with payload in a group of more than one rank."""
    return float(sum(calls.get(k, 1) for k, b in comm.items() if b > 0)) if ranks > 1 else 0.0


def _less(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: v - b.get(k, 0) for k, v in a.items() if v - b.get(k, 0) > 0}


def group_cost(job: Any, r: Any, p: Profile, samples: int, router: Profile | None = None,
               data_plane: str = "p2p") -> GroupCost:
    """The cost of ``job``'s rank (``GroupResult`` ``r``) per step of ``samples`` samples over the whole run,
    on device profile ``p`` (``router``: the profile whose router fit prices the transfer between groups,
    default ``p``). The micro-batch is priced as its forward and its backward apart (the fake run cuts its
    tally there): an encoder runs them as two calls of the runtime's schedule (``dhp.plan.schedule``)."""
    c = GroupCost(micro_batches=math.ceil(samples / job.dp / job.micro_batch_size))
    cut = r.forward_regions
    fwd_comm = (r.forward_comm, r.forward_comm_calls)
    bwd_comm = (_less(r.comm, r.forward_comm), _less(r.comm_calls, r.forward_comm_calls))
    fwd, bwd = _phase(r.ops[:cut], *fwd_comm, job, p), _phase(r.ops[cut:], *bwd_comm, job, p)
    c.compute_mb, c.device_mb, c.host_mb, c.comm_exposed_mb, c.comm_hidden_mb = (
        f + b for f, b in zip(fwd, bwd, strict=True))
    c.forward_mb, c.backward_mb = fwd[0] + fwd[3], bwd[0] + bwd[3]
    c.forward_compute_mb, c.backward_compute_mb = fwd[0], bwd[0]
    c.router_mb = (router or p).router_s(r.router, 2.0, data_plane) if r.router else 0.0
    c.micro_batch_s = c.compute_mb + c.comm_exposed_mb + c.router_mb
    c.forward_waits_mb, c.backward_waits_mb = _waits(*fwd_comm, job.ranks), _waits(*bwd_comm, job.ranks)
    c.router_waits_mb = 2.0 if r.router and data_plane == "p2p" else 0.0
    reduce_n = job.dp * (job.inner if job.inner_kind == "sp" else 1)
    c.reduce_s = step_collectives_s(r.step_comm, r.step_comm_calls, r.step_ops, reduce_n, p)
    c.reduce_waits = _waits(r.step_comm, r.step_comm_calls, reduce_n)
    c.optimizer_s = regions_s(r.step_ops, p)[0]
    c.step_s = c.micro_batches * c.micro_batch_s + c.reduce_s + c.optimizer_s
    return c
