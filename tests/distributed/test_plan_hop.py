"""The runtime's hop between two groups' calls (``dhp.plan.hop``), measured through the runtime's own call path in
the session's Ray: what it counts, and that the refs one group emits reach the next group's call."""

from __future__ import annotations

import contextlib
import time

from dhp.plan.hop import HopWorker, measure_hop
from dhp.runtime.dispatch import Collect, Split, dispatch

LATE_S = 0.05


class LateReturn(HopWorker):
    """Stamps its end, then returns ``LATE_S`` later: the time its result takes to reach the driver."""

    @dispatch(split=Split.ALL, collect=Collect.ALL)
    def work(self, *pieces):
        stamps = super().work(*pieces)
        time.sleep(LATE_S)
        return stamps


def test_the_hop_runs_from_one_groups_end_to_the_next_groups_start(ray_cluster):
    """A call whose result comes back ``LATE_S`` after its end delays the next group's call by as much: the hop
    counts the result's way back and the next call's way out, not the calls themselves (a late return would not
    show in the calls' own spans)."""
    assert measure_hop(2, reps=3, nbytes=0, worker_cls=LateReturn)[0] >= LATE_S


def test_the_hop_hands_each_groups_emitted_refs_to_the_next_group(ray_cluster):
    """Every rank of the consuming group receives each producing rank's piece whole (``measure_hop`` checks the
    element counts and raises otherwise), through the group's data plane (the object store here)."""
    assert measure_hop(2, reps=2, nbytes=4096)[0] > 0.0


def test_the_hop_beside_other_work_is_timed_once_the_groups_are_up(ray_cluster):
    """``beside`` is entered after the groups' actors are up, and only around the second series of hops: a context
    that records when it was entered sees it once, after the first series (its hops then also run inside it)."""
    entered = []

    @contextlib.contextmanager
    def beside():
        entered.append(True)
        yield

    alone, inside = measure_hop(2, reps=2, nbytes=0, beside=beside)
    assert entered == [True] and alone > 0.0 and inside > 0.0
    assert measure_hop(2, reps=2, nbytes=0)[1] == 0.0  # none: not measured
