"""The runtime's step, replayed: the calls the Ray backend's driver makes, in its order, on priced calls.

The Ray backend (``dhp.backends.ray_backend.RayBackend.run_step``) walks ``dhp.data.sampler.schedule_turns``
and, per turn, submits calls to the module groups and waits for some of them; an actor runs its calls in
submission order. ``driver_script`` writes that same walk as data (submit a call, wait for calls), from the
same ``schedule_turns``, so the planner prices the order the runtime runs and the two cannot drift apart
(``tests/unit/test_plan_schedule.py`` checks the script against the backend's own submissions).

``replay`` then runs the script on a clock:

* a group's ranks work in lockstep: one *lane* per group, running one call at a time, in submission order;
* lanes draw on *pools* of compute (a CPU host's cores, the GPUs a collocated layout shares, a disaggregated
  group's own GPUs). A pool of capacity C shares itself among the lanes running on it: each gets
  ``min(1, C / demand)`` of its full rate (processor sharing), so two collocated groups on one GPU, or four
  one-thread CPU workers on two cores, slow each other down exactly while both run;
* on an oversubscribed pool (demand above capacity: a CPU host running more one-thread workers than it has
  cores) a call's collectives also wait for their peers' processes to be scheduled, which processor sharing
  does not count: each of a call's ``waits(call)`` peer waits costs the lane's ``wait_s`` x the share of time a
  peer is off its core, ``1 - capacity / demand`` (``Profile.contention_wait_coefficient``, measured by
  ``dhp plan calibrate``), spread over the call's work;
* every call pays the runtime's round trip (``call_s``: an actor call's submission to its start, half, and its
  result back to the driver, the other half); the driver is sequential, as the backend's loop is.

The result is the step's time, each group's busy and idle time and the critical path (the chain of calls,
back from the step's end, each waiting on the one before it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dhp.data.sampler import schedule_turns

FINAL = ("finish_gradients", "step")  # the step's end, on every group: the gradient reduction, the optimizer


@dataclass(frozen=True)
class Call:
    """One call of the step: ``kind`` on ``group`` for ``round`` (``source``: the encoder a router call is
    for). Kinds: forward, emit, backward (an encoder); forward_backward, emit_grads (the language model);
    finish_gradients, step (every group)."""

    group: str
    kind: str
    round: int = -1
    source: str = ""


@dataclass(frozen=True)
class Action:
    op: str  # submit | wait
    calls: tuple[Call, ...]


def driver_script(n_rounds: int, encoders: Sequence[str], language: str, window: int = 1, ahead: int = 0,
                  trains: dict[str, bool] | None = None, data_plane: str = "p2p") -> list[Action]:
    """The Ray backend's driver loop of one step as data (``data_plane``: ``p2p`` sends inside the compute
    calls; ``ray`` adds the router's ``emit`` calls, the object store's puts, which the driver waits for)."""
    trains = trains or dict.fromkeys(encoders, True)
    ray = data_plane != "p2p"
    out: list[Action] = []

    def submit(*calls: Call) -> None:
        out.append(Action("submit", calls))

    def wait(*calls: Call) -> None:
        out.append(Action("wait", calls))

    backwards = []
    for turn in schedule_turns(n_rounds, window, ahead):
        j = turn.round
        if turn.kind == "encode":
            submit(*(Call(e, "forward", j) for e in encoders))
            if ray:
                submit(*(Call(e, "emit", j) for e in encoders))
            continue
        wait(*(Call(e, "forward", j) for e in encoders))  # the forwards' metadata (p2p), or their refs
        if ray:
            wait(*(Call(e, "emit", j) for e in encoders))
        submit(Call(language, "forward_backward", j))
        grads = [Call(language, "emit_grads", j, e) for e in encoders if trains[e]] if ray else []
        if grads:
            submit(*grads)
        wait(Call(language, "forward_backward", j))  # the round's losses
        for e in encoders:
            if not trains[e]:
                continue
            if ray:
                wait(Call(language, "emit_grads", j, e))
            submit(Call(e, "backward", j))
            backwards.append(Call(e, "backward", j))
    if backwards:
        wait(*backwards)
    for kind in FINAL:
        calls = tuple(Call(g, kind) for g in [*encoders, language])
        submit(*calls)
        wait(*calls)
    return out


@dataclass(frozen=True)
class Lane:
    """A group's ranks as one lane: the pool it computes on and how much of it a running call takes."""

    pool: str
    demand: float = 1.0
    wait_s: float = 0.0  # a peer wait's seconds per unit of the share of time peers are off their cores


@dataclass
class Replay:
    step_s: float
    busy_s: dict[str, float]
    idle_s: dict[str, float]
    critical_path: str
    spans: list[tuple[Call, float, float]] = field(default_factory=list)  # (call, start, end) in run order


@dataclass
class _Run:
    call: Call
    ready: float  # submitted + half the round trip
    work: float  # seconds at the lane's full rate
    start: float = -1.0
    end: float = -1.0
    left: float = 0.0
    after: Call | None = None  # what held its start: the lane's previous call, or the driver's submission
    waits: float = 0.0  # its calls that wait for a peer rank (collectives, point-to-point transfers)


