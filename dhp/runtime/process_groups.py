"""The torch process groups of all module groups, and the Ray collective that moves tensors between groups.

Why this shape (DESIGN.md, FACTS.md): every module (vision, text) trains with its
own parallelism, so each needs its own ``torch.distributed`` group; activations
move between the groups worker-to-worker (Ray Direct Transport), never through
the driver. On CPU, RDT over gloo needs one Ray collective group over all actors
of all modules, and that group runs on torch's default group with world = all
actors (ranks in list order). So the module groups are subgroups of that world,
created by ``dist.new_group`` on every actor in the same order. The default
group is made here first (``WorkerBase.dhp_init_world``), with its store bound
to the node's Ray IP, and Ray's collective then adopts it rather than
rendezvousing on a store that listens on every interface. On GPU each module
keeps its own NCCL default group (Ray's NCCL communicator is separate), which is
what the backend choice (``dhp.runtime.cluster.choose_backend``) encodes.
The point-to-point data plane (``dhp.runtime.data_plane``) needs groups that
span the sending and the receiving ranks: with it, GPU workers share one NCCL
world too, and every actor makes one more group per direction over all actors.
Works for any number of groups, of any sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.exceptions import RayTaskError

from dhp.runtime.cluster import DataPlane, Transport, resolve_data_plane, resolve_transport
from dhp.runtime.errors import WorkerError
from dhp.runtime.worker_group import WorkerGroup


@dataclass
class DistributedSetup:
    """What ``init_process_groups`` made: the backend, the RDT transport, the Ray collective (if any) and the
    data plane between the groups."""

    backend: str
    tensor_transport: str | None
    collective: Any = None
    data_plane: DataPlane = "ray"
    coordinates: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def init_process_groups(
    groups: Sequence[WorkerGroup], backend: str, transport: Transport = "auto", gpus_per_worker: float = 0.0,
    placement: str = "collocated",
) -> DistributedSetup:
    """Gives every group its process group and sets up tensor transport between groups.

    gloo (CPU): torch's default group over all actors, in group order, then one
    Ray collective group (torch_gloo) on it; then every actor creates every
    module's subgroup in the same order. nccl (GPU): each module gets its own
    NCCL default group; if tensors go by RDT, a Ray NCCL collective (a separate
    communicator) spans all actors; with the point-to-point data plane, one
    NCCL world over all actors instead, module groups as its subgroups (as on gloo).
    With the p2p data plane (``resolve_data_plane``), every actor then makes its two groups
    (``WorkerBase.dhp_init_data_plane``).
    """
    data_plane = resolve_data_plane(transport, placement, backend, gpus_per_worker)
    tensor_transport = resolve_transport(transport, backend, gpus_per_worker) if data_plane == "ray" else None
    actors = [a for g in groups for a in g.actors]
    setup = DistributedSetup(backend, tensor_transport, data_plane=data_plane)
    if backend == "gloo":
        _init_shared_world(groups, "gloo")
        setup.collective = _create_collective(actors, "torch_gloo")
        _setup_shared_world(groups, "gloo")
    elif data_plane == "p2p":
        _init_shared_world(groups, backend)
        _setup_shared_world(groups, backend)
    else:
        _setup_module_worlds(groups, backend)
        if tensor_transport is not None:
            setup.collective = _create_collective(actors, tensor_transport.lower())
    if data_plane == "p2p":
        refs = {g.module: [a.dhp_init_data_plane.remote(backend) for a in g.actors] for g in groups}
        for g in groups:
            g.get("dhp_init_data_plane", refs[g.module])
    for g in groups:
        g.tensor_transport = tensor_transport
        g.data_plane = data_plane
        setup.coordinates[g.module] = g.get("setup_distributed", [a.dhp_coordinates.remote() for a in g.actors])
    return setup


def module_ranks(groups: Sequence[WorkerGroup]) -> list[tuple[str, list[int]]]:
    """(module, global ranks) of every group in the shared world: the groups' ranks laid end to end, in order."""
    out: list[tuple[str, list[int]]] = []
    offset = 0
    for g in groups:
        out.append((g.module, list(range(offset, offset + g.n_ranks))))
        offset += g.n_ranks
    return out


def _init_shared_world(groups: Sequence[WorkerGroup], backend: str) -> None:
    """torch's default group over every actor of every group; the first actor serves the store."""
    world = sum(g.n_ranks for g in groups)
    master = groups[0].call_rank(0, "dhp_master_address")
    refs = {
        g.module: [a.dhp_init_world.remote(backend, master, r, world) for a, r in zip(g.actors, ranks, strict=True)]
        for g, (_, ranks) in zip(groups, module_ranks(groups), strict=True)
    }
    for g in groups:
        g.get("dhp_init_world", refs[g.module])


def _create_collective(actors: list[Any], backend: str) -> Any:
    from ray.experimental.collective import create_collective_group

    try:
        return create_collective_group(actors, backend=backend)
    except RayTaskError as e:
        raise WorkerError("collective", -1, "create_collective_group", str(e)) from None


def _setup_shared_world(groups: Sequence[WorkerGroup], backend: str) -> None:
    ranks = module_ranks(groups)
    refs = {g.module: [a.setup_distributed.remote(backend, ranks) for a in g.actors] for g in groups}
    for g in groups:
        g.get("setup_distributed", refs[g.module])


def _setup_module_worlds(groups: Sequence[WorkerGroup], backend: str) -> None:
    refs = {}
    for g in groups:
        master = g.call_rank(0, "dhp_master_address")
        refs[g.module] = [a.setup_distributed.remote(backend, None, master) for a in g.actors]
    for g in groups:
        g.get("setup_distributed", refs[g.module])


def forget_collective(collective: Any) -> None:
    """Drops the driver's record of a Ray collective whose actors are dead (no remote calls)."""
    try:
        from ray.experimental.collective.collective import RemoteCommunicatorManager

        RemoteCommunicatorManager.get().remove_remote_communicator(collective.name)
    except Exception:  # noqa: BLE001 - internal API; forgetting is best effort
        pass


__all__ = ["DistributedSetup", "forget_collective", "init_process_groups", "module_ranks"]
