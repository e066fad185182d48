"""The driver side of one module: its Ray actors, calls fanned out to them, failures made loud.

A ``WorkerGroup`` starts one actor per rank (inside the placement group's
bundles) and runs worker methods on them. Calls follow the method's declared
dispatch (``dhp.runtime.dispatch``); ``group.<method>`` gives the bound form
(``dhp.runtime.binding``). An exception in a worker reaches the driver as a
``WorkerError`` naming module, rank and method with the worker's traceback;
the first failure in completion order is raised at once, so a rank stuck in a
collective with a dead peer cannot hide another rank's error. A call that
fails only because one of its inputs could not be made (another group's actor
died, or raised, while producing it) names that producer, not the consumer:
Ray reports such a failure at the consumer's ``ray.get``.

A group knows its data-parallel replica structure: ``replica_size`` ranks per
replica, replica ``r`` being ranks ``r*replica_size .. (r+1)*replica_size-1``
(the convention of ``dhp.runtime.mesh.ModuleLayout`` with inner=replica_size).
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dhp.runtime.binding import BoundMethod, Pending
from dhp.runtime.cluster import worker_env
from dhp.runtime.dispatch import is_tensor_producer, spec_of, split_args
from dhp.runtime.errors import WorkerError
from dhp.runtime.placement import ActorResources, Slot

TRANSPORT_METADATA_TIMEOUT_S = 120.0  # from a call's end to its RDT metadata reaching the driver: normally ms
TRANSPORT_METADATA_GRACE_S = 5.0  # ... after which the driver checks whether the call failed


# Every live group's actors, by Ray actor id (hex) -> (module, rank): lets a consumer's failure name the producer
# in another group whose death or error it inherited through an argument. Driver-process bookkeeping only.
_OWNERS: dict[str, tuple[str, int]] = {}
_UNCOMPUTED_INPUT = "input arguments for this task could not be computed"
_ACTOR_OF_FRAME = re.compile(r"ray::\w+\.(\w+)\(\)[^\n]*?actor_id=([0-9a-f]+)")


def _upstream_failure(err: Exception, own_actor: str) -> tuple[str, int, str | None] | None:
    """(module, rank, method or None if it died) of another registered actor whose failure ``err`` passes on.

    Two shapes (ray 2.60): a dead producer arrives as an error that is also a ``RayActorError`` carrying
    the producer's ``actor_id``; a producer that raised arrives as a ``RayTaskError`` whose text says
    an input "could not be computed" and then shows the producer's frame ``ray::Cls.method() (... actor_id=...)``.
    """
    actor = getattr(err, "actor_id", None) if isinstance(err, RayActorError) else None
    if isinstance(actor, str) and actor != own_actor and actor in _OWNERS:
        return (*_OWNERS[actor], None)
    text = str(err)
    at = text.find(_UNCOMPUTED_INPUT)
    if at < 0:
        return None
    for method, actor in _ACTOR_OF_FRAME.findall(text[at:]):
        if actor != own_actor and actor in _OWNERS:
            return (*_OWNERS[actor], method)
    return None


def check_replica_size(module: str, n_ranks: int, replica_size: int) -> None:
    """ValueError unless ``n_ranks`` ranks form whole replicas of ``replica_size``."""
    if not isinstance(replica_size, int) or replica_size < 1:
        raise ValueError(f"{module}: replica_size must be an int >= 1, got {replica_size!r}")
    if n_ranks % replica_size:
        raise ValueError(f"{module}: n_ranks {n_ranks} is not a multiple of replica_size {replica_size}")


class WorkerGroup:
    """The actors of one module; calls fan out by the method's dispatch, ``group.<method>`` is the bound form."""

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
        replica_size: int = 1,
        bind: bool = True,
    ):
        """Starts the actors. ``bind=False`` returns once they are requested, before they are up: the caller
        calls ``bind()`` after starting its other groups, so that every group's processes start at once."""
        if n_ranks < 1:
            raise ValueError(f"{module}: n_ranks must be >= 1, got {n_ranks}")
        check_replica_size(module, n_ranks, replica_size)
        self.worker_cls, self.module, self.n_ranks = worker_cls, module, n_ranks
        self.replica_size = replica_size
        self.tensor_transport: str | None = None  # set by init_process_groups
        self.data_plane = "ray"  # p2p | cuda_ipc | ray: set by init_process_groups
        self.run_id = run_id or uuid.uuid4().hex[:8]
        remote_cls = ray.remote(enable_tensor_transport=True)(worker_cls)
        self.actors = [
            self._spawn(remote_cls, r, pg, bundle_of or {}, kwargs or {}, resources) for r in range(n_ranks)
        ]
        _OWNERS.update({a._actor_id.hex(): (module, r) for r, a in enumerate(self.actors)})
        if bind:
            self.bind()

    def bind(self) -> None:
        """Waits for every actor to be up and tells it its module and rank."""
        self._gather("dhp_bind", [a.dhp_bind.remote(self.module, r, self.n_ranks) for r, a in enumerate(self.actors)])

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
        env = worker_env()
        if env:  # NCCL/gloo settings of the driver reach workers on every node
            options["runtime_env"] = {"env_vars": env}
        if pg is not None:
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=bundle_of[(self.module, rank)]
            )
        return remote_cls.options(**options).remote(**kwargs)

    # -- replicas

    @property
    def n_replicas(self) -> int:
        return self.n_ranks // self.replica_size

    def ranks_of_replica(self, replica: int) -> list[int]:
        if not 0 <= replica < self.n_replicas:
            raise IndexError(f"{self.module}: replica {replica} out of range 0..{self.n_replicas - 1}")
        return list(range(replica * self.replica_size, (replica + 1) * self.replica_size))

    def replica_heads(self) -> list[int]:
        """The head rank (inner rank 0) of every replica, replica order."""
        return list(range(0, self.n_ranks, self.replica_size))

    # -- bound methods

    def __getattr__(self, name: str) -> BoundMethod:
        """``group.<method>``: a worker method bound to this group (only reached for names the group lacks)."""
        worker_cls = self.__dict__.get("worker_cls")
        if name.startswith("_") or worker_cls is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        fn = getattr(worker_cls, name, None)
        if fn is None or not callable(fn):
            raise AttributeError(f"{worker_cls.__name__} has no method {name!r} (worker group {self.module!r})")
        return BoundMethod(self, name)

    # -- calls

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Runs ``method`` on every rank by its dispatch and collects the results (``group.<method>(...)``).

        Tensor-producing methods (``@produces_tensors``) return ObjectRefs, not
        values, once the calls have finished (``wait_tensors``): pass them on to
        another group's method, the driver never pulls them.
        """
        return BoundMethod(self, method)(*args, **kwargs)

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]:
        """Starts ``method`` on every rank; returns the per-rank refs without waiting."""
        spec = spec_of(self.worker_cls, method)
        per_rank = split_args(spec, method, self.n_ranks, args, kwargs, self.replica_size)
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

    def pending(self, method: str, refs: Sequence[ray.ObjectRef], ranks: Sequence[int] | None = None) -> Pending:
        """A ``Pending`` over refs from ``submit``/``submit_rank``; ``.get()`` collects by the method's Collect."""
        return Pending(self, method, list(refs), list(ranks) if ranks is not None else list(range(len(refs))))

    @staticmethod
    def _invoke(actor: Any, method: str, transport: str | None, args: tuple, kwargs: dict) -> ray.ObjectRef:
        fn = getattr(actor, method)
        if transport is not None:
            fn = fn.options(tensor_transport=transport)
        return fn.remote(*args, **kwargs)

    def get(
        self,
        method: str,
        refs: Sequence[ray.ObjectRef],
        timeout_s: float | None = None,
        ranks: Sequence[int] | None = None,
    ) -> list[Any]:
        """Values of per-rank refs of this group (ranks 0.. unless given), failures turned into ``WorkerError``."""
        return self._gather(method, list(refs), ranks=None if ranks is None else list(ranks), timeout_s=timeout_s)

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
        except (RayTaskError, RayActorError) as e:
            raise self._error(method, rank, e) from None
        except GetTimeoutError as e:  # pragma: no cover - ray.wait said it was ready
            raise WorkerError(self.module, rank, method, str(e)) from None

    def _error(self, method: str, rank: int, err: Exception) -> WorkerError:
        """The failure of ``method`` on ``rank`` as a WorkerError naming the actor at fault: this rank, or
        the producer in another group whose failure reached this call through an argument."""
        upstream = _upstream_failure(err, self.actors[rank]._actor_id.hex())
        if upstream is not None:
            module, producer_rank, producer_method = upstream
            consumer = f"{self.module} rank {rank}'s {method}()"
            if producer_method is None:  # Ray does not say which of the dead actor's calls it was in
                return WorkerError(module, producer_rank, "?", f"the actor died: {err}",
                                   what=f"died while making an input of {consumer}")
            return WorkerError(module, producer_rank, producer_method, str(err),
                               what=f"failed in {producer_method}(), making an input of {consumer}")
        if isinstance(err, RayActorError) and not isinstance(err, RayTaskError):
            return WorkerError(self.module, rank, method, f"the actor died: {err}")
        return WorkerError(self.module, rank, method, str(err))

    def kill(self) -> None:
        for a in self.actors:
            _OWNERS.pop(a._actor_id.hex(), None)
            try:
                ray.kill(a, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone is fine
                pass


__all__ = ["WorkerGroup", "check_replica_size"]
