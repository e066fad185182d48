"""``dhp plan calibrate``: measure a device profile (``dhp.plan.profile``) on the machine it runs on.

What it measures, each the least time of a few timed repetitions after a warm-up unless said otherwise:

* GEMMs over a grid of (M, N, K) in float32 and bfloat16 (and any extra shapes given: the planner's own), in
  every operand layout (``nn``; ``nt``: ``x @ w.t()``, what a linear's forward hands ``mm``, DTensor's local
  weight shard included; ``tn``, ``tt``: the backward's transposed operands), each a row of its layout;
* attention (``scaled_dot_product_attention``, forward and backward) at several key lengths and head widths,
  as FLOP/s of torch's own FLOP formulas (the tally prices attention by the same formulas);
* elementwise bandwidth (an in-place add and a copy of a large tensor: bytes read and written per second);
* the host's cost of one op (a tiny add, dispatched many times) and of one host sync (``.item()``), and what
  DTensor's dispatch adds to an op (on CPU, in the collectives' processes; on one GPU it is left at 0);
* collectives (all-reduce, all-gather, reduce-scatter, all-to-all) and a point-to-point send at several
  payloads, in a few local processes over gloo (CPU), fitted as ``alpha + bytes / beta`` per kind and group
  size by least squares (``profile.fit_alpha_beta``), each size's cost in situ (``in_situ``: between compute,
  not barrier-aligned, the mean: what a step pays); each kind by both paths the code calls it by:
  ``torch.distributed`` (``c10d``) and ``_functional_collectives`` with its ``wait_tensor`` (``functional``:
  DTensor's, i.e. TP's), each its own fit;
* on CPU, what FSDP2's and TP's collective calls cost beyond their fits and DTensor's dispatch
  (``stack_call_s``: a small FSDP2 stack and a TP stack against the same stacks unsharded);
* on CPU, contention (``measure_contention``): two ranks running a loop of a GEMM and an all-reduce, alone and
  beside as many busy processes as the host has cores; what its all-reduces take beside them beyond processor
  sharing's prediction (their time alone x the slowdown of the same ranks' GEMMs), per all-reduce, is a
  collective's wait for its peer's process to be scheduled on an oversubscribed host
  (``Profile.contention_wait_s`` at ``contention_ratio`` processes per core);
* the runtime: the hop from one group's call to the next group's through the runtime's call path
  (``dhp.plan.hop``) and a tensor handed from actor to actor through the object store (``measure_runtime``;
  ``runtime=False`` leaves them out, and the replay then prices no call overhead).

On CPU the host does the work itself (``async_launch`` false). On a CUDA device the compute rows run there;
collectives need as many GPUs as ranks (NCCL), so with one GPU they are left to the device table's link
bandwidth (the profile says so in ``machine``). ``quick``: a smaller grid and group sizes, for tests (seconds).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import platform
import socket
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dhp.errors import UsageError
from dhp.plan.ops import kernel_class
from dhp.plan.profile import (
    BURST,
    C10D,
    CALIBRATED,
    FUNCTIONAL,
    GEMM_LAYOUTS,
    AttentionPoint,
    CollectiveFit,
    GemmPoint,
    Profile,
    fit_alpha_beta,
    roofline,
)

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], device: str = "cpu", reps: int = 3, warmup: int = 1,
          stat: Callable[[list[float]], float] = min) -> float:
    """The least seconds of ``fn`` over ``reps`` runs after ``warmup`` (the least: other processes on a shared
    machine only ever add time); ``stat``: another statistic of the runs (``statistics.median``: what a run that
    waits on other processes pays, as a Ray call does)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return stat(out)


FLOAT32_BYTES = torch.finfo(torch.float32).bits // 8


def _pow2(*exponents: int) -> tuple[int, ...]:
    """Calibration sweeps run over powers of two (the table interpolates between them in log space)."""
    return tuple(2**e for e in exponents)


def gemm_grid(quick: bool) -> list[tuple[int, int, int]]:
    ms = _pow2(6, 9, 11) if not quick else _pow2(6, 9)
    nk = _pow2(7, 9, 11) if not quick else _pow2(7, 10)
    return [(m, n, k) for m in ms for n in nk for k in nk]


def gemm_operands(m: int, n: int, k: int, layout: str, dtype: torch.dtype,
                  device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [M, K], B [K, N]) laid out as ``layout`` says (``ops.gemm_layout``): a ``t`` operand is the transposed
    view of a row-major tensor, as ``x @ w.t()`` hands ``mm`` a linear's weight [N, K]."""
    a = torch.randn(k, m, dtype=dtype, device=device).t() if layout[0] == "t" else torch.randn(
        m, k, dtype=dtype, device=device)
    b = torch.randn(n, k, dtype=dtype, device=device).t() if layout[1] == "t" else torch.randn(
        k, n, dtype=dtype, device=device)
    return a, b


