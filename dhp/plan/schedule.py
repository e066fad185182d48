"""The runtime's step, replayed: the calls the Ray backend's driver makes, in its order, on priced calls.

The Ray backend (``dhp.backends.ray_backend.RayBackend.run_step``) walks ``dhp.data.sampler.schedule_turns``
and, per turn, submits calls to the module groups and waits for some of them; an actor runs its calls in
submission order. ``driver_script`` writes that same walk as data (submit a call, wait for calls), from the
same ``schedule_turns``, so the planner prices the order the runtime runs and the two cannot drift apart
(``tests/distributed/test_ray_train.py::test_the_drivers_calls_are_the_planners_script`` checks the script against
the backend's own submissions and waits in a real step, call by call).

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
* on a host pool, compute slows as the pool fills (shared caches and memory bandwidth): a call's compute seconds
  take ``Lane.busy_slowdown`` (``Profile.busy_slowdown``, measured with every core busy) times longer on a full
  pool, in proportion between one running process and a full pool (``run_rate``);
* every call pays the runtime's hop (``call_s``: an actor call's submission to its start, half, and its result
  back to the driver, the other half); the driver is sequential, as the backend's loop is; where its process
  shares a pool with the calls (``driver_pool``, a CPU host), its hop grows as the calls running there fill the
  pool, to ``busy_call_s`` on a full one (``pool_fill``, as compute slows);
* on the p2p data plane the tensors travel inside the calls: the driver submits a round's text step and its
  encoder backwards together and takes the losses at the step's end, and a backward, which receives its
  gradients inside the call, computes once its round's text step has ended (``_Run.inputs``);
* with ``loads`` the loaders run too: each group's ranks decode their samples in background threads (a lane of
  their own, ``loader_lane``, on the pool the loaders' CPUs are in), a round as the backend prefetches it: the
  round after next at each encode turn, and the next step's first two rounds once a group has taken its last
  samples (an encoder's after its last forward, the text's after its last step). The prefetch is a call on the
  group's actors, so a load starts once the group's calls submitted before it have run. A round's forward waits
  for its samples: ``Replay.data_wait_s``. The step's own first two rounds were started during the step before,
  so the replay begins with what of them was left then (``Call.source == "carried"``; ``steady_replay`` finds it:
  the loads left at a step's end are the next step's).

The result is the step's time, each group's busy and idle time, its wait for data, and the critical path (the chain
of calls, back from the step's end, each waiting on the one before it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dhp.data.sampler import schedule_turns

FINAL = ("finish_gradients", "step")  # the step's end, on every group: the gradient reduction, the optimizer


@dataclass(frozen=True)
class Call:
    """One call of the step: ``kind`` on ``group`` for ``round`` (``source``: the encoder a router call is
    for; a load's step, ``carried`` or ``next``). Kinds: forward, emit, backward (an encoder); forward_backward,
    emit_grads (the language model); finish_gradients, step (every group); load (every group's loaders, on a lane
    of their own: ``loader_lane``)."""

    group: str
    kind: str
    round: int = -1
    source: str = ""

    @property
    def lane(self) -> str:
        return loader_lane(self.group) if self.kind == "load" else self.group


def loader_lane(group: str) -> str:
    """The lane of ``group``'s loaders (its ranks' background decoding)."""
    return f"{group} loader"


@dataclass(frozen=True)
class Action:
    op: str  # submit | wait
    calls: tuple[Call, ...]


def driver_script(n_rounds: int, encoders: Sequence[str], language: str, window: int = 1, ahead: int = 0,
                  trains: dict[str, bool] | None = None, data_plane: str = "p2p", loads: bool = False) -> list[Action]:
    """The Ray backend's driver loop of one step as data (``data_plane``: ``p2p`` sends inside the compute
    calls; ``ray`` adds the router's ``emit`` calls, the object store's puts, which the driver waits for;
    ``loads``: the loaders' prefetches, ``RayBackend._prefetch``, in a step that follows another)."""
    trains = trains or dict.fromkeys(encoders, True)
    ray = data_plane != "p2p"
    out: list[Action] = []
    groups = [*encoders, language]

    def submit(*calls: Call) -> None:
        out.append(Action("submit", calls))

    def wait(*calls: Call) -> None:
        out.append(Action("wait", calls))

    def load(rounds: Sequence[int], source: str = "", of: Sequence[str] = groups) -> None:
        calls = [Call(g, "load", n, source) for n in rounds if n < n_rounds for g in of]
        if loads and calls:
            submit(*calls)

    load((0, 1), "carried")  # started in the step before (the backend's prefetch of rounds 0 and 1 finds them)
    backwards, texts = [], []
    for turn in schedule_turns(n_rounds, window, ahead):
        j = turn.round
        if turn.kind == "encode":
            if j > 0:
                load((j + 1,))  # the loaders keep a round ahead of the forwards
            submit(*(Call(e, "forward", j) for e in encoders))
            if ray:
                submit(*(Call(e, "emit", j) for e in encoders))
            if j == n_rounds - 1:  # the encoders' loaders: the next step's first rounds, behind the last forward
                load((0, 1), "next", encoders)
            continue
        wait(*(Call(e, "forward", j) for e in encoders))  # the forwards' metadata (p2p), or their refs
        if ray:
            wait(*(Call(e, "emit", j) for e in encoders))
        submit(Call(language, "forward_backward", j))
        grads = [Call(language, "emit_grads", j, e) for e in encoders if trains[e]] if ray else []
        if grads:
            submit(*grads)
        if ray:  # the round's losses; on p2p the driver takes them all at the step's end
            wait(Call(language, "forward_backward", j))
        texts.append(Call(language, "forward_backward", j))
        for e in encoders:
            if not trains[e]:
                continue
            if ray:
                wait(Call(language, "emit_grads", j, e))
            submit(Call(e, "backward", j))
            backwards.append(Call(e, "backward", j))
    load((0, 1), "next", [language])  # the text loaders', behind its last forward_backward
    if texts and not ray:
        wait(*texts)
    if backwards:
        wait(*backwards)
    for kind in FINAL:
        calls = tuple(Call(g, kind) for g in [*encoders, language])
        submit(*calls)
        wait(*calls)
    return out