def replay(script: list[Action], lanes: dict[str, Lane], pools: dict[str, float],
           work: Callable[[Call], float], call_s: float = 0.0,
           waits: Callable[[Call], float] | None = None) -> Replay:
    """Run ``script`` (``driver_script``) with each call taking ``work(call)`` seconds at its lane's full rate;
    ``pools``: capacity per pool name; ``call_s``: an actor call's round trip; ``waits(call)``: its peer waits
    (priced on an oversubscribed pool only; see the module docstring)."""
    queues: dict[str, list[_Run]] = {g: [] for g in lanes}
    runs: dict[Call, _Run] = {}
    now, driver, last_seen = 0.0, 0.0, None
    pc = 0
    while True:
        # the driver runs until it must wait for a call that has not ended
        while pc < len(script):
            act = script[pc]
            if act.op == "submit":
                for c in act.calls:
                    r = _Run(c, driver + call_s / 2, max(0.0, work(c)), after=last_seen,
                             waits=max(0.0, waits(c)) if waits else 0.0)
                    r.left = r.work
                    runs[c] = r
                    queues[c.group].append(r)
                pc += 1
                continue
            pending = [runs[c] for c in act.calls]
            if any(r.end < 0 for r in pending):
                break
            last = max(pending, key=lambda r: r.end)
            driver = max(driver, last.end + call_s / 2)
            last_seen = last.call
            pc += 1
        if pc >= len(script):
            break
        now = _advance(queues, lanes, pools, now, driver)
    step = driver
    busy = {g: sum(r.end - r.start for r in q) for g, q in queues.items()}
    spans = sorted(((r.call, r.start, r.end) for r in runs.values()), key=lambda s: s[1])
    return Replay(step, busy, {g: max(0.0, step - b) for g, b in busy.items()}, _critical(runs, last_seen), spans)


def _advance(queues: dict[str, list[_Run]], lanes: dict[str, Lane], pools: dict[str, float], now: float,
             driver: float) -> float:
    """Move the clock to the next call's end (the driver is waiting for one): lanes start their next call when
    it is ready, running calls share their pools."""
    while True:
        running = {}
        for g, q in queues.items():
            head = next((r for r in q if r.end < 0), None)
            if head is None:
                continue
            if head.start < 0:
                prev = q[q.index(head) - 1] if q.index(head) else None
                if head.ready > now:
                    continue
                head.start = now
                if prev is not None and prev.end >= head.ready:
                    head.after = prev.call
            running[g] = head
        waiting = [r.ready for q in queues.values() for r in q if r.start < 0 and r.end < 0 and r.ready > now]
        if not running:
            if not waiting:
                raise RuntimeError("schedule replay: the driver waits for a call no lane will run")
            now = min(waiting)
            continue
        demand: dict[str, float] = {}
        for g in running:
            demand[lanes[g].pool] = demand.get(lanes[g].pool, 0.0) + lanes[g].demand
        rate = {g: run_rate(r, lanes[g], pools[lanes[g].pool], demand[lanes[g].pool]) for g, r in running.items()}
        dt = min(r.left / rate[g] for g, r in running.items())
        if waiting:
            dt = min(dt, min(waiting) - now)
        now += dt
        ended = False
        for g, r in running.items():
            r.left -= dt * rate[g]
            if r.left <= 1e-12:
                r.left, r.end, ended = 0.0, now, True
        if ended:
            return now


def run_rate(run: _Run, lane: Lane, capacity: float, demand: float) -> float:
    """Work seconds per second of a running call: its share of the pool, ``min(1, capacity / demand)``, and on an
    oversubscribed pool its peer waits spread over its work, ``waits / work x wait_s x (1 - capacity / demand)``
    seconds more per second of work."""
    share = min(1.0, capacity / demand)
    off = 1.0 - share
    if off <= 0.0 or lane.wait_s <= 0.0 or run.waits <= 0.0 or run.work <= 0.0:
        return share
    return 1.0 / (1.0 / share + run.waits / run.work * lane.wait_s * off)


def _critical(runs: dict[Call, _Run], last: Call | None) -> str:
    """The groups along the chain of calls that held the step's end, from the first: each call's start waited
    for its lane's previous call or for the driver, whose submission waited for the call it saw end last."""
    chain: list[str] = []
    seen: set[Call] = set()
    while last is not None and last not in seen:
        seen.add(last)
        if not chain or chain[-1] != last.group:
            chain.append(last.group)
        last = runs[last].after
    return _compact(list(reversed(chain)))


def _compact(chain: list[str]) -> str:
    """``a -> b -> a -> b -> a -> b -> a`` as ``(a -> b) x 3 -> a``: a chain of many rounds stays readable."""
    out, i = [], 0
    while i < len(chain):
        n = 1
        while i + 2 * n + 1 < len(chain) + 1 and chain[i + 2 * n:i + 2 * n + 2] == chain[i:i + 2]:
            n += 1
        if n >= 3 and i + 1 < len(chain):
            out.append(f"({chain[i]} -> {chain[i + 1]}) x {n}")
            i += 2 * n
        else:
            out.append(chain[i])
            i += 1
    return " -> ".join(out)