def measure_gemms(shapes: list[tuple[int, int, int]], dtypes: tuple[str, ...], device: str,
                  layouts: tuple[str, ...] = GEMM_LAYOUTS) -> list[GemmPoint]:
    out = []
    for dtype in dtypes:
        dt = getattr(torch, dtype)
        for m, n, k in shapes:
            for layout in layouts:
                a, b = gemm_operands(m, n, k, layout, dt, device)
                s = timed(lambda a=a, b=b: torch.mm(a, b), device, reps=5)
                out.append(GemmPoint(m, n, k, dtype, 2.0 * m * n * k / max(s, 1e-9), layout))
    return out


def measure_attention(quick: bool, dtype: str, device: str) -> list[AttentionPoint]:
    """Forward + backward of SDPA on [1, heads, S, D]: FLOP/s by torch's FLOP counter for the same call."""
    from torch.utils.flop_counter import FlopCounterMode

    from dhp.plan.measure import _register_cpu_attention_flops

    _register_cpu_attention_flops()  # the CPU kernel's FLOPs, by the formula the planner's fake run counts
    out = []
    dt = getattr(torch, dtype)
    heads = 4
    for s in ((64, 256, 1024) if not quick else (64, 512)):
        for d in (_pow2(4, 6, 7) if not quick else _pow2(4, 6)):
            q, k, v = (torch.randn(1, heads, s, d, dtype=dt, device=device, requires_grad=True) for _ in range(3))

            def run(q=q, k=k, v=v) -> None:
                torch.nn.functional.scaled_dot_product_attention(q, k, v).sum().backward()

            with FlopCounterMode(display=False) as fc:
                run()
            flops = fc.get_total_flops()
            sec = timed(run, device)
            op = "_scaled_dot_product_flash_attention" + ("_for_cpu" if device == "cpu" else "")
            out.append(AttentionPoint(kernel_class(op), s, d, dtype, flops / max(sec, 1e-9)))
    return out


def measure_bandwidth(device: str, quick: bool) -> float:
    """Bytes per second of an in-place add and a copy (read + write) of a large float32 tensor."""
    n = (4 if quick else 16) * 2**20
    x, y = torch.ones(n, device=device), torch.empty(n, device=device)
    add = timed(lambda: x.add_(1.0), device, reps=5)
    copy = timed(lambda: y.copy_(x), device, reps=5)
    return statistics.mean([2 * 4 * n / add, 2 * 4 * n / copy])


def measure_host(device: str) -> tuple[float, float]:
    """(seconds per dispatched op, seconds per host sync): a tiny add in a loop; ``.item()`` of a fresh result
    (which on CUDA waits for the device)."""
    a = torch.ones(1, device=device)
    loops = 2000

    def ops() -> None:
        for _ in range(loops):
            torch.add(a, 1.0)

    per_op = timed(ops, device) / loops

    def syncs() -> None:
        for _ in range(200):
            torch.add(a, 1.0).item()

    per_sync = max(0.0, timed(syncs, device) / 200 - per_op)
    return per_op, per_sync


# ---- collectives, in local processes ------------------------------------------------------------------------


IN_SITU_REPS = 40  # iterations of each in-situ loop (``in_situ``); ``--quick``: half
BURST_KINDS = ("all_reduce", "broadcast")  # the collectives a step's end runs back to back (``Profile`` path BURST)


def collective_sizes(quick: bool) -> list[int]:
    return [2**14, 2**18, 2**22] if quick else [2**12, 2**15, 2**18, 2**21, 2**23]