@dataclass(frozen=True)
class Lane:
    """A group's ranks (or their loaders) as one lane: the pool it computes on and how much of it a running call
    takes."""

    pool: str
    demand: float = 1.0
    wait_s: float = 0.0  # a peer wait's seconds per unit of the share of time peers are off their cores
    busy_slowdown: float = 1.0  # its compute's slowdown on a full pool (a CPU host: ``Profile.busy_slowdown``)


@dataclass
class Replay:
    step_s: float
    busy_s: dict[str, float]  # per group: its calls' time (loaders not counted)
    idle_s: dict[str, float]
    critical_path: str
    spans: list[tuple[Call, float, float]] = field(default_factory=list)  # (call, start, end) in run order
    data_wait_s: dict[str, float] = field(default_factory=dict)  # per group: its calls' waits for their samples
    loader_s: dict[str, float] = field(default_factory=dict)  # per group: its loaders' running time in the step
    left: dict[Call, float] = field(default_factory=dict)  # work of the loads the step's end left unfinished


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
    compute: float = 0.0  # the part of ``work`` that is compute (slowed on a full pool)
    needs: _Run | None = None  # the load of its samples (a forward's), which must end before it starts
    data_wait: float = 0.0  # how long ``needs`` held its start
    inputs: _Run | None = None  # a call that must end before it starts: the one whose output it receives inside
    # itself (an encoder's backward, the text step's gradients: submitted together on the p2p plane), or, for a
    # load, its group's call submitted before it (the prefetch is an actor call, run in submission order)


