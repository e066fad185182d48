"""Worker groups: one group of Ray actors per model module, each with its own torch process group.

Why this shape (DESIGN.md, FACTS.md): every module (vision, text) trains with its
own parallelism, so each needs its own ``torch.distributed`` group; activations
move between the groups worker-to-worker (Ray Direct Transport), never through
the driver. On CPU, RDT over gloo needs one Ray collective group over all actors
of all modules, and creating it initializes torch's default group with world =
all actors (ranks in list order). So the module groups are subgroups of that
world, created by ``dist.new_group`` on every actor in the same order. On GPU
each module keeps its own NCCL default group (Ray's NCCL communicator is
separate), which is what the backend choice below encodes.

Failures are loud: an exception in a worker reaches the driver as a
``WorkerError`` that names module, rank and method and carries the worker's
traceback; ``Runtime`` kills every actor and frees the placement group on exit,
including on Ctrl-C.
"""

from __future__ import annotations

import atexit
import os
import re
import socket
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dhp.runtime.dispatch import collect, is_tensor_producer, mode_of, split_args
from dhp.runtime.placement import (
    ActorResources,
    LayoutError,
    Placement,
    PlacementPlan,
    Slot,
    create_placement_group,
    plan_placement,
)

Transport = Literal["auto", "direct", "object_store"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
TRANSPORT_METADATA_TIMEOUT_S = 120.0  # from a call's end to its RDT metadata reaching the driver: normally ms
TRANSPORT_METADATA_GRACE_S = 5.0  # ... after which the driver checks whether the call failed


class WorkerError(RuntimeError):
    """A worker method failed; the message names module, rank and method and holds the worker's traceback."""

    def __init__(self, module: str, rank: int, method: str, detail: str):
        self.module, self.rank, self.method = module, rank, method
        # Ray colours its traceback and leaves caret lines of the internal frames it hides: drop both.
        detail = "\n".join(ln for ln in _ANSI.sub("", detail).splitlines() if ln.strip(" ^~"))
        super().__init__(f"{module} rank {rank} failed in {method}(); worker traceback:\n{detail}")


# ----------------------------------------------------------------------------- Ray start / join


def start_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Starts a local Ray (address None and no RAY_ADDRESS) or joins one ("auto", host:port, RAY_ADDRESS).

    Idempotent: if Ray is already initialized in this process nothing happens.
    Returns True when this call started Ray (the caller then owns its shutdown).
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        ray.init(num_cpus=num_cpus, include_dashboard=False, log_to_driver=True)
    else:
        ray.init(address=address)  # resources belong to the cluster; num_cpus is not allowed when joining
    return True


# ----------------------------------------------------------------------------- backends and transport


def choose_backend(gpus_per_worker: float) -> str:
    """The collective backend of the module groups: NCCL when workers hold GPUs, gloo otherwise."""
    return "nccl" if gpus_per_worker > 0 else "gloo"


def resolve_transport(transport: Transport, backend: str, gpus_per_worker: float) -> str | None:
    """The Ray ``tensor_transport`` for tensor-producing methods, or None for the object store.

    "auto" is Ray Direct Transport over NCCL between GPUs, and the object store
    elsewhere: on CPU (gloo), because RDT over gloo (ray 2.60) was seen to lose
    a transfer under CPU load, the receiver failing after 60 s (docs/runtime.md);
    and where workers share a GPU (collocated, fractional GPUs), because one NCCL
    communicator cannot hold two ranks on one device. "direct" forces RDT.
    """
    if transport not in ("auto", "direct", "object_store"):
        raise ValueError(f"runtime.transport must be auto, direct or object_store, got {transport!r}")
    if transport == "object_store":
        return None
    if transport == "auto" and (backend != "nccl" or 0 < gpus_per_worker < 1):
        return None
    return "NCCL" if backend == "nccl" else "GLOO"


# ----------------------------------------------------------------------------- worker side


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class WorkerBase:
    """Base class of dhp workers: identity (module, rank) and the module's process group.

    Subclasses are plain classes; ``WorkerGroup`` wraps them with ``ray.remote``.
    Identity is bound right after construction, so use ``self.rank`` etc. in
    methods (an ``init_model`` step), not in ``__init__``. After
    ``init_process_groups``: ``self.pg`` is the module's process group,
    ``self.rank``/``self.world_size`` the rank and size inside it,
    ``self.global_rank``/``self.global_world_size`` those in the default group.
    """

    module: str = ""
    rank: int = 0
    n_ranks: int = 1
    pg: Any = None
    world_size: int = 1
    global_rank: int = 0
    global_world_size: int = 1

    def dhp_bind(self, module: str, rank: int, n_ranks: int) -> None:
        self.module, self.rank, self.n_ranks = module, rank, n_ranks

    def dhp_ping(self) -> tuple[str, int]:
        return self.module, self.rank

    def dhp_master_address(self) -> tuple[str, int]:
        """An address and free port on this node for a module-only default group (GPU layout)."""
        return ray.util.get_node_ip_address(), _free_port()

    def setup_distributed(
        self,
        backend: str,
        module_ranks: Sequence[tuple[str, list[int]]] | None = None,
        master: tuple[str, int] | None = None,
    ) -> dict[str, Any]:
        """Creates this worker's module process group; returns its coordinates.

        ``module_ranks`` (shared world, CPU): the default group already spans all
        actors (made by the Ray collective group); a subgroup is made for every
        module, in the given order, on every actor. ``master`` (GPU): this module's
        actors form their own default group, rendezvous at ``master``.
        """
        import torch.distributed as dist

        if master is not None:
            self._init_module_world(dist, backend, master)
        else:
            self._init_subgroups(dist, backend, module_ranks or [])
        return self.dhp_coordinates()

    def _init_module_world(self, dist: Any, backend: str, master: tuple[str, int]) -> None:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        host, port = master
        dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", world_size=self.n_ranks, rank=self.rank)
        self.pg = dist.group.WORLD
        self._set_coordinates(dist)

    def _init_subgroups(self, dist: Any, backend: str, module_ranks: Sequence[tuple[str, list[int]]]) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"{self.module} rank {self.rank}: no default process group; create the collective first")
        for module, ranks in module_ranks:  # every actor creates every subgroup, same order: new_group is collective
            group = dist.new_group(ranks=list(ranks), backend=backend)
            if module == self.module:
                self.pg = group
        if self.pg is None:
            raise RuntimeError(f"{self.module} rank {self.rank}: module missing from {[m for m, _ in module_ranks]}")
        self._set_coordinates(dist)

    def _set_coordinates(self, dist: Any) -> None:
        self.world_size = dist.get_world_size(self.pg)
        self.global_rank = dist.get_rank()
        self.global_world_size = dist.get_world_size()
        if dist.get_rank(self.pg) != self.rank or self.world_size != self.n_ranks:
            raise RuntimeError(
                f"{self.module} rank {self.rank}/{self.n_ranks}: process group says rank "
                f"{dist.get_rank(self.pg)}/{self.world_size}"
            )

    def dhp_coordinates(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "rank": self.rank,
            "world_size": self.world_size,
            "global_rank": self.global_rank,
            "global_world_size": self.global_world_size,
        }