def _collective_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, out: str,
                       parent: int) -> None:
    import torch.distributed as dist

    from dhp.lifetime import exit_with_parent

    exit_with_parent(parent)
    warnings.filterwarnings("ignore", category=FutureWarning)  # gloo's *_into_tensor names, still the API here
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    points: dict[str, list[tuple[int, float]]] = {
        k: [] for k in (*KINDS, "broadcast", *map(functional_name, KINDS), *(f"{BURST}:{k}" for k in BURST_KINDS),
                        "send")}
    chunk = _compute_chunk()
    for nbytes in sizes:
        n = max(world, nbytes // FLOAT32_BYTES // world * world)
        x = torch.ones(n)
        calls = {"all_reduce": lambda x=x: dist.all_reduce(x),
                 "all_gather": lambda x=x, n=n: dist.all_gather_into_tensor(torch.empty(n * world), x),
                 "reduce_scatter": lambda x=x, n=n: dist.reduce_scatter_tensor(torch.empty(n // world), x),
                 "all_to_all": lambda x=x: dist.all_to_all_single(torch.empty_like(x), x),
                 "broadcast": lambda x=x: dist.broadcast(x, 0)}
        for kind, fn in {**calls, **_functional_calls(x, n, world)}.items():
            points[kind].append((4 * n, in_situ(fn, chunk, reps)))
        for kind in BURST_KINDS:  # back to back, as a step's gradient reduction and ZeRO-1 broadcasts run them
            points[f"{BURST}:{kind}"].append((4 * n, _slowest_mean(calls[kind], reps)))
        if world == 2:
            def p2p(x: torch.Tensor = x) -> None:
                (dist.send(x, 1) if rank == 0 else dist.recv(x, 0))
            points["send"].append((4 * n, in_situ(p2p, chunk, reps)))
    dtensor = _dtensor_op_s(world)
    stacks = {"fsdp": _fsdp_stack(world, reps), "tp": _tp_stack(world, reps)}
    if rank == 0:
        Path(out).write_text(json.dumps({**points, "dtensor_op_s": dtensor, "stacks": stacks}))
    dist.barrier()
    dist.destroy_process_group()


IN_SITU_GEMM, IN_SITU_GEMMS = 256, 4  # the compute between two collectives of the loop: about 1 ms at 1 thread


def _compute_chunk() -> Callable[[], None]:
    """A rank's compute between two of its collectives in the in-situ loop (``in_situ``): a few GEMMs."""
    a = torch.randn(IN_SITU_GEMM, IN_SITU_GEMM) * IN_SITU_GEMM**-0.5  # unit scale: no denormals, no overflow

    def chunk() -> None:
        y = a
        for _ in range(IN_SITU_GEMMS):
            y = y @ a

    return chunk


def in_situ(fn: Callable[[], Any], chunk: Callable[[], None], reps: int,
            clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds one call of the collective ``fn`` adds to a step, measured as a step meets it: every rank runs
    ``reps`` iterations of ``chunk()`` (compute) then ``fn()``, with no barrier between them, and the same
    ``reps`` chunks alone right after; the slowest rank's mean per iteration of the first loop less the second's.

    Why not a barrier-aligned call's median: inside a step the ranks reach a collective at different moments (the
    same compute takes each process a different time on a shared host), the one that waits sleeps, and waking it
    and the transport's threads costs what a tight, aligned loop never shows; the compute after a wait also runs
    on cold caches. On the 2-core CPU machine a 64 KB all-reduce over 2 gloo ranks took 0.5-0.7 ms as the
    median of aligned calls and 1.3-1.4 ms per call as the mean of such a loop (``docs/plan.md``)."""
    return max(1e-7, _slowest_mean(lambda: (chunk(), fn()), reps, clock) - _slowest_mean(chunk, reps, clock))


def _slowest_mean(fn: Callable[[], Any], reps: int, clock: Callable[[], float] = time.perf_counter) -> float:
    """The slowest rank's mean seconds of ``fn`` over ``reps`` calls in a row after one, started together (a
    barrier) but with no barrier between the calls: their collectives meet their peers where they arrive."""
    import torch.distributed as dist

    fn()
    dist.barrier()
    t0 = clock()
    for _ in range(reps):
        fn()
    t = torch.tensor([(clock() - t0) / reps], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


STACK_UNITS, STACK_WIDTH, STACK_TOKENS = 6, 2**7, 2**8  # a few ms a unit's forward and backward at 1 thread


def _stack(units: int, width: int, inner: int) -> torch.nn.Module:
    """``units`` pre-norm MLP blocks (LayerNorm, Linear width -> inner, GELU, Linear inner -> width), the
    parameters of a small transformer block without its attention."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, inner),
                                                     torch.nn.GELU(), torch.nn.Linear(inner, width))
                                 for _ in range(units)))


def _step_s(m: torch.nn.Module, x: torch.Tensor, reps: int) -> float:
    """A forward and backward of ``m`` on ``x``: the slowest rank's mean seconds (``_slowest_mean``)."""
    return _slowest_mean(lambda: m(x).sum().backward(), reps)


