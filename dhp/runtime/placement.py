"""Where every worker runs: a placement plan checked against the cluster before any actor starts.

Placement is a choice (DESIGN.md): ``collocated`` puts rank i of every module in
bundle i, so vision rank i and text rank i share a device and take turns;
``disaggregated`` gives each (module, rank) its own bundle, so group sizes may
differ and the groups run concurrently. The plan is pure data, so a layout that
cannot fit is refused with the reason (``LayoutError``) before Ray is asked for
anything, and the placement group wait has a deadline instead of hanging.

On a cluster each group may have its own resources (``GroupResources``: CPUs and
GPUs per worker, an accelerator type, custom node resources, node labels) and its
own policy (``pack``: as few nodes as fit; ``spread``: many). Under disaggregated
placement every group gets its own placement group, so vision can sit on one node
pool and the language model on another; collocated groups share bundles, so
their labels and policy must agree. ``check_fits`` places every bundle on the
alive nodes on paper first (labels matched as Ray matches them) and names the
group, what it asks and what the cluster has, before any worker starts.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

Placement = Literal["collocated", "disaggregated"]
Strategy = Literal["pack", "spread"]
Slot = tuple[str, int]  # (module, rank)
RAY_STRATEGY = {"pack": "PACK", "spread": "SPREAD"}
ACCELERATOR_PREFIX = "accelerator_type:"  # Ray's resource of a node's accelerator (ray.util.accelerators)
ACCELERATOR_SHARE = 0.001  # what ``accelerator_type=`` asks of it in Ray: the node must have one, nothing is used
ALL_GROUPS = "all"  # the one placement group of collocated placement


class LayoutError(RuntimeError):
    """A layout that cannot run on this cluster; the message says what is asked and what there is."""


@dataclass(frozen=True)
class ActorResources:
    num_cpus: float
    num_gpus: float


@dataclass(frozen=True)
class GroupResources:
    """What each worker of one group reserves, and on which nodes (``<module>.resources``, docs/cluster.md)."""

    num_cpus: float
    num_gpus: float
    accelerator_type: str | None = None
    label_selector: Mapping[str, str] = field(default_factory=dict)
    custom: Mapping[str, float] = field(default_factory=dict)
    strategy: Strategy = "pack"

    def worker_bundle(self) -> dict[str, float]:
        """One worker's reservation as a Ray bundle: CPU, GPU, custom resources, the accelerator type's marker."""
        b = _bundle(self.num_cpus, self.num_gpus)
        b.update({k: float(v) for k, v in self.custom.items()})
        if self.accelerator_type:
            b[ACCELERATOR_PREFIX + self.accelerator_type] = ACCELERATOR_SHARE
        return b


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles to reserve and which bundle hosts each (module, rank).

    ``pools``: the placement groups to make, each a name, its strategy and its bundles (indices into
    ``bundles``): one per group under disaggregated placement, one for all under collocated."""

    placement: Placement
    sizes: dict[str, int]
    bundles: list[dict[str, float]]
    bundle_of: dict[Slot, int]
    actor_resources: dict[Slot, ActorResources] = field(default_factory=dict)
    bundle_labels: list[dict[str, str]] = field(default_factory=list)
    bundle_groups: list[str] = field(default_factory=list)  # the group(s) each bundle serves, for messages
    pools: dict[str, tuple[Strategy, list[int]]] = field(default_factory=dict)
    pool_of: dict[str, str] = field(default_factory=dict)  # module -> its pool

    def total(self, resource: str) -> float:
        return sum(b.get(resource, 0.0) for b in self.bundles)

    def describe(self) -> str:
        parts = [f"{m}×{n}" for m, n in self.sizes.items()]
        return f"{self.placement} ({', '.join(parts)}; {len(self.bundles)} bundles)"

    def labels_of(self, i: int) -> dict[str, str]:
        return self.bundle_labels[i] if i < len(self.bundle_labels) else {}

    def group_of(self, i: int) -> str:
        return self.bundle_groups[i] if i < len(self.bundle_groups) else f"bundle {i}"

    def local_index(self, slot: Slot) -> int:
        """The index of ``slot``'s bundle inside its pool's placement group."""
        pool = self.pool_of.get(slot[0], ALL_GROUPS)
        return self.pools[pool][1].index(self.bundle_of[slot]) if self.pools else self.bundle_of[slot]


