"""A group's step time from what its rank dispatched (``GroupResult.ops``) and a device profile (``profile``).

Per micro-batch of a rank:

* each region between host syncs costs its device work (matmuls by shape from the profile's GEMM table,
  attention by kernel and shape, every other data-moving op's bytes over HBM) and its host work (ops x
  ``cpu_op_s`` + a sync): ``max(host, device)`` where the host runs ahead of the device (CUDA), their sum
  where it does the work itself (CPU);
* its collectives, ``alpha + bytes / beta`` per kind over the group they run in (TP/SP ranks; FSDP2's
  all-gathers and reduce-scatters over the data-parallel ranks): exposed, except FSDP2's, which its prefetch
  overlaps with the compute on a device with streams (``async_launch``): hidden up to the compute's length;
* the router's transfer of the embeddings and their gradients (two transfers).

Per step: the replica's micro-batches, the gradient reduction's collectives (over dp, x sp for SP; the
engine runs it after the backward: exposed) and the ops of ``finish_gradients`` and the optimizer step
(``GroupResult.step_ops``), priced as above.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from dhp.plan.profile import Profile

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
    reduce_s: float = 0.0  # the gradient reduction's collectives, once per step
    optimizer_s: float = 0.0  # finish_gradients' and the optimizer's ops, once per step
    step_s: float = 0.0

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
            _, m, n, k, dtype = key.split("|")
            t += v * p.gemm_s(int(m), int(n), int(k), dtype)
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
        h = r.get("ops", 0) * p.cpu_op_s + (p.sync_s if i < len(regions) - 1 else 0.0)
        dev, host = dev + d, host + h
        total += max(d, h) if p.async_launch else d + h
    return total, dev, host


def collectives_s(comm: dict[str, int], calls: dict[str, int], ranks: int, p: Profile) -> float:
    return sum(p.collective_s(kind, ranks, b, calls.get(kind, 1)) for kind, b in comm.items())


def group_cost(job: Any, r: Any, p: Profile, samples: int, router: Profile | None = None) -> GroupCost:
    """The cost of ``job``'s rank (``GroupResult`` ``r``) per step of ``samples`` samples over the whole run,
    on device profile ``p`` (``router``: the profile whose router fit prices the transfer between groups,
    default ``p``)."""
    c = GroupCost(micro_batches=math.ceil(samples / job.dp / job.micro_batch_size))
    c.compute_mb, c.device_mb, c.host_mb = regions_s(r.ops, p)
    comm = dict(r.comm)
    fsdp = {k: comm.pop(k) for k in _FSDP if k in comm} if job.zero == 3 else {}
    fsdp_s = collectives_s(fsdp, r.comm_calls, job.dp, p)
    c.comm_hidden_mb = min(fsdp_s, c.compute_mb) if p.async_launch else 0.0
    c.comm_exposed_mb = fsdp_s - c.comm_hidden_mb + collectives_s(comm, r.comm_calls, job.inner, p)
    c.router_mb = (router or p).router_s(r.router, 2.0) if r.router else 0.0
    c.micro_batch_s = c.compute_mb + c.comm_exposed_mb + c.router_mb
    reduce_n = job.dp * (job.inner if job.inner_kind == "sp" else 1)
    c.reduce_s = collectives_s(r.step_comm, r.step_comm_calls, reduce_n, p)
    c.optimizer_s = regions_s(r.step_ops, p)[0]
    c.step_s = c.micro_batches * c.micro_batch_s + c.reduce_s + c.optimizer_s
    return c
