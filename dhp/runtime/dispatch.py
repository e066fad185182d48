"""How a driver call on a worker group fans out to ranks and how the answers come back.

Worker methods declare their dispatch mode once, with ``@dispatch(Mode.SCATTER)``,
so that driver code reads like ``vision.call("forward", plan)`` and the
splitting rule lives next to the method that depends on it (the style of verl's
``@register``). Splitting is strict: ``SCATTER`` wants exactly one item per rank
and says so when it gets another count; it never infers the number of ranks from
the data. Methods without a declaration default to ``ONE_TO_ALL``.

Methods that return tensors meant for another worker group are marked with
``@produces_tensors``; the runtime then routes their result through Ray Direct
Transport or the object store according to ``runtime.transport``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

_DISPATCH_ATTR = "__dhp_dispatch__"
_TENSOR_ATTR = "__dhp_produces_tensors__"


class Mode(enum.Enum):
    """How arguments go to ranks and how results are collected."""

    ONE_TO_ALL = "one_to_all"  # the same arguments to every rank; a list of results, rank order
    SCATTER = "scatter"  # argument item i to rank i (every argument a sequence of length n_ranks); a list
    RANK_ZERO = "rank_zero"  # the same arguments to every rank (they may all take part in collectives); rank 0's


class DispatchError(ValueError):
    """Arguments that do not fit the dispatch mode of the method; the message names method and argument."""


@dataclass(frozen=True)
class Broadcast:
    """Wraps an argument of a ``SCATTER`` call that every rank should receive whole."""

    value: Any


def dispatch(mode: Mode) -> Callable[[F], F]:
    """Declares the dispatch mode of a worker method."""

    def mark(fn: F) -> F:
        setattr(fn, _DISPATCH_ATTR, mode)
        return fn

    return mark


def produces_tensors(fn: F) -> F:
    """Marks a method whose return value (tensors) goes to another worker group, not to the driver."""
    setattr(fn, _TENSOR_ATTR, True)
    return fn


def mode_of(cls: type, method: str) -> Mode:
    """The declared mode of ``cls.method`` (``ONE_TO_ALL`` if undeclared)."""
    return getattr(_method(cls, method), _DISPATCH_ATTR, Mode.ONE_TO_ALL)


def is_tensor_producer(cls: type, method: str) -> bool:
    return bool(getattr(_method(cls, method), _TENSOR_ATTR, False))


def _method(cls: type, method: str) -> Callable[..., Any]:
    fn = getattr(cls, method, None)
    if fn is None or not callable(fn):
        raise AttributeError(f"{cls.__name__} has no method {method!r}")
    return fn


def split_args(
    mode: Mode, method: str, n_ranks: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
    """The (args, kwargs) each rank receives, in rank order."""
    if mode in (Mode.ONE_TO_ALL, Mode.RANK_ZERO):
        return [(args, kwargs)] * n_ranks
    if mode is Mode.SCATTER:
        per_arg = [_scatter_one(method, f"argument {i}", a, n_ranks) for i, a in enumerate(args)]
        per_kw = {k: _scatter_one(method, f"argument {k!r}", v, n_ranks) for k, v in kwargs.items()}
        return [(tuple(p[r] for p in per_arg), {k: v[r] for k, v in per_kw.items()}) for r in range(n_ranks)]
    raise DispatchError(f"{method}: unknown dispatch mode {mode!r}")


def _scatter_one(method: str, what: str, value: Any, n_ranks: int) -> list[Any]:
    if isinstance(value, Broadcast):
        return [value.value] * n_ranks
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise DispatchError(
            f"{method} (SCATTER): {what} must be a list with one item per rank ({n_ranks}), "
            f"got {type(value).__name__}; wrap it in Broadcast(...) to send it whole to every rank"
        )
    if len(value) != n_ranks:
        raise DispatchError(
            f"{method} (SCATTER): {what} has {len(value)} items but the group has {n_ranks} ranks; "
            "give exactly one item per rank"
        )
    return list(value)


def collect(mode: Mode, results: list[Any]) -> Any:
    """The driver's view of the per-rank results (values or refs, rank order)."""
    if mode is Mode.RANK_ZERO:
        return results[0]
    return results