def _needs(c: Call, runs: dict[Call, _Run]) -> _Run | None:
    """The load a call takes its samples from: an encoder's forward's, or the language model's."""
    if c.kind not in ("forward", "forward_backward"):
        return None
    return runs.get(Call(c.group, "load", c.round, "carried")) or runs.get(Call(c.group, "load", c.round))


def _inputs(c: Call, runs: dict[Call, _Run], queues: dict[str, list[_Run]]) -> _Run | None:
    """The call ``c`` cannot start before: an encoder backward's, the text step of its round (whose gradients it
    receives inside itself); a load's, its group's last call (the backend's ``prefetch`` is a call on the group's
    actors, behind the calls submitted before it; the loads carried from the step before had started)."""
    if c.kind == "backward":
        return next((r for k, r in runs.items() if k.kind == "forward_backward" and k.round == c.round), None)
    if c.kind == "load" and c.source != "carried" and queues.get(c.group):
        return queues[c.group][-1]
    return None


def replay(script: list[Action], lanes: dict[str, Lane], pools: dict[str, float],
           work: Callable[[Call], float], call_s: float = 0.0,
           waits: Callable[[Call], float] | None = None, compute: Callable[[Call], float] | None = None,
           busy_call_s: float = 0.0, driver_pool: str | None = None) -> Replay:
    """Run ``script`` (``driver_script``) with each call taking ``work(call)`` seconds at its lane's full rate;
    ``pools``: capacity per pool name; ``call_s``: the runtime's hop between calls; ``waits(call)``: its peer waits
    (priced on an oversubscribed pool only); ``compute(call)``: its compute seconds (slowed on a full pool; default
    none); ``busy_call_s``, ``driver_pool``: the hop on a full pool, and the pool the driver's process shares (a CPU
    host's: its hops grow towards ``busy_call_s`` as the calls running there fill it); see the module docstring.
    ``lanes``: per group, and per group's loaders (``loader_lane``) where the script loads."""
    queues: dict[str, list[_Run]] = {g: [] for g in lanes}
    runs: dict[Call, _Run] = {}
    now, driver, last_seen = 0.0, 0.0, None
    pc = 0

    def hop(t: float) -> float:
        """The driver's hop at time ``t``: ``call_s``, up to ``busy_call_s`` on a full ``driver_pool``."""
        if driver_pool is None or busy_call_s <= call_s:
            return call_s
        demand = sum(lanes[r.call.lane].demand for r in runs.values() if lanes[r.call.lane].pool == driver_pool
                     and 0.0 <= r.start <= t and (r.end < 0 or r.end > t))
        return call_s + (busy_call_s - call_s) * pool_fill(pools[driver_pool], demand)

    while True:
        # the driver runs until it must wait for a call that has not ended
        while pc < len(script):
            act = script[pc]
            if act.op == "submit":
                for c in act.calls:
                    r = _Run(c, driver + hop(driver) / 2, max(0.0, work(c)), after=last_seen,
                             waits=max(0.0, waits(c)) if waits else 0.0,
                             compute=max(0.0, compute(c)) if compute else 0.0, needs=_needs(c, runs),
                             inputs=_inputs(c, runs, queues))
                    r.left = r.work
                    runs[c] = r
                    queues[c.lane].append(r)
                pc += 1
                continue
            pending = [runs[c] for c in act.calls]
            if any(r.end < 0 for r in pending):
                break
            last = max(pending, key=lambda r: r.end)
            driver = max(driver, last.end + hop(last.end) / 2)
            last_seen = last.call
            pc += 1
        if pc >= len(script):
            break
        now = _advance(queues, lanes, pools, now, driver)
    step = driver
    loader_lanes = {loader_lane(g) for g in queues}
    groups = [g for g in queues if g not in loader_lanes]
    busy = {g: sum(r.end - r.start for r in queues[g]) for g in groups}
    ran = [r for r in runs.values() if r.start >= 0]
    spans = sorted(((r.call, r.start, r.end) for r in ran if r.end >= 0), key=lambda s: s[1])
    loads = [r for r in ran if r.call.kind == "load"]
    return Replay(step, busy, {g: max(0.0, step - b) for g, b in busy.items()}, _critical(runs, last_seen), spans,
                  data_wait_s={g: sum(r.data_wait for r in queues[g]) for g in groups},
                  loader_s={g: sum(min(r.end if r.end >= 0 else now, step) - r.start for r in loads
                                   if r.call.group == g) for g in groups},
                  left={r.call: r.left for r in runs.values() if r.call.kind == "load" and r.end < 0})


