"""Where every worker runs: a placement plan checked against the cluster before any actor starts.

Placement is a choice (DESIGN.md): ``collocated`` puts rank i of every module in
bundle i, so vision rank i and text rank i share a device and take turns;
``disaggregated`` gives each (module, rank) its own bundle, so group sizes may
differ and the groups run concurrently. The plan is pure data, so a layout that
cannot fit is refused with the reason (``LayoutError``) before Ray is asked for
anything, and the placement group wait has a deadline instead of hanging.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

Placement = Literal["collocated", "disaggregated"]
Slot = tuple[str, int]  # (module, rank)


class LayoutError(RuntimeError):
    """A layout that cannot run on this cluster; the message says what is asked and what there is."""


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles to reserve and which bundle hosts each (module, rank)."""

    placement: Placement
    sizes: dict[str, int]
    bundles: list[dict[str, float]]
    bundle_of: dict[Slot, int]
    actor_resources: dict[Slot, ActorResources] = field(default_factory=dict)

    def total(self, resource: str) -> float:
        return sum(b.get(resource, 0.0) for b in self.bundles)

    def describe(self) -> str:
        parts = [f"{m}×{n}" for m, n in self.sizes.items()]
        return f"{self.placement} ({', '.join(parts)}; {len(self.bundles)} bundles)"


def plan_placement(
    placement: Placement, sizes: dict[str, int], cpus_per_worker: float, gpus_per_worker: float
) -> PlacementPlan:
    """Bundles for ``sizes`` ({module: n_ranks}) under ``placement``.

    collocated: bundle i holds rank i of every module having one; its CPUs are the
    sum over those workers; its GPUs are ``gpus_per_worker`` (one device slot),
    shared: each of its k workers asks ``gpus_per_worker / k``.
    disaggregated: one bundle of ``cpus_per_worker`` CPUs and ``gpus_per_worker``
    GPUs per (module, rank).
    """
    _check_inputs(placement, sizes, cpus_per_worker, gpus_per_worker)
    if placement == "collocated":
        return _collocated(sizes, cpus_per_worker, gpus_per_worker)
    return _disaggregated(sizes, cpus_per_worker, gpus_per_worker)


def _check_inputs(placement: str, sizes: dict[str, int], cpus: float, gpus: float) -> None:
    if placement not in ("collocated", "disaggregated"):
        raise LayoutError(f"placement must be 'collocated' or 'disaggregated', got {placement!r}")
    if not sizes:
        raise LayoutError("no modules to place")
    bad = {m: n for m, n in sizes.items() if not isinstance(n, int) or n < 1}
    if bad:
        raise LayoutError(f"every module needs at least one rank, got {bad}")
    if cpus < 0 or gpus < 0:
        raise LayoutError(f"cpus_per_worker and gpus_per_worker must be >= 0, got {cpus}, {gpus}")
    if gpus > 1 and gpus != int(gpus):
        raise LayoutError(f"gpus_per_worker above 1 must be a whole number, got {gpus}")


def _bundle(cpus: float, gpus: float) -> dict[str, float]:
    b = {"CPU": float(cpus)}
    if gpus > 0:
        b["GPU"] = float(gpus)
    return b


def _collocated(sizes: dict[str, int], cpus: float, gpus: float) -> PlacementPlan:
    bundles: list[dict[str, float]] = []
    bundle_of: dict[Slot, int] = {}
    res: dict[Slot, ActorResources] = {}
    for i in range(max(sizes.values())):
        members = [m for m, n in sizes.items() if i < n]
        for m in members:
            bundle_of[(m, i)] = i
            res[(m, i)] = ActorResources(cpus, gpus / len(members))
        bundles.append(_bundle(cpus * len(members), gpus))
    return PlacementPlan("collocated", dict(sizes), bundles, bundle_of, res)


