"""Run a function on N local gloo processes and collect what each rank returns (tests, benchmarks).

Why: collective code (all-to-all attention, TP layers, ZeRO) is only proven by
running it on several ranks. ``run_distributed`` spawns fresh processes (no Ray,
no shared state with the test process), gives them a default gloo process group
on a free TCP port, and hands back each rank's return value. Results travel
through files written by ``torch.save`` (no queue to drain, no deadlock on large
results), so they must be picklable: keep tensors on the CPU.

    def worker(rank: int, world_size: int, x: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(y := x * rank)
        return y

    results = run_distributed(worker, 2, torch.ones(3))  # [result of rank 0, result of rank 1]

``fn`` must be importable by the child (a module-level function). An exception
on any rank fails the call with that rank's traceback; a rank stuck in a
collective fails after ``timeout_s`` instead of hanging the test session.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, timeout_s: float, args: tuple
) -> None:
    torch.set_num_threads(1)  # N ranks share a few cores: no oversubscription
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; returns the results by rank."""
    with tempfile.TemporaryDirectory(prefix="dhp-dist-") as out_dir:
        mp.spawn(
            _entry,
            args=(fn, world_size, free_port(), out_dir, timeout_s, args),
            nprocs=world_size,
            join=True,
        )
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
