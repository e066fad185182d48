"""Worker methods bound to a worker group, so that driver code calls a group like a local object.

``group.forward(x)`` runs ``forward`` on the ranks with its declared split,
waits, and collects by its declared ``Collect``; ``group.forward.submit(x)``
only starts it and returns a ``Pending`` to ``.get()`` later, which is how the
driver overlaps groups (submit on one, then on the other, then get both). Kept
apart from ``WorkerGroup`` so the group stays the mechanics (actors, refs,
failures) and this file the calling convention.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

import ray

from dhp.runtime.dispatch import DispatchSpec, collect, is_tensor_producer, method_of, spec_of


class Group(Protocol):
    """What a bound method needs of its worker group (``WorkerGroup`` is one; this file does not import it)."""

    worker_cls: type
    module: str
    n_ranks: int
    replica_size: int

    def submit(self, method: str, *args: Any, **kwargs: Any) -> list[ray.ObjectRef]: ...
    def get(self, method: str, refs: Any, timeout_s: float | None = None, ranks: Any = None) -> list[Any]: ...
    def wait_tensors(self, method: str, refs: Any, ranks: Any) -> None: ...


class Pending:
    """A started call of one worker method on some ranks of a group: the per-rank refs, not yet waited for.

    ``get()`` waits and collects by the method's ``Collect`` (a failure raises
    ``WorkerError`` naming module, rank and method). For ``@produces_tensors``
    methods it waits for the calls to finish (``WorkerGroup.wait_tensors``) and
    collects the refs themselves: the tensors stay with the workers. A
    ``Pending`` over a subset of the ranks returns the per-rank list as is.
    """

    def __init__(self, group: Group, method: str, refs: list[ray.ObjectRef], ranks: list[int]):
        if len(refs) != len(ranks):
            raise ValueError(f"{method}: {len(refs)} refs for {len(ranks)} ranks")
        self.group, self.method = group, method
        self.refs, self.ranks = list(refs), list(ranks)
        self.spec: DispatchSpec = spec_of(group.worker_cls, method)
        self.produces_tensors = is_tensor_producer(group.worker_cls, method)
        self.fine: set[ray.ObjectRef] = set()  # refs of ranks that ``check`` found finished without error

    def get(self, timeout_s: float | None = None) -> Any:
        if self.produces_tensors:
            self.group.wait_tensors(self.method, self.refs, self.ranks)
            results: list[Any] = self.refs
        else:
            results = self.group.get(self.method, self.refs, timeout_s=timeout_s, ranks=self.ranks)
        if self.ranks != list(range(self.group.n_ranks)):  # a subset of ranks: nothing to collect by
            return results
        return collect(self.spec, results, self.group.replica_size)

    def check(self, ref: ray.ObjectRef) -> None:
        """Raises ``WorkerError`` if the finished call behind ``ref`` (one of this call's ranks) failed."""
        self.group.get(self.method, [ref], ranks=[self.ranks[self.refs.index(ref)]])
        self.fine.add(ref)

    def __repr__(self) -> str:
        return f"Pending({self.group.module}.{self.method}, ranks={self.ranks})"


def get_watching(target: Pending, watched: Iterable[Pending]) -> Any:
    """``target.get()``, raising at once the failure of any ``watched`` call that fails first.

    The driver submits some calls before it takes their results (the text group's next round before its
    last round's losses: ``RayBackend.run_step``). A call queued behind one that waits for a failed call's
    output never answers, so a wait on it alone would hang; this wait ends with that failure instead. A
    watched rank's failure raises as soon as it ends, before its peers (which may wait in a collective for it);
    so does a rank of ``target``, as ``get`` alone would.
    """
    owner = {ref: p for p in watched for ref in p.refs if ref not in p.fine}  # each rank checked once
    if not owner:
        return target.get()
    waiting = set(target.refs)
    unready = [*target.refs, *owner]
    while waiting:
        ready, unready = ray.wait(unready, num_returns=1)
        for ref in ready:
            if ref in owner:
                owner[ref].check(ref)
            elif not target.produces_tensors:  # (a producer's failure: ``get``'s ``wait_tensors`` names it)
                target.check(ref)
            waiting.discard(ref)
    return target.get()


class BoundMethod:
    """``group.<method>``: call it to run and collect, ``.submit(...)`` to start only."""

    def __init__(self, group: Group, method: str):
        fn: Callable[..., Any] = method_of(group.worker_cls, method)
        self.group, self.method = group, method
        self.spec: DispatchSpec = spec_of(group.worker_cls, method)
        self.produces_tensors = is_tensor_producer(group.worker_cls, method)
        self.__doc__ = fn.__doc__
        self.__name__ = method

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the method on every rank with its declared split, waits, and collects."""
        return self.submit(*args, **kwargs).get()

    def submit(self, *args: Any, **kwargs: Any) -> Pending:
        """Starts the method on every rank with its declared split; returns without waiting."""
        refs = self.group.submit(self.method, *args, **kwargs)
        return Pending(self.group, self.method, refs, list(range(self.group.n_ranks)))

    def __repr__(self) -> str:
        s = self.spec
        return (f"<bound {self.group.worker_cls.__name__}.{self.method} of group {self.group.module!r} "
                f"(split {s.split.name}, collect {s.collect.name})>")


__all__ = ["BoundMethod", "Pending", "get_watching"]
