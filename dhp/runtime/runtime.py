"""The lifecycle of a run's workers: Ray, the placement group, the module groups and their process groups.

``Runtime`` is the one object the driver holds: ``with Runtime(...) as rt:``
starts (or joins) Ray, reserves the placement, starts every module's group and
gives them their process groups; leaving the block, normally, by an exception
or by Ctrl-C, kills every actor and removes the placement group. Any number of
modules, of unequal sizes, collocated or disaggregated (``dhp.runtime.placement``).
"""

from __future__ import annotations

import atexit
import uuid
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup, remove_placement_group

from dhp.runtime.cluster import Transport, choose_backend, start_ray
from dhp.runtime.placement import (
    GroupResources,
    Placement,
    PlacementPlan,
    create_placement_groups,
    plan_placement,
)
from dhp.runtime.process_groups import DistributedSetup, forget_collective, init_process_groups
from dhp.runtime.worker_group import WorkerGroup, check_replica_size


@dataclass
class GroupSpec:
    """One group of workers (a module's): the worker class, how many ranks, constructor kwargs, ranks per
    data-parallel replica. (The family's ``dhp.models.spec.Module`` says what the module is; this, how many
    actors run it.)

    Replica ``r`` is ranks ``r*replica_size .. (r+1)*replica_size-1``; ``n_ranks``
    must be a multiple of ``replica_size`` (ValueError otherwise).
    """

    worker_cls: type
    n_ranks: int
    kwargs: dict[str, Any] | None = field(default_factory=dict)
    replica_size: int = 1

    def __post_init__(self) -> None:
        if self.kwargs is None:
            self.kwargs = {}
        check_replica_size(getattr(self.worker_cls, "__name__", "module"), self.n_ranks, self.replica_size)


class Runtime:
    """Owns Ray (if it started it), the placement group, the worker groups and their process groups.

    Use as ``with Runtime(...) as rt:``; leaving the block, normally, by an
    exception or by Ctrl-C, kills every actor and removes the placement group.
    """

    def __init__(
        self,
        modules: dict[str, GroupSpec],
        placement: Placement = "collocated",
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        transport: Transport = "auto",
        address: str | None = None,
        num_cpus: int | None = None,
        pg_timeout_s: float = 60.0,
        shutdown_ray: bool = True,
        resources: dict[str, GroupResources] | None = None,
        capacity_wait_s: float = 0.0,
    ):
        self.modules = modules
        self.plan: PlacementPlan = plan_placement(
            placement, {m: s.n_ranks for m, s in modules.items()}, cpus_per_worker, gpus_per_worker, resources
        )
        self.capacity_wait_s = capacity_wait_s  # a cluster that lost nodes: how long to wait for the layout to fit
        self.gpus_per_worker, self.transport = gpus_per_worker, transport
        self.address, self.num_cpus, self.pg_timeout_s = address, num_cpus, pg_timeout_s
        self.shutdown_ray = shutdown_ray
        self.backend = choose_backend(gpus_per_worker)
        self.groups: dict[str, WorkerGroup] = {}
        self.pgs: dict[str, PlacementGroup] = {}  # one per pool: per group (disaggregated) or one (collocated)
        self.setup: DistributedSetup | None = None
        self._owns_ray = False
        self.run_id = uuid.uuid4().hex[:8]

    def start(self) -> Runtime:
        self._owns_ray = start_ray(self.address, self.num_cpus)
        atexit.register(self.shutdown)
        try:
            self.pgs = create_placement_groups(self.plan, self.pg_timeout_s, self.capacity_wait_s)
            for m, spec in self.modules.items():
                local = {(m, r): self.plan.local_index((m, r)) for r in range(spec.n_ranks)}
                self.groups[m] = WorkerGroup(
                    spec.worker_cls, m, spec.n_ranks, self.pgs[self.plan.pool_of[m]], local, spec.kwargs,
                    self.plan.actor_resources, self.run_id, replica_size=spec.replica_size, bind=False,
                )
            for g in self.groups.values():  # every group's processes start together (imports take seconds)
                g.bind()
            self.setup = init_process_groups(list(self.groups.values()), self.backend, self.transport,
                                             self.gpus_per_worker, self.plan.placement)
        except BaseException:
            self.shutdown()
            raise
        return self

    def actor_per_node(self) -> dict[str, Any]:
        """One of this run's actors on each node that hosts some (from the placement groups' bundles)."""
        from ray.util import placement_group_table

        nodes = {pool: placement_group_table(pg).get("bundles_to_node_id", {}) for pool, pg in self.pgs.items()}
        out: dict[str, Any] = {}
        for m, g in self.groups.items():
            for r, actor in enumerate(g.actors):
                node = nodes[self.plan.pool_of[m]].get(self.plan.local_index((m, r)))
                if node is not None:
                    out.setdefault(node, actor)
        return out

    def __getitem__(self, module: str) -> WorkerGroup:
        return self.groups[module]

    def actors(self) -> list[Any]:
        return [a for g in self.groups.values() for a in g.actors]

    def shutdown(self) -> None:
        """Kills every actor, removes the placement group; idempotent."""
        if not ray.is_initialized():  # Ray already gone (atexit after ray.shutdown): so are the actors
            self.groups, self.pgs, self.setup = {}, {}, None
            atexit.unregister(self.shutdown)
            return
        for g in self.groups.values():
            g.kill()
        if self.setup is not None and self.setup.collective is not None:
            forget_collective(self.setup.collective)
        for pg in self.pgs.values():
            try:
                remove_placement_group(pg)
            except Exception:  # noqa: BLE001 - already removed
                pass
        self.pgs, self.setup = {}, None
        if self._owns_ray and self.shutdown_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False
        atexit.unregister(self.shutdown)

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["GroupSpec", "Runtime"]
