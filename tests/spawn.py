"""Run a function on N local gloo processes and collect what each rank returns (tests, benchmarks).

A test harness, not part of the ``dhp`` package (the runtime starts its own
ranks: ``dhp/runtime``, ``dhp/backends``). Benchmarks import it with the
repository root on ``sys.path`` (``from tests.spawn import run_distributed``).

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
on any rank fails the call with the traceback of every rank that failed, the
first to fail first (a rank that raises makes its peers fail in their next
collective with "connection closed": that is not the cause, and must not hide
it); a rank stuck in a
collective fails after ``timeout_s`` instead of hanging the test session; a rank
killed by a signal (a C++ abort) leaves the Python stack of each of its threads
on stderr (``faulthandler``) and the error says which ranks had returned.

Shutdown is ordered, because gloo's C++ threads do not survive an unordered one:
every rank passes a barrier once its result is written (no rank tears the group
down — rank 0 also hosts the TCP store — while another still uses it), destroys
the process group, and leaves with ``os._exit`` instead of running interpreter
finalization, where destroying gloo's leftover work objects and threads can
abort the process (CI once saw ``terminate called without an active exception``
from rank 0 of a passing test; a known failure mode of gloo at exit, pytorch/pytorch#179291).
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException


def free_port() -> int:
    """A TCP port nobody listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, timeout_s: float, args: tuple
) -> None:
    faulthandler.enable()  # a C++ abort prints every thread's Python stack
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
        dist.barrier()
    except BaseException:
        path = os.path.join(out_dir, f"rank{rank}.err")  # written before any peer can notice this rank is gone
        with open(path + ".tmp", "w") as f:
            f.write(f"{time.time()}\n{traceback.format_exc()}")
        os.replace(path + ".tmp", path)  # whole or absent, even if the harness stops this rank now
        raise
    finally:
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter finalization (see the module docstring); an exception above still fails the rank


PORT_TRIES = 3  # the free port may be taken between ``free_port`` and rank 0's listen: try another


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 60.0) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes; returns the results by rank.

    ``free_port`` frees the port it found before rank 0 listens on it, and on a busy machine another process (a
    Ray worker of a test beside this one) can take it in between: rank 0 then fails to listen (EADDRINUSE)
    before ``fn`` runs, and the ranks start again on another port, up to ``PORT_TRIES`` times."""
    for attempt in range(PORT_TRIES):
        with tempfile.TemporaryDirectory(prefix="dhp-dist-") as out_dir:
            try:
                mp.spawn(
                    _entry,
                    args=(fn, world_size, free_port(), out_dir, timeout_s, args),
                    nprocs=world_size,
                    join=True,
                )
            except ProcessException as e:
                report = _failure_report(e, out_dir, world_size)
                if "EADDRINUSE" in report and attempt + 1 < PORT_TRIES:
                    continue
                raise RuntimeError(report) from e
            return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
    raise AssertionError("unreachable")


def _failure_report(error: Exception, out_dir: str, world_size: int) -> str:
    """Every failed rank's traceback, earliest first, and which ranks had returned their result."""
    failures = []
    for r in range(world_size):
        path = os.path.join(out_dir, f"rank{r}.err")
        if os.path.exists(path):
            with open(path) as f:
                when, _, text = f.read().partition("\n")
            failures.append((float(when), r, text))
    returned = [r for r in range(world_size) if os.path.exists(os.path.join(out_dir, f"rank{r}.pt"))]
    if isinstance(error, ProcessExitedException):  # killed by a signal or exited without a traceback
        head = f"{error} (ranks whose function had returned: {returned}; see stderr for the stacks)"
    else:
        head = f"{len(failures)} of {world_size} ranks failed (ranks whose function had returned: {returned})"
    return "\n".join([head] + [f"-- rank {r} --\n{text}" for _, r, text in sorted(failures)])
