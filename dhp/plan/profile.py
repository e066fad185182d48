"""A device profile: what one device does per second, measured (``dhp plan calibrate``) or from its roofline.

The planner's step time prices every op a rank dispatches (``dhp.plan.ops``, ``dhp.plan.costs``); a profile
says what each costs on one device:

* ``gemm``: achieved FLOP/s of matmuls by (M, N, K, dtype, layout), measured at a grid of shapes and
  interpolated in log space (inverse-distance weights over the nearest measured shapes of the dtype and layout).
  The layout says which operands ``mm`` is handed transposed (``ops.gemm_layout``: ``nt`` is ``x @ w.t()``, a
  linear's forward on its weight as DTensor's shard or ``F.linear`` presents it; ``tn`` a weight gradient); a
  profile without rows of a layout (written before layouts were measured) prices it by its ``nn`` rows;
* ``attention``: achieved FLOP/s of attention by kernel family, key length and head width;
* ``hbm_bytes_per_s``: what memory-bound ops (elementwise, norms, copies, the optimizer) stream;
* ``cpu_op_s``, ``dtensor_op_s``, ``sync_s``: the host's cost of dispatching one op, of DTensor's dispatch of
  one op on top of it, and of one host sync; ``async_launch`` says
  whether the host runs ahead of the device (CUDA: a region between syncs costs max(host, device)) or does the
  work itself (CPU: host + device);
* ``collectives``: ``alpha + bytes / beta`` per collective kind, group size and *path* (least squares over
  several sizes, ``fit_alpha_beta``), bytes being the payload a rank hands to the collective (``CommCounter``'s).
  The path is how the code calls it: ``c10d`` (``torch.distributed.all_reduce``...: FSDP2, Ulysses, the
  gradient reduction) or ``functional`` (``torch.distributed._functional_collectives`` and its
  ``wait_tensor``: DTensor's redistributions, i.e. TP); a profile without functional fits prices both by the
  ``c10d`` ones; ``burst``: ``c10d`` calls back to back, with no compute between them (a step's end: the
  gradient reduction's buckets, ZeRO-1's broadcasts), which meet their peers aligned after the first
  (``burst_s``); ``router``: the same for a point-to-point transfer between groups;
* ``contention_wait_s``, ``contention_ratio``: on a CPU host, what one collective call costs beyond processor
  sharing when the host's processes outnumber its cores (a rank waits for its peer's process to be scheduled),
  measured at ``contention_ratio`` processes per core (``calibrate.measure_contention``); the replay
  (``dhp.plan.schedule``) scales it by the share of time a peer is off its core, ``1 - cores / demand``;
* ``busy_slowdown``: on a CPU host, how much slower compute runs when every core computes than in one process
  alone, where the tables were measured (shared caches and memory bandwidth; ``calibrate.measure_busy``): the
  replay slows the calls on a host pool by it as the pool fills (``dhp.plan.schedule.run_rate``).

Without a calibrated profile the GPU rows use ``roofline(device)``: matmuls and attention at the device
table's peak times its stated efficiency, or its HBM bandwidth where that binds; collectives as ring
algorithms at the table's link bandwidth with no latency; no host cost. Every output says which it used.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dhp.observe.devices import Device
from dhp.storage import dhp_cache

ROOFLINE = "roofline"
CALIBRATED = "calibrated"


@dataclass(frozen=True)
class GemmPoint:
    m: int
    n: int
    k: int
    dtype: str
    flops_per_s: float
    layout: str = "nn"  # ``ops.gemm_layout``: which of (A, B) ``mm`` was handed transposed


GEMM_LAYOUTS = ("nn", "nt", "tn", "tt")
C10D, FUNCTIONAL, BURST = "c10d", "functional", "burst"


@dataclass(frozen=True)
class AttentionPoint:
    kernel: str  # ``ops.kernel_class``: sdpa_flash, varlen_flash...
    s: int  # key length
    d: int  # head width
    dtype: str
    flops_per_s: float


@dataclass(frozen=True)
class CollectiveFit:
    kind: str  # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send
    ranks: int
    alpha_s: float
    beta_bytes_per_s: float
    path: str = C10D  # C10D | FUNCTIONAL: how the collective was called (see the module docstring)


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha seconds, beta bytes/s) of ``seconds = alpha + bytes / beta``, least squares over ``(bytes,
    seconds)`` points (at least two distinct sizes). A negative intercept (noise at small sizes) is clamped
    to zero and the slope refitted through the origin; a slope that is not positive (time not growing with
    the bytes: noise larger than the transfer) is an error naming the points."""
    if len({b for b, _ in points}) < 2:
        raise ValueError(f"fit_alpha_beta: need points at two or more sizes, got {points}")
    n = len(points)
    mx = sum(b for b, _ in points) / n
    my = sum(t for _, t in points) / n
    sxx = sum((b - mx) ** 2 for b, _ in points)
    slope = sum((b - mx) * (t - my) for b, t in points) / sxx
    alpha = my - slope * mx
    if alpha < 0:
        alpha = 0.0
        slope = sum(b * t for b, t in points) / sum(b * b for b, _ in points)
    if slope <= 0:
        raise ValueError(f"fit_alpha_beta: time does not grow with bytes in {points}; measure larger sizes")
    return alpha, 1.0 / slope