# ----------------------------------------------------------------------------- driver side


class WorkerGroup:
    """The actors of one module; calls fan out by the method's dispatch mode."""

    def __init__(
        self,
        worker_cls: type,
        module: str,
        n_ranks: int,
        pg: PlacementGroup | None,
        bundle_of: dict[Slot, int] | None = None,
        kwargs: dict[str, Any] | None = None,
        resources: dict[Slot, ActorResources] | ActorResources | None = None,
        run_id: str | None = None,
    ):
        if n_ranks < 1:
            raise ValueError(f"{module}: n_ranks must be >= 1, got {n_ranks}")
        self.worker_cls, self.module, self.n_ranks = worker_cls, module, n_ranks
        self.tensor_transport: str | None = None  # set by init_process_groups
        self.run_id = run_id or uuid.uuid4().hex[:8]
        remote_cls = ray.remote(enable_tensor_transport=True)(worker_cls)
        self.actors = [
            self._spawn(remote_cls, r, pg, bundle_of or {}, kwargs or {}, resources) for r in range(n_ranks)
        ]
        self._gather("dhp_bind", [a.dhp_bind.remote(module, r, n_ranks) for r, a in enumerate(self.actors)])

    def _spawn(
        self,
        remote_cls: Any,
        rank: int,
        pg: PlacementGroup | None,
        bundle_of: dict[Slot, int],
        kwargs: dict[str, Any],
        resources: dict[Slot, ActorResources] | ActorResources | None,
    ) -> Any:
        res = resources.get((self.module, rank)) if isinstance(resources, dict) else resources
        res = res or ActorResources(1.0, 0.0)
        options: dict[str, Any] = {
            "num_cpus": res.num_cpus,
            "num_gpus": res.num_gpus,
            "name": f"dhp-{self.run_id}-{self.module}-{rank}",
        }
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_of[(self.module, rank)]
            )
        return remote_cls.options(**options).remote(**kwargs)

    # -- calls

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Runs ``method`` on the ranks its dispatch mode names and collects the results.

        Tensor-producing methods (``@produces_tensors``) return ObjectRefs, not
        values, once the calls have finished (``wait_tensors``): pass them on to
        another group's method, the driver never pulls them.
        """
        refs = self.submit(method, *args, **kwargs)
        if is_tensor_producer(self.worker_cls, method):
            self.wait_tensors(method, refs, range(len(refs)))
            return collect(mode_of(self.worker_cls, method), refs)
        return collect(mode_of(self.worker_cls, method), self._gather(method, refs))

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Starts ``method`` on every rank; returns the per-rank refs without waiting."""
        mode = mode_of(self.worker_cls, method)
        per_rank = split_args(mode, method, self.n_ranks, args, kwargs)
        transport = self.tensor_transport if is_tensor_producer(self.worker_cls, method) else None
        return [self._invoke(a, method, transport, ar, kw) for a, (ar, kw) in zip(self.actors, per_rank, strict=True)]

    def submit_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        """Starts ``method`` on one rank only (no dispatch); producers use the group's tensor transport."""
        transport = self.tensor_transport if is_tensor_producer(self.worker_cls, method) else None
        return self._invoke(self.actors[rank], method, transport, args, kwargs)

    def call_rank(self, rank: int, method: str, *args: Any, **kwargs: Any) -> Any:
        """Runs ``method`` on one rank only (no dispatch) and waits; a producer's result stays a ref."""
        ref = self.submit_rank(rank, method, *args, **kwargs)
        if is_tensor_producer(self.worker_cls, method):
            self.wait_tensors(method, [ref], [rank])
            return ref
        return self._gather(method, [ref], ranks=[rank])[0]

    @staticmethod
    def _invoke(actor: Any, method: str, transport: str | None, args: tuple, kwargs: dict) -> ray.ObjectRef:
        fn = getattr(actor, method)
        if transport is not None:
            fn = fn.options(tensor_transport=transport)
        return fn.remote(*args, **kwargs)

    def get(self, method: str, refs: Sequence[ray.ObjectRef], timeout_s: float | None = None) -> list[Any]:
        """Values of per-rank refs of this group, failures turned into ``WorkerError``."""
        return self._gather(method, list(refs), timeout_s=timeout_s)

    def _gather(
        self, method: str, refs: list[ray.ObjectRef], ranks: list[int] | None = None, timeout_s: float | None = None
    ) -> list[Any]:
        """Waits for all refs; the first failure (in completion order) raises at once, so a rank stuck
        in a collective with a dead peer cannot hide another rank's error."""
        ranks = ranks if ranks is not None else list(range(len(refs)))
        rank_of = {ref: r for ref, r in zip(refs, ranks, strict=True)}
        values: dict[int, Any] = {}
        pending = list(refs)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=wait_s)
            if not ready:
                left = sorted(rank_of[p] for p in pending)
                raise WorkerError(self.module, left[0], method, f"no answer within {timeout_s} s from ranks {left}")
            for ref in ready:
                values[rank_of[ref]] = self._get_one(method, rank_of[ref], ref)
        return [values[r] for r in ranks]

    def wait_tensors(self, method: str, refs: Sequence[ray.ObjectRef], ranks: Sequence[int]) -> None:
        """Waits until tensor-producing calls have finished and their tensors can be sent on, without pulling them.

        A Ray Direct Transport ref handed to another actor before this driver has its tensors'
        metadata makes Ray queue the transfer and start it later from a callback thread. Handing
        refs on only once the metadata is here makes this thread start every send/recv pair, in
        one order, and reports a failed producer at once, by rank. (It did not stop RDT over gloo
        from losing a transfer under CPU load, which is why "auto" uses the object store on CPU:
        ``resolve_transport``.) With the object store there is no metadata: finishing is enough.
        """
        refs = list(refs)
        rank_of = dict(zip(refs, ranks, strict=True))
        ready, _ = ray.wait(refs, num_returns=len(refs), fetch_local=False)
        if self.tensor_transport is None:
            return
        manager = getattr(ray._private.worker.global_worker, "rdt_manager", None)  # Ray's RDT bookkeeping (2.60)
        if not hasattr(manager, "wait_for_tensor_transport_metadata"):  # another Ray: finished must do
            return
        deadline = time.monotonic() + TRANSPORT_METADATA_TIMEOUT_S
        for ref in ready:
            if not manager.is_managed_object(ref.hex()):
                continue
            if manager.wait_for_tensor_transport_metadata(ref.hex(), TRANSPORT_METADATA_GRACE_S) is not None:
                continue
            # A failed call never gets metadata: its error is raised here at once. (Were the call fine and only
            # its metadata late, this would pull its tensors to the driver once: slow, but still correct.)
            self._get_one(method, rank_of[ref], ref)
            if manager.wait_for_tensor_transport_metadata(ref.hex(), max(0.0, deadline - time.monotonic())) is None:
                raise WorkerError(self.module, rank_of[ref], method, "finished, but the metadata of its tensors "
                                  f"did not reach the driver within {TRANSPORT_METADATA_TIMEOUT_S:.0f} s")

    def _get_one(self, method: str, rank: int, ref: ray.ObjectRef) -> Any:
        try:
            return ray.get(ref)
        except RayTaskError as e:
            raise WorkerError(self.module, rank, method, str(e)) from None
        except RayActorError as e:
            raise WorkerError(self.module, rank, method, f"the actor died: {e}") from None
        except GetTimeoutError as e:  # pragma: no cover - ray.wait said it was ready
            raise WorkerError(self.module, rank, method, str(e)) from None

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass


@dataclass
class DistributedSetup:
    """What ``init_process_groups`` made: the backend, the RDT transport and the Ray collective (if any)."""

    backend: str
    tensor_transport: str | None
    collective: Any = None
    coordinates: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def init_process_groups(
    groups: Sequence[WorkerGroup], backend: str, transport: Transport = "auto", gpus_per_worker: float = 0.0
) -> DistributedSetup:
    """Gives every group its process group and sets up tensor transport between groups.

    gloo (CPU): one Ray collective group (torch_gloo) over all actors, in group
    order, which makes torch's default group over all of them; then every actor
    creates every module's subgroup in the same order. nccl (GPU): each module
    gets its own NCCL default group; if tensors go by RDT, a Ray NCCL collective
    (a separate communicator) spans all actors.
    """
    tensor_transport = resolve_transport(transport, backend, gpus_per_worker)
    actors = [a for g in groups for a in g.actors]
    setup = DistributedSetup(backend, tensor_transport)
    if backend == "gloo":
        setup.collective = _create_collective(actors, "torch_gloo")
        _setup_shared_world(groups)
    else:
        _setup_module_worlds(groups, backend)
        if tensor_transport is not None:
            setup.collective = _create_collective(actors, tensor_transport.lower())
    for g in groups:
        g.tensor_transport = tensor_transport
        setup.coordinates[g.module] = g._gather("setup_distributed", [a.dhp_coordinates.remote() for a in g.actors])
    return setup


