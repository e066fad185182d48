"""The multi-process harness the collective tests stand on (``tests/spawn.py``): results by rank, and failures
that say where."""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist

from tests.spawn import run_distributed


def _sum_ranks(rank: int, world: int) -> torch.Tensor:
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return t * 10 + rank


def _raise_on_rank1(rank: int, world: int) -> int:
    if rank == 1:
        raise ValueError("bad shard on rank 1")
    return rank


def _abort_rank0(rank: int, world: int) -> int:
    if rank == 0:
        os.kill(os.getpid(), signal.SIGABRT)
    return rank


def test_results_come_back_by_rank():
    assert [r.item() for r in run_distributed(_sum_ranks, 2)] == [30.0, 31.0]


def test_exception_names_the_rank_traceback():
    """Rank 0 then fails too (its peer is gone at the closing barrier): the report leads with rank 1's cause."""
    with pytest.raises(RuntimeError, match="ranks failed") as info:
        run_distributed(_raise_on_rank1, 2, timeout_s=20)
    sections = str(info.value).split("-- rank ")[1:]
    assert sections[0].startswith("1 --") and "ValueError: bad shard on rank 1" in sections[0]


def test_rank_killed_by_signal_is_reported_with_the_ranks_that_returned():
    # rank 1 may or may not have written its result before the harness stops it; rank 0 never has
    expected = r"process 0 terminated with signal SIGABRT \(ranks whose function had returned: \[1?\]"
    with pytest.raises(RuntimeError, match=expected):
        run_distributed(_abort_rank0, 2, timeout_s=20)