def ring_factor(kind: str, ranks: int) -> float:
    """Bytes a ring algorithm moves per payload byte per rank (all-reduce ``2(n-1)/n``, all-gather ``n-1``
    (its payload is the rank's shard), reduce-scatter and all-to-all ``(n-1)/n``, point-to-point 1)."""
    n = max(1, ranks)
    if n == 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "all_gather": n - 1.0, "reduce_scatter": (n - 1) / n,
            "all_to_all": (n - 1) / n}.get(kind, 1.0)


@dataclass
class Profile:
    """One device's costs (see the module docstring); ``save``/``load`` as JSON."""

    name: str
    source: str = ROOFLINE  # ROOFLINE | CALIBRATED
    device_type: str = "cuda"  # cuda | cpu
    machine: str = ""
    created: str = ""
    peak_flops: float = 0.0  # the roofline's compute ceiling (peak x efficiency)
    hbm_bytes_per_s: float = 0.0
    link_bytes_per_s: float = 0.0  # the roofline's collectives and router
    cpu_op_s: float = 0.0
    dtensor_op_s: float = 0.0  # DTensor's Python dispatch of one op, beyond its local op's ``cpu_op_s``
    sync_s: float = 0.0
    fsdp_call_s: float = 0.0  # FSDP2's cost per all-gather / reduce-scatter beyond its in-situ fit (a CPU host)
    tp_call_s: float = 0.0  # a TP (DTensor) collective's cost beyond its in-situ fit and dispatch (a CPU host)
    async_launch: bool = True
    gemm: list[GemmPoint] = field(default_factory=list)
    attention: list[AttentionPoint] = field(default_factory=list)
    collectives: list[CollectiveFit] = field(default_factory=list)
    router: CollectiveFit | None = None
    cores: int = 0  # a CPU profile: the host's cores, and the threads each measurement ran on
    threads: int = 0
    actor_call_s: float = 0.0  # the runtime's hop: one group's call ending to the next's starting (``plan.hop``)
    busy_call_s: float = 0.0  # the same hop with every core of a CPU host busy (0: not measured, ``actor_call_s``)
    object_store: CollectiveFit | None = None  # a tensor through Ray's object store, worker to worker
    contention_wait_s: float = 0.0  # a collective call's wait beyond processor sharing on an oversubscribed host
    contention_ratio: float = 0.0  # ... measured at this many processes per core (0: not measured)
    busy_slowdown: float = 1.0  # a CPU host's compute with every core busy, against one process alone (measured)

    @property
    def label(self) -> str:
        return f"{self.source} {self.name}" + (f" ({self.machine}, {self.created})" if self.machine else "")

    # ---- JSON ----------------------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        d = dict(d)
        d["gemm"] = [GemmPoint(**p) for p in d.get("gemm", [])]
        d["attention"] = [AttentionPoint(**p) for p in d.get("attention", [])]
        d["collectives"] = [CollectiveFit(**p) for p in d.get("collectives", [])]
        d["router"] = CollectiveFit(**d["router"]) if d.get("router") else None
        d["object_store"] = CollectiveFit(**d["object_store"]) if d.get("object_store") else None
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"device profile: unknown fields {sorted(unknown)}; written by a newer dhp?")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1))

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a dhp device profile ({e}); write one with `dhp plan calibrate "
                             f"--out {path}`") from None

    # ---- costs ---------------------------------------------------------------------------------------------------

    def gemm_s(self, m: float, n: float, k: float, dtype: str, layout: str = "nn") -> float:
        """Seconds of one (M x K) @ (K x N) matmul with its operands in ``layout`` (``ops.gemm_layout``): the
        rows of that dtype and layout, else (a profile that did not measure the layout) of the dtype's ``nn``."""
        flops = 2.0 * m * n * k
        of_dtype = [p for p in self.gemm if p.dtype == dtype]
        pts = ([p for p in of_dtype if p.layout == layout] or [p for p in of_dtype if p.layout == "nn"] or of_dtype
               or self.gemm)
        if not pts:
            size = 2 if "16" in dtype else 4 if "32" in dtype else 8 if "64" in dtype else 1
            return max(flops / self.peak_flops, size * (m * k + k * n + m * n) / self.hbm_bytes_per_s)
        x = (math.log(max(m, 1)), math.log(max(n, 1)), math.log(max(k, 1)))
        rate = _idw(x, [((math.log(p.m), math.log(p.n), math.log(p.k)), p.flops_per_s) for p in pts])
        return flops / rate

    def attention_s(self, kernel: str, s: float, d: float, dtype: str, flops: float) -> float:
        """Seconds of attention work of ``flops`` FLOPs by ``kernel`` at key length ``s``, head width ``d``."""
        pts = ([p for p in self.attention if p.kernel == kernel and p.dtype == dtype]
               or [p for p in self.attention if p.kernel == kernel] or self.attention)
        if not pts:
            return flops / self.peak_flops
        x = (math.log(max(s, 1)), math.log(max(d, 1)))
        return flops / _idw(x, [((math.log(p.s), math.log(p.d)), p.flops_per_s) for p in pts])

    def memory_s(self, nbytes: float) -> float:
        return nbytes / self.hbm_bytes_per_s

    def collective_s(self, kind: str, ranks: int, nbytes: float, calls: float, path: str = C10D) -> float:
        """Seconds of ``calls`` collectives of ``kind`` over ``ranks`` moving ``nbytes`` of payload in all,
        called by ``path`` (``c10d`` or ``functional``; a profile without fits of that path: the ``c10d`` ones).
        A group size not calibrated takes the nearest one's fit, scaled by the ring algorithm's factors (latency
        by the steps ``n - 1``, bandwidth by ``ring_factor``)."""
        if ranks <= 1 or (nbytes <= 0 and calls <= 0):
            return 0.0
        on_path = [f for f in self.collectives if f.path == path]
        if path != C10D and not on_path:
            on_path = [f for f in self.collectives if f.path == C10D]
        fits = [f for f in on_path if f.kind == kind] or [f for f in on_path if f.kind == "all_reduce"]
        if not fits:
            return nbytes * ring_factor(kind, ranks) / self.link_bytes_per_s
        f = min(fits, key=lambda f: (abs(math.log(f.ranks / ranks)), -f.ranks))
        lat = (ranks - 1) / max(1, f.ranks - 1)
        bw = ring_factor(kind, ranks) / max(ring_factor(f.kind, f.ranks), 1e-12)
        return calls * f.alpha_s * lat + nbytes * bw / f.beta_bytes_per_s

    def burst_s(self, kind: str, ranks: int, nbytes: float, calls: float) -> float:
        """Seconds of ``calls`` ``c10d`` collectives of ``kind`` back to back, ``nbytes`` in all: the first at its
        in-situ fit (the ranks arrive apart), the rest at the ``burst`` fit (aligned by the one before); a profile
        without burst fits prices all in situ."""
        if calls <= 1:
            return self.collective_s(kind, ranks, nbytes, calls, C10D)
        each = nbytes / calls
        return (self.collective_s(kind, ranks, each, 1, C10D)
                + self.collective_s(kind, ranks, nbytes - each, calls - 1, BURST))

    def contention_wait_coefficient(self) -> float:
        """Seconds one collective call waits, beyond processor sharing, per unit of the share of time its peers
        are off their cores: the calibrated ``contention_wait_s`` over that share at the calibration,
        ``1 - 1 / contention_ratio`` (0 where not measured). The replay multiplies it by ``1 - cores / demand``."""
        if self.contention_ratio <= 1.0 or self.contention_wait_s <= 0.0:
            return 0.0
        return self.contention_wait_s / (1.0 - 1.0 / self.contention_ratio)

    def router_s(self, nbytes: float, calls: float = 1.0, data_plane: str = "p2p") -> float:
        """Seconds of the router's ``calls`` transfers of ``nbytes`` in all: point-to-point (``p2p``), or through
        Ray (``ray``: the object store's fit where calibrated, else the point-to-point one)."""
        fit = self.object_store if data_plane == "ray" and self.object_store else self.router
        if fit is None:
            return nbytes / self.link_bytes_per_s
        return calls * fit.alpha_s + nbytes / fit.beta_bytes_per_s