def _create_collective(actors: list[Any], backend: str) -> Any:
    from ray.experimental.collective import create_collective_group

    try:
        return create_collective_group(actors, backend=backend)
    except RayTaskError as e:
        raise WorkerError("collective", -1, "create_collective_group", str(e)) from None


def _setup_shared_world(groups: Sequence[WorkerGroup]) -> None:
    module_ranks: list[tuple[str, list[int]]] = []
    offset = 0
    for g in groups:
        module_ranks.append((g.module, list(range(offset, offset + g.n_ranks))))
        offset += g.n_ranks
    refs = {g.module: [a.setup_distributed.remote("gloo", module_ranks) for a in g.actors] for g in groups}
    for g in groups:
        g._gather("setup_distributed", refs[g.module])


def _setup_module_worlds(groups: Sequence[WorkerGroup], backend: str) -> None:
    refs = {}
    for g in groups:
        master = g.call_rank(0, "dhp_master_address")
        refs[g.module] = [a.setup_distributed.remote(backend, None, master) for a in g.actors]
    for g in groups:
        g._gather("setup_distributed", refs[g.module])


def _forget_collective(collective: Any) -> None:
    """Drops the driver's record of a Ray collective whose actors are dead (no remote calls)."""
    try:
        from ray.experimental.collective.collective import RemoteCommunicatorManager

        RemoteCommunicatorManager.get().remove_remote_communicator(collective.name)
    except Exception:  # noqa: BLE001 - internal API; forgetting is best effort
        pass


