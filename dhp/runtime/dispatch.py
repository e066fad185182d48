"""How a driver call on a worker group fans out to ranks and how the answers come back.

Worker methods declare, once and next to their code, how their inputs are split
over the ranks (``Split``) and how the ranks' results are collected
(``Collect``), e.g. ``@dispatch(split=Split.REPLICA, collect=Collect.REPLICA_HEADS)``;
driver code then calls the group like single-process code,
``vision.forward(plan)`` (the style of verl's ``@register``; the binding itself
is ``dhp.runtime.binding``). The legacy modes remain: ``@dispatch(Mode.SCATTER)``.
Splitting is strict: a per-rank or per-replica argument must have exactly one
item per rank or replica and the error says so, naming method and argument; the
number of ranks is never inferred from the data. Methods without a
declaration default to ``Split.ALL``/``Collect.ALL``.

Methods that return tensors meant for another worker group are marked with
``@produces_tensors``; the runtime then routes their result through Ray Direct
Transport or the object store according to ``runtime.transport``.

This file is pure (no Ray): the decorators run in workers, the split/collect
functions on the driver.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_DISPATCH_ATTR = "__dhp_dispatch__"
_TENSOR_ATTR = "__dhp_produces_tensors__"


class Split(enum.Enum):
    """How a call's arguments go to the ranks."""

    ALL = "all"  # the same arguments to every rank
    RANK = "rank"  # argument item i to rank i: every argument a sequence of n_ranks items (or Broadcast)
    REPLICA = "replica"  # item r to every rank of data-parallel replica r: n_replicas items (or Broadcast)


class Collect(enum.Enum):
    """What the driver gets back from the ranks' results (every rank runs the method either way)."""

    ALL = "all"  # a list, rank order
    RANK_ZERO = "rank_zero"  # rank 0's result alone
    REPLICA_HEADS = "replica_heads"  # a list, one per replica: the result of its head rank (inner rank 0)


class Mode(enum.Enum):
    """The legacy dispatch modes, each a (Split, Collect) pair (``Mode.spec``)."""

    ONE_TO_ALL = "one_to_all"  # (ALL, ALL): the same arguments to every rank; a list of results, rank order
    SCATTER = "scatter"  # (RANK, ALL): argument item i to rank i; a list
    RANK_ZERO = "rank_zero"  # (ALL, RANK_ZERO): the same arguments to every rank (all may join collectives); rank 0's

    @property
    def spec(self) -> DispatchSpec:
        return _LEGACY[self]


@dataclass(frozen=True)
class DispatchSpec:
    """The declared dispatch of one worker method."""

    split: Split = Split.ALL
    collect: Collect = Collect.ALL


_LEGACY = {
    Mode.ONE_TO_ALL: DispatchSpec(Split.ALL, Collect.ALL),
    Mode.SCATTER: DispatchSpec(Split.RANK, Collect.ALL),
    Mode.RANK_ZERO: DispatchSpec(Split.ALL, Collect.RANK_ZERO),
}
DEFAULT_SPEC = DispatchSpec()


class DispatchError(ValueError):
    """Arguments that do not fit the dispatch mode of the method; the message names method and argument."""


@dataclass(frozen=True)
class Broadcast:
    """Wraps an argument of a ``RANK``/``REPLICA`` split call that every rank should receive whole."""

    value: Any


def dispatch(
    mode: Mode | None = None, *, split: Split | None = None, collect: Collect | None = None
) -> Callable[[F], F]:
    """Declares how a worker method is dispatched: a legacy ``Mode``, or ``split=``/``collect=`` (default ALL)."""
    if mode is not None:
        if split is not None or collect is not None:
            raise TypeError("dispatch: give either a Mode or split=/collect=, not both")
        if not isinstance(mode, Mode):
            raise TypeError(f"dispatch: mode must be a Mode, got {mode!r}")
        spec = mode.spec
    else:
        split, collect = split or Split.ALL, collect or Collect.ALL
        if not isinstance(split, Split) or not isinstance(collect, Collect):
            raise TypeError(f"dispatch: split must be a Split and collect a Collect, got {split!r}, {collect!r}")
        spec = DispatchSpec(split, collect)

    def mark(fn: F) -> F:
        setattr(fn, _DISPATCH_ATTR, spec)
        return fn

    return mark