def _idw(x: tuple[float, ...], pts: list[tuple[tuple[float, ...], float]], k: int = 4) -> float:
    """Inverse-distance-weighted value at ``x`` from the ``k`` nearest points (an exact hit: its value)."""
    near = sorted(((math.dist(x, p), v) for p, v in pts), key=lambda t: t[0])[:k]
    if near[0][0] < 1e-9:
        return near[0][1]
    w = [1.0 / d**2 for d, _ in near]
    return sum(wi * v for wi, (_, v) in zip(w, near, strict=True)) / sum(w)


def machine_profile_path(device_type: str) -> Path:
    """Where ``dhp plan calibrate`` keeps the profile of this machine's ``device_type`` (``cpu`` or ``cuda``), which
    ``dhp bench`` prices its layouts with when no ``--profile`` is given: ``$DHP_CACHE/profiles/<device_type>.json``
    (default ``~/.cache/dhp/profiles``)."""
    return dhp_cache("profiles") / f"{device_type}.json"


def machine_profile(device_type: str) -> Path | None:
    """This machine's calibrated profile of ``device_type`` if ``dhp plan calibrate`` has written one, else None."""
    path = machine_profile_path(device_type)
    return path if path.is_file() else None


def roofline(dev: Device) -> Profile:
    """The profile of a device from its table entry alone (``dhp.observe.devices``): see the module docstring."""
    return Profile(name=dev.name, source=ROOFLINE, device_type="cuda", peak_flops=dev.peak_flops * dev.efficiency,
                   hbm_bytes_per_s=dev.memory_bw_gbs * 1e9, link_bytes_per_s=dev.link_gbs * 1e9, async_launch=True)