# ----------------------------------------------------------------------------- the runtime


@dataclass
class ModuleSpec:
    """One module's workers: the worker class, how many ranks, constructor kwargs."""

    worker_cls: type
    n_ranks: int
    kwargs: dict[str, Any] = field(default_factory=dict)


class Runtime:
    """Owns Ray (if it started it), the placement group, the worker groups and their process groups.

    Use as ``with Runtime(...) as rt:``; leaving the block, normally, by an
    exception or by Ctrl-C, kills every actor and removes the placement group.
    """

    def __init__(
        self,
        modules: dict[str, ModuleSpec],
        placement: Placement = "collocated",
        cpus_per_worker: float = 1.0,
        gpus_per_worker: float = 0.0,
        transport: Transport = "auto",
        address: str | None = None,
        num_cpus: int | None = None,
        pg_timeout_s: float = 60.0,
        shutdown_ray: bool = True,
    ):
        self.modules = modules
        self.plan: PlacementPlan = plan_placement(
            placement, {m: s.n_ranks for m, s in modules.items()}, cpus_per_worker, gpus_per_worker
        )
        self.gpus_per_worker, self.transport = gpus_per_worker, transport
        self.address, self.num_cpus, self.pg_timeout_s = address, num_cpus, pg_timeout_s
        self.shutdown_ray = shutdown_ray
        self.backend = choose_backend(gpus_per_worker)
        self.groups: dict[str, WorkerGroup] = {}
        self.pg: PlacementGroup | None = None
        self.setup: DistributedSetup | None = None
        self._owns_ray = False
        self.run_id = uuid.uuid4().hex[:8]

    def start(self) -> Runtime:
        self._owns_ray = start_ray(self.address, self.num_cpus)
        atexit.register(self.shutdown)
        try:
            self.pg, bundle_of = create_placement_group(self.plan, timeout_s=self.pg_timeout_s)
            for m, spec in self.modules.items():
                self.groups[m] = WorkerGroup(
                    spec.worker_cls, m, spec.n_ranks, self.pg, bundle_of, spec.kwargs,
                    self.plan.actor_resources, self.run_id,
                )
            self.setup = init_process_groups(list(self.groups.values()), self.backend, self.transport,
                                             self.gpus_per_worker)
        except BaseException:
            self.shutdown()
            raise
        return self

    def __getitem__(self, module: str) -> WorkerGroup:
        return self.groups[module]

    def actors(self) -> list[Any]:
        return [a for g in self.groups.values() for a in g.actors]

    def shutdown(self) -> None:
        """Kills every actor, removes the placement group; idempotent."""
        if not ray.is_initialized():  # Ray already gone (atexit after ray.shutdown): so are the actors
            self.groups, self.pg, self.setup = {}, None, None
            atexit.unregister(self.shutdown)
            return
        for g in self.groups.values():
            g.kill()
        if self.setup is not None and self.setup.collective is not None:
            _forget_collective(self.setup.collective)
        if self.pg is not None and ray.is_initialized():
            try:
                remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001 - already removed
                pass
        self.pg, self.setup = None, None
        if self._owns_ray and self.shutdown_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False
        atexit.unregister(self.shutdown)

    def __enter__(self) -> Runtime:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = [
    "DistributedSetup",
    "LayoutError",
    "ModuleSpec",
    "Runtime",
    "WorkerBase",
    "WorkerError",
    "WorkerGroup",
    "choose_backend",
    "init_process_groups",
    "resolve_transport",
    "start_ray",
]