def plan_placement(
    placement: Placement, sizes: dict[str, int], cpus_per_worker: float, gpus_per_worker: float,
    resources: Mapping[str, GroupResources] | None = None,
) -> PlacementPlan:
    """Bundles for ``sizes`` ({module: n_ranks}) under ``placement``.

    ``resources`` ({module: GroupResources}) gives a group its own reservation and nodes; a group without an
    entry asks ``cpus_per_worker`` CPUs and ``gpus_per_worker`` GPUs per worker, on any node, packed.
    collocated: bundle i holds rank i of every module having one; its CPUs (and custom resources) are the
    sum over those workers; its GPUs are one device slot (the largest of its workers' GPUs), shared: each of
    its k workers asks a k-th of it. Its workers' labels and strategy must agree.
    disaggregated: one bundle per (module, rank), one placement group per module.
    """
    _check_inputs(placement, sizes, cpus_per_worker, gpus_per_worker)
    given = dict(resources or {})
    res = {m: given.get(m) or GroupResources(float(cpus_per_worker), float(gpus_per_worker)) for m in sizes}
    for m, r in res.items():
        _check_group(m, r)
    if placement == "collocated":
        return _collocated(sizes, res)
    return _disaggregated(sizes, res)


def _check_group(module: str, r: GroupResources) -> None:
    if r.num_cpus < 0 or r.num_gpus < 0:
        raise LayoutError(f"{module}: num_cpus and num_gpus per worker must be >= 0, got {r.num_cpus}, {r.num_gpus}")
    if r.num_gpus > 1 and r.num_gpus != int(r.num_gpus):
        raise LayoutError(f"{module}: num_gpus above 1 must be a whole number, got {r.num_gpus}")
    if r.strategy not in RAY_STRATEGY:
        raise LayoutError(f"{module}: strategy must be 'pack' or 'spread', got {r.strategy!r}")


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


def _collocated(sizes: dict[str, int], res: dict[str, GroupResources]) -> PlacementPlan:
    labels, strategy = _shared_nodes(sizes, res)
    bundles: list[dict[str, float]] = []
    bundle_of: dict[Slot, int] = {}
    actor: dict[Slot, ActorResources] = {}
    for i in range(max(sizes.values())):
        members = [m for m, n in sizes.items() if i < n]
        slot_gpus = max(res[m].num_gpus for m in members)
        bundle: dict[str, float] = {}
        for m in members:
            bundle_of[(m, i)] = i
            actor[(m, i)] = ActorResources(res[m].num_cpus, slot_gpus / len(members))
            for k, v in res[m].worker_bundle().items():
                if k == "GPU":
                    continue
                bundle[k] = max(bundle.get(k, 0.0), v) if k.startswith(ACCELERATOR_PREFIX) else bundle.get(k, 0.0) + v
        if slot_gpus > 0:
            bundle["GPU"] = slot_gpus
        bundles.append(bundle)
    n = len(bundles)
    return PlacementPlan("collocated", dict(sizes), bundles, bundle_of, actor, [dict(labels) for _ in range(n)],
                         ["+".join(m for m, k in sizes.items() if i < k) for i in range(n)],
                         {ALL_GROUPS: (strategy, list(range(n)))}, dict.fromkeys(sizes, ALL_GROUPS))