def steady_replay(script: list[Action], lanes: dict[str, Lane], pools: dict[str, float],
                  work: Callable[[Call], float], call_s: float = 0.0, waits: Callable[[Call], float] | None = None,
                  compute: Callable[[Call], float] | None = None, busy_call_s: float = 0.0,
                  driver_pool: str | None = None) -> Replay:
    """``replay`` of a step among others: its carried loads (``driver_script(loads=True)``) are what the same
    step left of its ``next`` loads at its end (a first replay with none carried finds it)."""
    first = replay(script, lanes, pools, lambda c: 0.0 if c.source == "carried" else work(c), call_s, waits, compute,
                   busy_call_s, driver_pool)
    carried = {(c.group, c.round): left for c, left in first.left.items() if c.source == "next"}
    return replay(script, lanes, pools,
                  lambda c: carried.get((c.group, c.round), 0.0) if c.source == "carried" else work(c),
                  call_s, waits, compute, busy_call_s, driver_pool)


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
                if head.ready > now or any(d is not None and d.end < 0 for d in (head.needs, head.inputs)):
                    continue
                head.start = now
                free = max(head.ready, prev.end if prev is not None else 0.0)
                if prev is not None and prev.end >= head.ready:
                    head.after = prev.call
                if head.inputs is not None and head.inputs.end > free:  # it waited for its gradients, or its actor
                    free, head.after = head.inputs.end, head.inputs.call
                if head.needs is not None and head.needs.end > free:  # it waited for its samples
                    head.data_wait, head.after = head.needs.end - free, head.needs.call
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
        dt = min(r.left / rate[g] if r.left > 0 else 0.0 for g, r in running.items())
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


def pool_fill(capacity: float, demand: float) -> float:
    """How full a pool is, from 0 (one process running alone, as the profile's tables were measured) to 1 (every
    unit busy): ``(min(demand, capacity) - 1) / (capacity - 1)``."""
    if capacity <= 1.0:
        return 0.0
    return min(1.0, max(0.0, (min(demand, capacity) - 1.0) / (capacity - 1.0)))


def run_rate(run: _Run, lane: Lane, capacity: float, demand: float) -> float:
    """Work seconds per second of a running call: its share of the pool, ``min(1, capacity / demand)``; its
    compute slowed on a filling pool, ``compute / work x (busy_slowdown - 1) x pool_fill`` seconds more per
    second of work; and on an oversubscribed pool its peer waits spread over its work, ``waits / work x wait_s x
    (1 - capacity / demand)`` seconds more."""
    share = min(1.0, capacity / demand)
    off = 1.0 - share
    if run.work <= 0.0:
        return share
    slow = min(1.0, run.compute / run.work) * (lane.busy_slowdown - 1.0) * pool_fill(capacity, demand)
    wait = run.waits / run.work * lane.wait_s * off if off > 0.0 else 0.0
    return 1.0 / ((1.0 + slow) / share + wait)


def _critical(runs: dict[Call, _Run], last: Call | None) -> str:
    """The groups along the chain of calls that held the step's end, from the first: each call's start waited
    for its lane's previous call or for the driver, whose submission waited for the call it saw end last."""
    chain: list[str] = []
    seen: set[Call] = set()
    while last is not None and last not in seen:
        seen.add(last)
        if not chain or chain[-1] != last.lane:
            chain.append(last.lane)
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