def _disaggregated(sizes: dict[str, int], cpus: float, gpus: float) -> PlacementPlan:
    bundles: list[dict[str, float]] = []
    bundle_of: dict[Slot, int] = {}
    res: dict[Slot, ActorResources] = {}
    for m, n in sizes.items():
        for r in range(n):
            bundle_of[(m, r)] = len(bundles)
            res[(m, r)] = ActorResources(cpus, gpus)
            bundles.append(_bundle(cpus, gpus))
    return PlacementPlan("disaggregated", dict(sizes), bundles, bundle_of, res)


def device_slots(placement: Placement, sizes: dict[str, int]) -> int:
    """Bundles that hold a device under ``placement``: collocated ranks i of every module share one."""
    return max(sizes.values()) if placement == "collocated" else sum(sizes.values())


def decide_gpus_per_worker(requested: float | str, placement: Placement, sizes: dict[str, int],
                           cluster_gpus: float) -> float:
    """The GPUs each bundle asks for: ``requested`` as given when a number; for ``"auto"`` the cluster decides.

    auto: no GPU in the cluster: 0 (CPU, gloo). At least one GPU per bundle: 1 (each worker its own device,
    NCCL). Fewer GPUs than bundles: a share of a GPU per bundle, only when every module group has one rank (so
    no NCCL communicator holds two ranks on one device, which NCCL cannot do); otherwise ``LayoutError`` naming
    what was asked, what there is, and the fixes."""
    if requested != "auto":
        return float(requested)
    if cluster_gpus <= 0:
        return 0.0
    slots = device_slots(placement, sizes)
    if cluster_gpus + 1e-9 >= slots:
        return 1.0
    if all(n == 1 for n in sizes.values()):
        share = math.ceil(slots / cluster_gpus)
        return 1.0 / share
    layout = ", ".join(f"{m}×{n}" for m, n in sizes.items())
    raise LayoutError(
        f"runtime.gpus_per_worker=auto: the layout ({placement}: {layout}) needs {slots} GPUs, one per "
        f"{'rank i of the groups' if placement == 'collocated' else 'worker'}, but the Ray cluster has "
        f"{cluster_gpus:g}; lower the group sizes, use runtime.placement=collocated, or set "
        "runtime.gpus_per_worker=0 to train on CPU")


def check_fits(plan: PlacementPlan, cluster: dict[str, float], node_totals: list[dict[str, float]]) -> None:
    """Raises ``LayoutError`` if the plan can never fit: more in total than the cluster, or a bundle no node holds."""
    for resource in ("CPU", "GPU"):
        asked, have = plan.total(resource), cluster.get(resource, 0.0)
        if asked > have + 1e-9:
            raise LayoutError(
                f"layout {plan.describe()} asks for {asked:g} {resource}s in all but the Ray cluster has {have:g}; "
                f"lower runtime.cpus_per_worker/gpus_per_worker or the group sizes, or add nodes"
            )
    for i, b in enumerate(plan.bundles):
        if node_totals and not any(all(n.get(k, 0.0) + 1e-9 >= v for k, v in b.items()) for n in node_totals):
            raise LayoutError(f"layout {plan.describe()}: bundle {i} {b} does not fit on any single node")


def _node_totals() -> list[dict[str, float]]:
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def create_placement_group(
    plan: PlacementPlan, timeout_s: float = 60.0, strategy: str = "PACK"
) -> tuple[PlacementGroup, dict[Slot, int]]:
    """Reserves the plan's bundles; checks the fit first and never waits past ``timeout_s``."""
    check_fits(plan, ray.cluster_resources(), _node_totals())
    pg = placement_group(plan.bundles, strategy=strategy)
    start = time.monotonic()
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise LayoutError(
            f"placement group for {plan.describe()} not ready after {time.monotonic() - start:.0f} s: "
            f"asked {plan.bundles}, available now {_available()}; other jobs may hold the resources"
        )
    return pg, dict(plan.bundle_of)


def _available() -> dict[str, Any]:
    return {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