def _shared_nodes(sizes: dict[str, int], res: dict[str, GroupResources]) -> tuple[dict[str, str], Strategy]:
    """Collocated groups share bundles: one label set (their union, if no key disagrees) and one strategy."""
    labels: dict[str, str] = {}
    owner: dict[str, str] = {}
    for m in sizes:
        for k, v in res[m].label_selector.items():
            if k in labels and labels[k] != v:
                raise LayoutError(f"runtime.placement=collocated puts rank i of every group on one device, but "
                                  f"{owner[k]}.resources.label_selector.{k}={labels[k]!r} and "
                                  f"{m}.resources.label_selector.{k}={v!r} disagree; give them one node pool or "
                                  "use runtime.placement=disaggregated")
            labels[k], owner[k] = v, m
    accel = {m: res[m].accelerator_type for m in sizes if res[m].accelerator_type}
    if len(set(accel.values())) > 1:
        raise LayoutError(f"runtime.placement=collocated shares each device between the groups, but they ask for "
                          f"different accelerator types ({accel}); use runtime.placement=disaggregated")
    strategies = {m: res[m].strategy for m in sizes}
    if len(set(strategies.values())) > 1:
        raise LayoutError(f"runtime.placement=collocated places the groups' ranks together, but their "
                          f"resources.strategy differ ({strategies}); give every group the same one")
    return labels, next(iter(strategies.values()))


def _disaggregated(sizes: dict[str, int], res: dict[str, GroupResources]) -> PlacementPlan:
    bundles: list[dict[str, float]] = []
    bundle_of: dict[Slot, int] = {}
    actor: dict[Slot, ActorResources] = {}
    labels: list[dict[str, str]] = []
    groups: list[str] = []
    pools: dict[str, tuple[Strategy, list[int]]] = {}
    for m, n in sizes.items():
        r = res[m]
        pools[m] = (r.strategy, [])
        for rank in range(n):
            bundle_of[(m, rank)] = len(bundles)
            pools[m][1].append(len(bundles))
            actor[(m, rank)] = ActorResources(r.num_cpus, r.num_gpus)
            bundles.append(r.worker_bundle())
            labels.append(dict(r.label_selector))
            groups.append(m)
    return PlacementPlan("disaggregated", dict(sizes), bundles, bundle_of, actor, labels, groups, pools,
                         {m: m for m in sizes})


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


@dataclass(frozen=True)
class NodeInfo:
    """An alive Ray node as placement sees it: its id, address, total resources and labels."""

    node_id: str
    ip: str
    resources: dict[str, float]
    labels: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        shown = {k: v for k, v in self.resources.items() if not k.startswith("node:") and k not in
                 ("memory", "object_store_memory")}
        labels = {k: v for k, v in self.labels.items() if not k.startswith("ray.io/")}
        return f"{self.node_id[:8]} ({_fmt(shown)}{'; labels ' + _fmt(labels) if labels else ''})"