def produces_tensors(fn: F) -> F:
    """Marks a method whose return value (tensors) goes to another worker group, not to the driver."""
    setattr(fn, _TENSOR_ATTR, True)
    return fn


def spec_of(cls: type, method: str) -> DispatchSpec:
    """The declared dispatch of ``cls.method`` (``Split.ALL``/``Collect.ALL`` if undeclared)."""
    return getattr(method_of(cls, method), _DISPATCH_ATTR, DEFAULT_SPEC)


def is_tensor_producer(cls: type, method: str) -> bool:
    return bool(getattr(method_of(cls, method), _TENSOR_ATTR, False))


def method_of(cls: type, method: str) -> Callable[..., Any]:
    """``cls.method``, or AttributeError naming the class."""
    fn = getattr(cls, method, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{cls.__name__} has no method {method!r}")
    return fn


def split_args(
    spec: DispatchSpec | Mode,
    method: str,
    n_ranks: int,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    replica_size: int = 1,
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The (args, kwargs) each rank receives, in rank order."""
    spec = spec.spec if isinstance(spec, Mode) else spec
    if spec.split is Split.ALL:
        return [(args, kwargs)] * n_ranks
    if spec.split is Split.RANK:
        n_items, item_of, unit = n_ranks, list(range(n_ranks)), f"rank ({n_ranks})"
        counted = f"the group has {n_ranks} ranks"
    elif spec.split is Split.REPLICA:
        if replica_size < 1 or n_ranks % replica_size:
            raise DispatchError(f"{method}: {n_ranks} ranks cannot form replicas of {replica_size}")
        n_items, item_of = n_ranks // replica_size, [r // replica_size for r in range(n_ranks)]
        unit = f"replica ({n_items})"
        counted = f"the group has {n_items} replicas ({n_ranks} ranks, replica_size {replica_size})"
    else:
        raise DispatchError(f"{method}: unknown split {spec.split!r}")
    label = f"{method} (split {spec.split.name})"
    per_arg = [_split_one(label, f"argument {i}", a, n_items, unit, counted) for i, a in enumerate(args)]
    per_kw = {k: _split_one(label, f"argument {k!r}", v, n_items, unit, counted) for k, v in kwargs.items()}
    return [
        (tuple(p[item_of[r]] for p in per_arg), {k: v[item_of[r]] for k, v in per_kw.items()}) for r in range(n_ranks)
    ]


def _split_one(label: str, what: str, value: Any, n_items: int, unit: str, counted: str) -> list[Any]:
    if isinstance(value, Broadcast):
        return [value.value] * n_items
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise DispatchError(
            f"{label}: {what} must be a list with one item per {unit}, "
            f"got {type(value).__name__}; wrap it in Broadcast(...) to send it whole to every rank"
        )
    if len(value) != n_items:
        raise DispatchError(
            f"{label}: {what} has {len(value)} items but {counted}; give exactly one item per {unit.split()[0]}"
        )
    return list(value)


def collect(spec: DispatchSpec | Mode, results: list[Any], replica_size: int = 1) -> Any:
    """The driver's view of the per-rank results (values or refs, rank order, every rank)."""
    spec = spec.spec if isinstance(spec, Mode) else spec
    if spec.collect is Collect.RANK_ZERO:
        return results[0]
    if spec.collect is Collect.REPLICA_HEADS:
        if replica_size < 1 or len(results) % replica_size:
            raise DispatchError(f"{len(results)} results cannot form replicas of {replica_size}")
        return results[::replica_size]
    return list(results)


__all__ = [
    "Broadcast",
    "Collect",
    "DispatchError",
    "DispatchSpec",
    "Mode",
    "Split",
    "collect",
    "dispatch",
    "is_tensor_producer",
    "produces_tensors",
    "spec_of",
    "split_args",
]