def _fsdp_stack(world: int, reps: int) -> dict[str, Any]:
    """A stack of ``STACK_UNITS`` blocks, each its own FSDP2 unit (the engine's ZeRO-3: the root wrapped too,
    the units resharded after forward), a step's seconds against the same stack unsharded on every rank; its
    collectives' payload bytes and calls per kind (``stack_call_s`` prices them and takes the rest per call)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from dhp.parallel.comm import CommCounter

    mesh = init_device_mesh("cpu", (world,))
    plain, sharded = (_stack(STACK_UNITS, STACK_WIDTH, 4 * STACK_WIDTH) for _ in range(2))
    for unit in sharded:
        fully_shard(unit, mesh=mesh)
    fully_shard(sharded, mesh=mesh)
    x = torch.randn(STACK_TOKENS, STACK_WIDTH)
    with CommCounter() as counter:
        sharded(x).sum().backward()
    return {"sharded_s": _step_s(sharded, x, reps), "plain_s": _step_s(plain, x, reps),
            "bytes": dict(counter.bytes), "calls": dict(counter.calls), "dtensor_ops": 0, "path": C10D}


def _tp_stack(world: int, reps: int) -> dict[str, Any]:
    """The same stack under TP over ``world`` ranks (the up projection column-parallel, the down one
    row-parallel: ``parallelize_module``'s plans, as a TP language model's MLP) against the stack at the local
    shards' widths, unsharded; its DTensor collectives (functional) and the DTensor ops the tally counts."""
    from torch.distributed.device_mesh import init_device_mesh

    from dhp.parallel.comm import CommCounter
    from dhp.plan.ops import OpTally, merged

    local = _stack(STACK_UNITS, STACK_WIDTH, 4 * STACK_WIDTH // world)
    sharded, x = _tp_parallel_stack(init_device_mesh("cpu", (world,)), 4 * STACK_WIDTH)
    with CommCounter() as counter, OpTally() as tally:  # what a step dispatches once the caches are filled
        sharded(x).sum().backward()
    return {"sharded_s": _step_s(sharded, x, reps), "plain_s": _step_s(local, x, reps),
            "bytes": dict(counter.bytes), "calls": dict(counter.calls),
            "dtensor_ops": merged(tally.tally()).get("dtensor_ops", 0), "path": FUNCTIONAL}


def _tp_parallel_stack(mesh: Any, inner: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """``_stack`` of MLP width ``inner`` with its up projections column-parallel and its down projections
    row-parallel on ``mesh`` (``parallelize_module``'s plans, as a TP language model's MLP), and an input; one
    step already run, so DTensor's sharding propagation caches hold its shapes."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    sharded = _stack(STACK_UNITS, STACK_WIDTH, inner)
    for unit in sharded:
        parallelize_module(unit, mesh, {"1": ColwiseParallel(), "3": RowwiseParallel()})
    x = torch.randn(STACK_TOKENS, STACK_WIDTH, requires_grad=True)
    sharded(x).sum().backward()
    return sharded, x


def _dtensor_worker(rank: int, world: int, port: int, tp: int, reps: int, out: str, parent: int) -> None:
    """The TP stack of ``_tp_stack`` at its local shards' widths over ``tp`` ranks, parallelized by the same plans
    on a mesh of this one process (``world`` 1), against the same stack unsharded (each its least over ``reps``
    steps): DTensor's sharding propagation and redistributions without a collective, whose in-situ cost would
    drown them (the 2-rank stack's 12 all-reduces are about 2/3 of its step on the CPU machine, and vary by more
    than the dispatch costs)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from dhp.lifetime import exit_with_parent
    from dhp.plan.ops import OpTally, merged

    exit_with_parent(parent)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    local = _stack(STACK_UNITS, STACK_WIDTH, 4 * STACK_WIDTH // tp)
    sharded, x = _tp_parallel_stack(init_device_mesh("cpu", (world,)), 4 * STACK_WIDTH // tp)
    with OpTally() as tally:
        sharded(x).sum().backward()
    Path(out).write_text(json.dumps({"sharded_s": timed(lambda: sharded(x).sum().backward(), reps=reps),
                                     "plain_s": timed(lambda: local(x).sum().backward(), reps=reps),
                                     "dtensor_ops": merged(tally.tally()).get("dtensor_ops", 0)}))
    dist.destroy_process_group()


def stack_call_s(stack: dict[str, Any], world: int, fits: list[CollectiveFit], dtensor_op_s: float) -> float:
    """Seconds per collective call that a parallel stack's step took beyond what the model prices: its time less
    the plain stack's, less its collectives by the ``fits`` (their path's, in situ) and its DTensor ops'
    dispatch; the rest (the hooks' and redistributions' Python, copies the tally does not see as the stack's
    own) over its collective calls, at least 0."""
    p = Profile("stack", collectives=fits, link_bytes_per_s=1.0)
    calls = sum(stack["calls"].values())
    priced = sum(p.collective_s(k, world, b, stack["calls"].get(k, 1), stack["path"])
                 for k, b in stack["bytes"].items())
    rest = stack["sharded_s"] - stack["plain_s"] - priced - stack["dtensor_ops"] * dtensor_op_s
    return max(0.0, rest / max(1, calls))


def stack_op_s(stack: dict[str, Any]) -> float:
    """Seconds per DTensor op that a TP stack's step took beyond the same stack unsharded, measured where no
    collective runs (``_dtensor_worker``: a one-rank mesh): DTensor's dispatch as a TP layer meets it (its linears'
    views, transposes and matmuls on sharded specs, the redistributions and ``from_local`` around them), where a
    lone op on a replicated DTensor (``_dtensor_op_s``) is the fast path's floor. 0 where it ran no DTensor op."""
    if not stack["dtensor_ops"]:
        return 0.0
    return max(0.0, stack["sharded_s"] - stack["plain_s"]) / stack["dtensor_ops"]


def functional_name(kind: str) -> str:
    """The points' key of ``kind`` called through ``_functional_collectives``."""
    return f"{FUNCTIONAL}:{kind}"


def _functional_calls(x: torch.Tensor, n: int, world: int) -> dict[str, Callable[[], Any]]:
    """Each kind as DTensor calls it: the ``_c10d_functional`` op (a fresh output) and its ``wait_tensor``."""
    import torch.distributed as dist

    fc = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    split = [n // world] * world
    calls = {"all_reduce": lambda: fc.all_reduce(x, "sum", group),
             "all_gather": lambda: fc.all_gather_into_tensor(x, world, group),
             "reduce_scatter": lambda: fc.reduce_scatter_tensor(x, "sum", world, group),
             "all_to_all": lambda: fc.all_to_all_single(x, split, split, group)}
    return {functional_name(k): (lambda f=f: fc.wait_tensor(f())) for k, f in calls.items()}


def _dtensor_op_s(world: int, loops: int = 300) -> float:
    """Seconds DTensor's dispatch adds to one op, beyond the local op: the mean over an elementwise op, a
    scalar op, a view, a transpose and a matmul by a replicated weight (no communication) on a row-sharded
    DTensor, each less the same op on the local shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.ones(8 * world, 16), mesh, [Shard(0)])
    w = distribute_tensor(torch.ones(16, 16), mesh, [Replicate()])
    lx, lw = x.to_local(), w.to_local()
    pairs = [(lambda: x + x, lambda: lx + lx), (lambda: x * 2.0, lambda: lx * 2.0),
             (lambda: x.view(-1, 8), lambda: lx.view(-1, 8)), (lambda: x.t(), lambda: lx.t()),
             (lambda: x @ w, lambda: lx @ lw)]
    def many(fn: Callable[[], Any]) -> Callable[[], None]:
        return lambda: [fn() for _ in range(loops)]

    return statistics.mean(max(0.0, (timed(many(dt)) - timed(many(local))) / loops) for dt, local in pairs)


def _timed_ranks(fn: Callable[[], Any], reps: int = 9) -> float:
    """The median over ``reps`` of the slowest rank's time of ``fn`` (each started after a barrier): a whole loop
    of calls (the contention loops; a single collective is timed ``in_situ``)."""
    import torch.distributed as dist

    fn()
    out = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out.append(float(t))
    return statistics.median(out)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_ranks(target: Callable[..., None], world: int, args: tuple, what: str) -> dict[str, Any]:
    """Run ``target(rank, world, port, *args, out, parent)`` in ``world`` fresh local processes; -> the JSON
    rank 0 wrote to ``out``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "points.json")
        port = _free_port()
        procs = [ctx.Process(target=target, args=(r, world, port, *args, out, os.getpid())) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        if any(p.exitcode != 0 for p in procs) or not os.path.exists(out):
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise RuntimeError(f"dhp plan calibrate: {what} failed (exit codes {[p.exitcode for p in procs]})")
        return json.loads(Path(out).read_text())


def measure_collectives(ranks: tuple[int, ...], sizes: list[int], reps: int = IN_SITU_REPS
                        ) -> tuple[list[CollectiveFit], CollectiveFit | None, dict[str, float]]:
    """Fits per kind and group size over gloo, in ``ranks`` local processes each, of each size's ``in_situ`` time
    (``reps`` iterations), and of the same calls back to back (path ``BURST``); the send fit from 2 ranks; the
    host's terms (``Profile`` fields) from the first group's processes: ``dtensor_op_s``, DTensor's cost per op in
    a TP stack without communication (``stack_op_s`` of ``_dtensor_worker``; at least a lone op's,
    ``_dtensor_op_s``), and ``fsdp_call_s``, ``tp_call_s``, what an FSDP2 and a TP stack's collective calls cost
    beyond their in-situ fits and DTensor's ops (``stack_call_s``)."""
    fits, router, terms = [], None, {}
    for world in ranks:
        points = _run_ranks(_collective_worker, world, (sizes, reps), f"the {world}-process gloo collective run")
        dtensor = float(points.pop("dtensor_op_s"))
        stacks = points.pop("stacks")
        new = []
        for key, pts in points.items():
            if not pts:
                continue
            path, kind = key.split(":") if ":" in key else (C10D, key)
            fit = CollectiveFit(kind, world, *noisy_fit([(float(b), float(t)) for b, t in pts]), path)
            if kind == "send":
                router = fit
            else:
                new.append(fit)
        fits += new
        if not terms:
            dispatch = _run_ranks(_dtensor_worker, 1, (world, reps), "the DTensor dispatch run")
            op_s = max(dtensor, stack_op_s(dispatch))  # DTensor's cost per op, as a TP layer pays it
            terms = {"dtensor_op_s": op_s, **{f"{k}_call_s": stack_call_s(st, world, new, op_s)
                                              for k, st in stacks.items()}}
    return fits, router, terms


# ---- contention: collectives on an oversubscribed CPU host ----------------------------------------------------

CONTENTION_GEMM = 256  # the loop's GEMM (256^3: about as long as the all-reduce of 256 KB on its own)
CONTENTION_ITERS = 100


def _contention_worker(rank: int, world: int, port: int, iters: int, out: str, parent: int) -> None:
    """The slowest rank's seconds (median of 3) of ``iters`` GEMMs alone (``compute_s``) and of ``iters`` GEMMs
    each followed by an all-reduce of its result (``loop_s``), on this rank."""
    import torch.distributed as dist

    from dhp.lifetime import exit_with_parent

    exit_with_parent(parent)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    a = torch.randn(CONTENTION_GEMM, CONTENTION_GEMM)

    def compute() -> None:
        for _ in range(iters):
            a @ a

    def loop() -> None:
        for _ in range(iters):
            dist.all_reduce(a @ a)

    compute_s, loop_s = _timed_ranks(compute, reps=3), _timed_ranks(loop, reps=3)
    if rank == 0:
        Path(out).write_text(json.dumps({"compute_s": compute_s, "loop_s": loop_s, "calls": iters}))
    dist.barrier()
    dist.destroy_process_group()


def _busy(parent: int, ready: Any) -> None:
    """A one-thread process computing until it is killed (a neighbour worker on the host); ``ready`` (an event)
    is set once it computes."""
    from dhp.lifetime import exit_with_parent

    exit_with_parent(parent)
    torch.set_num_threads(1)
    a = torch.randn(CONTENTION_GEMM, CONTENTION_GEMM)
    a @ a
    ready.set()
    while True:
        a @ a


def contention_wait(alone: dict[str, float], beside: dict[str, float], calls: int) -> float:
    """Seconds per collective call that the loop's collectives took beside busy processes beyond processor
    sharing: their time alone (``loop_s - compute_s``) scaled by the slowdown the same ranks' GEMMs alone show
    (``compute_s`` beside over alone: the processor share they really got, whatever else the host runs), less
    from their time beside them; 0 if they took no more."""
    alone_coll = alone["loop_s"] - alone["compute_s"]
    beside_coll = beside["loop_s"] - beside["compute_s"]
    slowdown = beside["compute_s"] / max(alone["compute_s"], 1e-12)
    return max(0.0, beside_coll - max(0.0, alone_coll) * slowdown) / max(1, calls)


def measure_contention(cores: int, iters: int = CONTENTION_ITERS) -> tuple[float, float]:
    """(``contention_wait_s``, ``contention_ratio``): two ranks' loops (``_contention_worker``) alone, then beside
    ``cores`` busy one-thread processes (``cores + 2`` processes on ``cores`` cores, as a CPU bench's four workers
    on two cores): ``contention_wait`` per all-reduce, at ``(cores + 2) / cores`` processes per core."""
    alone = _run_ranks(_contention_worker, 2, (iters,), "the contention loop (alone)")
    with busy_host(cores):
        beside = _run_ranks(_contention_worker, 2, (iters,), "the contention loop (beside busy processes)")
    return contention_wait(alone, beside, iters), (cores + 2) / cores


@contextlib.contextmanager
def busy_host(processes: int) -> Iterator[None]:
    """``processes`` one-thread processes computing (``_busy``) while the block runs, which starts once they all
    compute: a host whose cores are taken, as a CPU run's workers take them."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready = [ctx.Event() for _ in range(processes)]
    busy = [ctx.Process(target=_busy, args=(os.getpid(), r), daemon=True) for r in ready]
    for p in busy:
        p.start()
    try:
        for r in ready:
            if not r.wait(timeout=120):
                raise RuntimeError("dhp plan calibrate: a busy process did not start within 120 s")
        yield
    finally:
        for p in busy:
            p.kill()
        for p in busy:
            p.join(timeout=30)


# ---- compute on a host whose every core is busy ------------------------------------------------------------------

BUSY_ITERS = 30  # iterations of the block loop (``_block_loop``); ``--quick``: half
BLOCK_TOKENS, BLOCK_WIDTH, BLOCK_HEAD = 2**8, 2**7, 2**6  # the block's sequence, width and head width


def _block_loop(iters: int, ready: Callable[[], Any] = lambda: None) -> float:
    """Seconds per iteration (median of 3 runs) of a small transformer block's forward and backward at one thread
    (GEMMs, attention, a norm, elementwise ops: a model's mix of compute- and memory-bound work); ``ready()`` is
    called after the warm-up, before the timed runs (a barrier: processes that must compute at once)."""
    import torch.nn.functional as F

    torch.set_num_threads(1)
    torch.manual_seed(0)
    t, w, d = BLOCK_TOKENS, BLOCK_WIDTH, BLOCK_HEAD
    x = torch.randn(t, w, requires_grad=True)
    w1, w2 = (torch.randn(a, b, requires_grad=True) for a, b in ((4 * w, w), (w, 4 * w)))
    qkv = torch.randn(3 * w, w, requires_grad=True)

    def block() -> None:
        h = F.layer_norm(x, (w,))
        q, k, v = F.linear(h, qkv).view(t, 3, w // d, d).permute(1, 2, 0, 3)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, w)
        y = x + a + F.linear(F.gelu(F.linear(h, w1)), w2)
        y.square().mean().backward()

    def run() -> None:
        for _ in range(iters):
            block()

    run()
    ready()
    return timed(run, "cpu", reps=3, warmup=0, stat=statistics.median) / iters


def _busy_worker(iters: int, out: str, parent: int, barrier: Any) -> None:
    """``_block_loop`` in a process of its own, timed once every such process has warmed up (``barrier``: they
    compute at once), its seconds per iteration written to ``out``."""
    from dhp.lifetime import exit_with_parent

    exit_with_parent(parent)
    Path(out).write_text(json.dumps(_block_loop(iters, lambda: barrier.wait(timeout=300))))


def busy_slowdown(alone_s: float, together_s: list[float]) -> float:
    """How much slower compute runs with every core busy: the processes' mean time per iteration, run one per
    core at once, over one process's alone (at least 1: a faster host than at the first run is noise)."""
    return max(1.0, sum(together_s) / len(together_s) / max(alone_s, 1e-12))


def measure_busy(cores: int, iters: int = BUSY_ITERS) -> float:
    """``Profile.busy_slowdown``: ``_block_loop`` alone (in this process, at one thread), then in ``cores``
    processes at once, started together after their warm-up (one thread each: a CPU bench's workers filling the
    host). Caches and memory bandwidth are shared between cores: what one process measures alone (the GEMM
    table, the bandwidth) runs this much slower on a full host."""
    import multiprocessing as mp

    threads = torch.get_num_threads()
    try:
        alone = _block_loop(iters)
    finally:
        torch.set_num_threads(threads)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(cores)
    with tempfile.TemporaryDirectory() as tmp:
        outs = [os.path.join(tmp, f"{k}.json") for k in range(cores)]
        procs = [ctx.Process(target=_busy_worker, args=(iters, o, os.getpid(), barrier)) for o in outs]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        if any(p.exitcode != 0 for p in procs) or not all(os.path.exists(o) for o in outs):
            for p in procs:
                if p.is_alive():
                    p.kill()
            raise RuntimeError("dhp plan calibrate: the block loop on every core failed")
        together = [json.loads(Path(o).read_text()) for o in outs]
    return busy_slowdown(alone, together)


def runtime_sizes(quick: bool) -> list[int]:
    return [2**12, 2**18, 2**22] if quick else [2**12, 2**16, 2**20, 2**22, 2**24]


def measure_runtime(sizes: list[int], reps: int = 15, busy_cores: int = 0) -> tuple[float, float, CollectiveFit]:
    """(the runtime's hop between two groups' calls; the same hop with ``busy_cores`` busy processes beside it, 0
    where not measured; the object store's ``alpha + bytes / beta``) of Ray on this machine, in a fresh local Ray
    (``dhp.runtime.cluster.init_local_ray``). The hop goes through the runtime's own call path
    (``dhp.plan.hop.measure_hop``: two groups of two ranks, one's call ending to the other's starting, no tensor
    between them: the router's transfers are priced by the fit); the fit is of a tensor one actor returns handed
    to another by reference (the ``ray`` data plane's transfer: put on return, fetched as the argument), less two
    no-op round trips."""
    import ray

    from dhp.plan.hop import measure_hop
    from dhp.runtime.cluster import init_local_ray

    started = not ray.is_initialized()
    if started:
        init_local_ray(num_cpus=2, log_to_driver=False)
    try:
        @ray.remote(num_cpus=0.5)
        class _Echo:
            def noop(self) -> None:
                return None

            def make(self, nbytes: int) -> torch.Tensor:
                return torch.ones(max(1, nbytes // FLOAT32_BYTES))

            def take(self, t: torch.Tensor) -> int:
                return int(t.numel())

        a, b = _Echo.remote(), _Echo.remote()
        ray.get([a.noop.remote(), b.noop.remote()])

        def median(fn: Callable[[], Any]) -> float:
            return timed(fn, reps=reps, stat=statistics.median)

        call = median(lambda: ray.get(a.noop.remote()))
        points = [(float(n), max(1e-7, median(lambda n=n: ray.get(b.take.remote(a.make.remote(n)))) - 2 * call))
                  for n in sizes]
        for actor in (a, b):
            ray.kill(actor)
        # the hop alone, and with every core taken, as a CPU run's workers take them while the driver hops
        hop, busy_hop = measure_hop(2, reps, nbytes=0, beside=(lambda: busy_host(busy_cores)) if busy_cores else None)
    finally:
        if started:
            ray.shutdown()
    return hop, busy_hop, CollectiveFit("object_store", 2, *noisy_fit(points))


def noisy_fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """``fit_alpha_beta``, or where noise hides the growth with the bytes (a loaded machine), the least time as
    alpha and the largest payload's rate as beta."""
    try:
        return fit_alpha_beta(points)
    except ValueError:
        alpha = min(t for _, t in points)
        b, t = max(points)
        return alpha, b / max(t, 1e-9)


def machine(device: str) -> str:
    if device == "cuda":
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}"
    return (f"{platform.machine()} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}")


def calibrate(device: str | None = None, quick: bool = False, extra_gemms: list[tuple[int, int, int]] = (),
              log: Callable[[str], None] = lambda s: None, threads: int | None = None, runtime: bool = True) -> Profile:
    """A measured profile of this machine's ``device`` (default: cuda when there is one, else cpu); ``threads``:
    torch's CPU threads while measuring (a CPU rank's: ``dhp train``'s Ray workers run one thread each);
    ``runtime``: also Ray's actor round trip and object store (``measure_runtime``; a local Ray is started)."""
    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        return _calibrate(device, quick, extra_gemms, log, runtime)
    finally:
        torch.set_num_threads(before)


def _calibrate(device: str | None, quick: bool, extra_gemms: list[tuple[int, int, int]],
               log: Callable[[str], None], runtime: bool = True) -> Profile:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise UsageError("dhp plan calibrate --on cuda: this machine has no CUDA device; calibrate on a GPU "
                         "machine, or this one with --on cpu")
    t0 = time.perf_counter()

    def say(what: str) -> None:
        log(f"dhp: plan calibrate: {what} ({time.perf_counter() - t0:.0f} s)")

    say(f"{device}: GEMMs")
    gemm = measure_gemms(sorted({*gemm_grid(quick), *extra_gemms}), ("float32", "bfloat16"), device)
    say("attention")
    attention = [p for dt in ("float32", "bfloat16") for p in measure_attention(quick, dt, device)]
    say("elementwise bandwidth, dispatch, syncs")
    hbm = measure_bandwidth(device, quick)
    per_op, per_sync = measure_host(device)
    base = roofline_for(device)
    fits: list[CollectiveFit] = []
    router, terms, contention_s, contention_ratio, busy = None, {}, 0.0, 0.0, 1.0
    note = ""
    if device == "cpu":
        say("collectives and DTensor's dispatch (gloo, local processes)")
        fits, router, terms = measure_collectives((2,) if quick else (2, 4), collective_sizes(quick),
                                                  IN_SITU_REPS // 2 if quick else IN_SITU_REPS)
        say("contention: collectives beside busy processes")
        contention_s, contention_ratio = measure_contention(os.cpu_count() or 1, 30 if quick else CONTENTION_ITERS)
        say("compute with every core busy")
        busy = measure_busy(os.cpu_count() or 1, BUSY_ITERS // 2 if quick else BUSY_ITERS)
    else:
        note = "; collectives: the device table's link (one GPU here)"
    call_s, busy_call_s, store = 0.0, 0.0, None
    if runtime:
        say("Ray: the runtime's hop between calls (alone and on a busy host), the object store")
        call_s, busy_call_s, store = measure_runtime(runtime_sizes(quick),
                                                     busy_cores=(os.cpu_count() or 1) if device == "cpu" else 0)
    say("done")
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    return Profile(name=name, source=CALIBRATED, device_type=device, machine=machine(device) + note,
                   created=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                   peak_flops=max(p.flops_per_s for p in gemm), hbm_bytes_per_s=hbm,
                   link_bytes_per_s=base.link_bytes_per_s if base else hbm, cpu_op_s=per_op, sync_s=per_sync,
                   **terms, async_launch=device == "cuda", gemm=gemm, attention=attention, collectives=fits,
                   router=router,
                   cores=(os.cpu_count() or 1) if device == "cpu" else 0,
                   threads=torch.get_num_threads() if device == "cpu" else 0, actor_call_s=call_s,
                   busy_call_s=busy_call_s,
                   object_store=store, contention_wait_s=contention_s, contention_ratio=contention_ratio,
                   busy_slowdown=busy)


def roofline_for(device: str) -> Profile | None:
    """The device table's roofline of this machine's CUDA device (its link bandwidth), None on CPU."""
    if device != "cuda":
        return None
    from dhp.observe.devices import detect_device

    dev = detect_device()
    return roofline(dev) if dev else None