def label_matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node's ``labels`` satisfy ``selector`` as Ray's label selectors read it: ``value`` (equal),
    ``!value`` (not equal, or absent), ``in(a,b)`` (one of), ``!in(a,b)`` (none of)."""
    for key, want in selector.items():
        have = labels.get(key)
        negate = want.startswith("!")
        expr = want[1:] if negate else want
        options = [x.strip() for x in expr[3:-1].split(",")] if expr.startswith("in(") and expr.endswith(")") \
            else [expr]
        if (have in options) == negate:
            return False
    return True


def check_fits(plan: PlacementPlan, cluster: dict[str, float], node_totals: list[dict[str, float]] | None = None,
               nodes: list[NodeInfo] | None = None) -> None:
    """Raises ``LayoutError`` if the plan can never fit: more in total than the cluster, a group's worker that no
    node could host (its labels, resources, accelerator), or groups that together do not fit the nodes; the
    message names the group, what it asks and what the cluster has. ``nodes`` (with labels) or ``node_totals``
    (resources only) are the alive nodes; with neither, only the totals are checked."""
    for resource in ("CPU", "GPU"):
        asked, have = plan.total(resource), cluster.get(resource, 0.0)
        if asked > have + 1e-9:
            raise LayoutError(
                f"layout {plan.describe()} asks for {asked:g} {resource}s in all but the Ray cluster has {have:g}; "
                f"lower runtime.cpus_per_worker/gpus_per_worker (or <module>.resources) or the group sizes, or "
                f"add nodes{_per_group(plan, resource)}"
            )
    if nodes is None:
        nodes = [NodeInfo(f"node{i}", "?", dict(t)) for i, t in enumerate(node_totals or [])]
    if not nodes:
        return
    for i, b in enumerate(plan.bundles):
        if not _candidates(b, plan.labels_of(i), nodes, [n.resources for n in nodes]):
            raise LayoutError(_no_node(plan, i, nodes))
    _assign(plan, nodes)


def _assign(plan: PlacementPlan, nodes: list[NodeInfo]) -> list[int]:
    """Every bundle on a node, on paper (best fit, in plan order); LayoutError naming the group that does not
    fit beside the groups before it. Returns the node index of every bundle."""
    free = [dict(n.resources) for n in nodes]
    where: list[int] = []
    for i, b in enumerate(plan.bundles):
        fits = _candidates(b, plan.labels_of(i), nodes, free)
        if not fits:
            group = plan.group_of(i)
            before = sorted({plan.group_of(j) for j in range(i) if plan.group_of(j) != group})
            mine = [j for j in range(len(plan.bundles)) if plan.group_of(j) == group]
            raise LayoutError(
                f"{group}: its {len(mine)} workers ({_fmt(b)} each{_on(plan.labels_of(i))}) do not all fit on the "
                f"alive nodes{' beside ' + ', '.join(before) if before else ''}: worker {mine.index(i)} finds no "
                f"room; nodes: {'; '.join(n.describe() for n in nodes)}. Lower the group's size or its "
                "resources, or add nodes")
        k = min(fits, key=lambda n: sum(free[n].get(r, 0.0) for r in b))
        for r, v in b.items():
            free[k][r] = free[k].get(r, 0.0) - v
        where.append(k)
    return where


def _candidates(bundle: dict[str, float], labels: Mapping[str, str], nodes: list[NodeInfo],
                free: list[dict[str, float]]) -> list[int]:
    return [k for k, n in enumerate(nodes) if label_matches(labels, n.labels)
            and all(free[k].get(r, 0.0) + 1e-9 >= v for r, v in bundle.items())]


def _no_node(plan: PlacementPlan, i: int, nodes: list[NodeInfo]) -> str:
    b, labels, group = plan.bundles[i], plan.labels_of(i), plan.group_of(i)
    labelled = [n for n in nodes if label_matches(labels, n.labels)]
    if not labelled:
        seen = sorted({f"{k}={v}" for n in nodes for k, v in n.labels.items() if not k.startswith("ray.io/")})
        return (f"{group}: no alive node has the labels {_fmt(labels)} its resources.label_selector asks for "
                f"(labels the nodes have: {', '.join(seen) or 'none'}); start nodes with those labels "
                f"(ray start --labels=...) or change {' / '.join(f'{m}.resources' for m in group.split('+'))}"
                ".label_selector")
    lacking = sorted({r for r, v in b.items() for n in labelled if n.resources.get(r, 0.0) + 1e-9 < v})
    what = ", ".join(_resource_name(r) for r in lacking)
    keys = " / ".join(f"{m}.resources" for m in group.split("+"))
    return (f"{group}: each {'bundle' if '+' in group else 'worker'} asks {_fmt(b)}{_on(labels)}, which does not "
            f"fit on any single node (short of {what}); nodes: {'; '.join(n.describe() for n in labelled)}. Lower "
            f"{keys} (or runtime.cpus_per_worker/gpus_per_worker), or add a node that has it")


def _resource_name(r: str) -> str:
    if r.startswith(ACCELERATOR_PREFIX):
        return f"accelerator type {r[len(ACCELERATOR_PREFIX):]}"
    return r


def _per_group(plan: PlacementPlan, resource: str) -> str:
    asked: dict[str, float] = {}
    for i, b in enumerate(plan.bundles):
        asked[plan.group_of(i)] = asked.get(plan.group_of(i), 0.0) + b.get(resource, 0.0)
    return f" (by group: {_fmt(asked)})" if len(asked) > 1 else ""


def _on(labels: Mapping[str, str]) -> str:
    return f" on nodes labelled {_fmt(labels)}" if labels else ""


def _fmt(d: Mapping[str, Any]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" if isinstance(v, float) else f"{k}: {v}" for k, v in d.items()) + "}"


def alive_nodes() -> list[NodeInfo]:
    """The alive nodes of the Ray cluster this process is connected to, with their resources and labels."""
    return [NodeInfo(n["NodeID"], n.get("NodeManagerAddress", "?"), dict(n.get("Resources", {})),
                     dict(n.get("Labels") or {})) for n in ray.nodes() if n.get("Alive")]


def lost_nodes() -> int:
    """Nodes the cluster has had that are no longer alive (a node lost mid-run, or one taken away)."""
    return sum(1 for n in ray.nodes() if not n.get("Alive"))


def wait_for_fit(plan: PlacementPlan, wait_s: float, poll_s: float = 2.0, log: Any = print) -> None:
    """``check_fits`` against the alive nodes; on a cluster that has lost nodes, retried for up to ``wait_s``
    seconds (capacity may come back: a replaced node, an autoscaler), with a message; else raised at once."""
    deadline = time.monotonic() + wait_s
    told = False
    while True:
        try:
            check_fits(plan, ray.cluster_resources(), nodes=alive_nodes())
            return
        except LayoutError as e:
            if wait_s <= 0 or not lost_nodes() or time.monotonic() >= deadline:
                if told:
                    raise LayoutError(f"{e} (waited {wait_s:g} s for capacity: runtime.capacity_wait_s)") from None
                raise
            if not told:
                log(f"dhp: the cluster has lost {lost_nodes()} node(s) and the layout does not fit the rest: "
                    f"waiting up to {wait_s:g} s (runtime.capacity_wait_s) for capacity; {e}")
                told = True
        time.sleep(poll_s)


def create_placement_groups(
    plan: PlacementPlan, timeout_s: float = 60.0, capacity_wait_s: float = 0.0,
) -> dict[str, PlacementGroup]:
    """Reserves the plan's pools, one placement group each (its strategy, its bundles' labels); checks the fit
    first (``wait_for_fit``) and never waits past ``timeout_s`` for a reservation."""
    wait_for_fit(plan, capacity_wait_s)
    pools = plan.pools or {ALL_GROUPS: ("pack", list(range(len(plan.bundles))))}
    made: dict[str, PlacementGroup] = {}
    try:
        for name, (strategy, members) in pools.items():
            selectors = [plan.labels_of(i) for i in members]
            made[name] = placement_group([plan.bundles[i] for i in members], strategy=RAY_STRATEGY[strategy],
                                         **({"bundle_label_selector": selectors} if any(selectors) else {}))
        start = time.monotonic()
        for name, pg in made.items():
            left = max(0.0, timeout_s - (time.monotonic() - start))
            ready, _ = ray.wait([pg.ready()], timeout=left)
            if not ready:
                raise LayoutError(
                    f"placement group of {name} for {plan.describe()} not ready after "
                    f"{time.monotonic() - start:.0f} s: asked {[plan.bundles[i] for i in pools[name][1]]}, "
                    f"available now {_available()}; other jobs may hold the resources")
    except BaseException:
        for pg in made.values():
            remove_placement_group(pg)
        raise
    return made


def create_placement_group(
    plan: PlacementPlan, timeout_s: float = 60.0, strategy: str = "PACK"
) -> tuple[PlacementGroup, dict[Slot, int]]:
    """One placement group for all of the plan's bundles (no per-group pools); checks the fit first and never
    waits past ``timeout_s``."""
    check_fits(plan, ray.cluster_resources(), nodes=alive_nodes())
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
