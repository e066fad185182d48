"""Split and Collect without Ray: what each rank receives and what the driver gets back, and the refusals."""

from __future__ import annotations

import pytest

from dhp.runtime import Broadcast, Collect, DispatchError, Mode, Split, dispatch
from dhp.runtime.dispatch import DispatchSpec, collect, spec_of, split_args


class W:
    @dispatch(split=Split.REPLICA, collect=Collect.REPLICA_HEADS)
    def replica(self, x: int, y: int = 0) -> int:
        return x + y

    @dispatch(Mode.SCATTER)
    def scatter(self, x: int) -> int:
        return x

    @dispatch(collect=Collect.RANK_ZERO)
    def zero(self) -> int:
        return 0

    def plain(self) -> None:
        pass


def test_legacy_modes_are_split_collect_pairs() -> None:
    assert Mode.ONE_TO_ALL.spec == DispatchSpec(Split.ALL, Collect.ALL)
    assert Mode.SCATTER.spec == DispatchSpec(Split.RANK, Collect.ALL)
    assert Mode.RANK_ZERO.spec == DispatchSpec(Split.ALL, Collect.RANK_ZERO)
    assert spec_of(W, "scatter") == Mode.SCATTER.spec
    assert spec_of(W, "zero") == Mode.RANK_ZERO.spec
    assert spec_of(W, "plain") == DispatchSpec(Split.ALL, Collect.ALL)
    with pytest.raises(AttributeError, match="W has no method 'nope'"):
        spec_of(W, "nope")
    with pytest.raises(TypeError, match="either a Mode or split"):
        dispatch(Mode.SCATTER, split=Split.RANK)


def test_split_all_rank_replica() -> None:
    assert split_args(Mode.ONE_TO_ALL, "m", 3, (1,), {"k": 2}) == [((1,), {"k": 2})] * 3
    assert split_args(Mode.SCATTER, "m", 3, ([1, 2, 3],), {"k": Broadcast(9)}) == [
        ((1,), {"k": 9}), ((2,), {"k": 9}), ((3,), {"k": 9})
    ]
    spec = spec_of(W, "replica")
    per_rank = split_args(spec, "replica", 4, (["a", "b"],), {"y": Broadcast([7])}, replica_size=2)
    assert [a for a, _ in per_rank] == [("a",), ("a",), ("b",), ("b",)]
    assert all(kw == {"y": [7]} for _, kw in per_rank)
    # replica_size 1: REPLICA is RANK
    assert [a for a, _ in split_args(spec, "replica", 2, ([5, 6],), {})] == [(5,), (6,)]


def test_split_refusals_name_method_and_argument() -> None:
    spec = spec_of(W, "replica")
    msg = (r"replica \(split REPLICA\): argument 'y' has 4 items but the group has 2 replicas "
           r"\(4 ranks, replica_size 2\); give exactly one item per replica")
    with pytest.raises(DispatchError, match=msg):
        split_args(spec, "replica", 4, ([1, 2],), {"y": [1, 2, 3, 4]}, replica_size=2)
    with pytest.raises(DispatchError, match=r"scatter \(split RANK\): argument 0 must be a list with one item per "):
        split_args(Mode.SCATTER, "scatter", 2, ("ab",), {})
    with pytest.raises(DispatchError, match="3 items but the group has 2 ranks"):
        split_args(Mode.SCATTER, "scatter", 2, ([1, 2, 3],), {})
    with pytest.raises(DispatchError, match="5 ranks cannot form replicas of 2"):
        split_args(spec, "replica", 5, ([1, 2],), {}, replica_size=2)


def test_collect() -> None:
    results = ["r0", "r1", "r2", "r3"]
    assert collect(Mode.ONE_TO_ALL, results) == results
    assert collect(Mode.RANK_ZERO, results) == "r0"
    assert collect(spec_of(W, "replica"), results, replica_size=2) == ["r0", "r2"]
    assert collect(spec_of(W, "replica"), results, replica_size=4) == ["r0"]
    assert collect(spec_of(W, "replica"), results) == results
    with pytest.raises(DispatchError):
        collect(spec_of(W, "replica"), results, replica_size=3)
