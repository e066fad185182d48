"""Layouts side by side: which fit, how fast, from the fake runs of ``dhp.plan.measure``.

Any family: the rows are built from its modules (``family.encoders``, ``family.language``), what each supports
(``module.inner``: Ulysses SP, TP; ``module.check_layout``: which degrees its heads allow) and its synthetic
samples (``family.synthetic_sample``); nothing here names a module. Strategies, on the same GPUs and the same
global batch (``micro_batch_size`` samples per GPU per step):

* ``zero3``: FSDP2 (ZeRO-3) over all GPUs for every module, collocated;
* ``uniform-tp``: one TP degree for every module that has TP (the SPMD baseline; a module without TP runs data
  parallel), ZeRO-1 over dp, collocated;
* ``dhp-collocated``: each encoder Ulysses SP x DP (its SP degree searched) and the language model TP x DP on
  the same GPUs, taking turns;
* ``dhp-disaggregated``: m_e GPUs for each encoder, the rest for the language model, the splits searched;

each with and without activation checkpointing (every module). A group's figures come from one fake run of
one of its ranks (``measure_model``); a run is keyed by what changes it, so layouts share runs.

Step time (stated, not tuned): every op a group's rank dispatches in its fake run (``dhp.plan.ops``) priced on
a device profile (``dhp.plan.profile``: measured by ``dhp plan calibrate``, else the device table's roofline),
collectives as alpha + bytes / beta, FSDP2's overlapped with the compute where the device has streams
(``dhp.plan.costs``). Per step a group runs its replica's micro-batches, its gradient reduction and its
optimizer step (the ops the fake run dispatched for them). Router bytes (the encoders' embeddings and their
gradients) cross the router's link once per micro-batch. The step is the runtime's own order replayed
(``dhp.plan.schedule``: the Ray backend's calls from ``schedule_turns``, the trainer's batch plan, groups sharing
their pools while they run at once, every call's round trip). A collocated GPU holds,
while one group runs, the other groups' weights, gradients, optimizer state and (an encoder) the activations it
keeps for its backward. Each group may have its own device (``Pricing``: a pool of its own, the router over the
link between pools).
"""

from __future__ import annotations

import itertools
import os
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from dhp.observe.devices import Device
from dhp.plan.costs import GroupCost, group_cost
from dhp.plan.measure import GiB, GroupJob, GroupResult, family_of, media_of, sample_tokens
from dhp.plan.profile import Profile, roofline
from dhp.plan.schedule import Call, Lane, Replay, driver_script, loader_lane, steady_replay

STRATEGIES = ("dhp-collocated", "dhp-disaggregated", "uniform-tp", "zero3")
SP_DEGREES = (1, 2, 4, 8, 16)  # Ulysses degrees searched for an encoder
MAX_TP = 8  # TP within a node


@dataclass
class Row:
    strategy: str
    media: Any  # the sample's media, ``{encoder: tokens of its own input}`` (an int: the first encoder's)
    ac: bool
    jobs: dict[str, GroupJob]
    placement: str = "collocated"
    fits: bool = False
    step_time_s: float = 0.0
    tokens_per_s: float = 0.0
    groups: dict[str, dict[str, float]] = field(default_factory=dict)
    tokens_per_sample: int = 0  # the language model's sequence per sample (text and placeholders)
    critical_path: str = ""  # the groups whose work the step waits on, in order
    pricing: str = ""  # what priced it: the device profile(s), ``roofline`` or ``calibrated``
    encoders_ahead: int = 1  # runtime.encoders_ahead (disaggregated placement)
    encoder_window: int = 0  # runtime.encoder_window (0: auto)
    # seconds a rank's loader takes per sample, per group (its media decoded: an encoder's; ids and placeholders: the
    # language model's), measured on a config's own data (``dhp bench --profile``); empty: loading not priced
    load_s: dict[str, float] = field(default_factory=dict)
    loader_workers: int = 2  # data.loader_workers: 0, the samples are loaded in the calls themselves
    replay: Replay | None = field(default=None, repr=False, compare=False)  # the step as replayed (not in JSON)

    def overrides(self) -> list[str]:
        """The config keys of the row's layout, every module's (``module.parallel.*``, checkpointing), the placement
        and the precision."""
        out = []
        for name, j in self.jobs.items():
            out += [f"{name}.parallel.dp={j.dp}",
                    f"{name}.parallel.sp={j.inner if j.inner_kind == 'sp' else 1}",
                    f"{name}.parallel.tp={j.inner if j.inner_kind == 'tp' else 1}",
                    f"{name}.parallel.zero={j.zero}",
                    f"{name}.parallel.sequence_parallel={str(j.sequence_parallel).lower()}"]
        out += [f"{name}.activation_checkpointing={str(j.activation_checkpointing).lower()}"
                for name, j in self.jobs.items()]
        out += [f"{name}.lora.r={j.lora_rank}" for name, j in self.jobs.items() if j.lora_rank]
        precision = next(iter(self.jobs.values())).precision
        return out + [f"runtime.placement={self.placement}"] + (
            [f"train.precision={precision}"] if precision != "fp32_master" else [])

    def media_tokens(self) -> dict[str, int]:
        return dict(self.media) if not isinstance(self.media, int) else {}

    def to_dict(self) -> dict[str, Any]:
        return {"strategy": self.strategy, "overrides": self.overrides(), "media_tokens": self.media_tokens(),
                "fits": self.fits, "step_time_s": float(self.step_time_s), "tokens_per_s": float(self.tokens_per_s),
                "critical_path": self.critical_path, "pricing": self.pricing, "groups": self.groups}


def as_media(media: Any, family: Any) -> dict[str, int]:
    """``{encoder: tokens}`` from a dict, or from an int (the family's first encoder's tokens)."""
    if isinstance(media, int):
        return {family.encoders[0].name: media} if family.encoders else {}
    return {str(k): int(v) for k, v in dict(media).items()}


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def _fits(module: Any, model_cfg: Any, sp: int = 1, tp: int = 1) -> bool:
    """Whether the module supports ``sp``/``tp`` on this model (its kinds of inner parallelism, its heads...)."""
    for kind, n in (("sp", sp), ("tp", tp)):
        if n > 1 and kind not in module.inner:
            return False
    return module.check_layout(model_cfg, sp, tp) is None


class _Jobs:
    """The GroupJobs of one (media, checkpointing) point: a module's job on ``n`` GPUs in each layout kind."""

    def __init__(self, family: Any, model_cfg: Any, base: dict[str, Any]) -> None:
        self.family, self.model_cfg, self.base = family, model_cfg, base

    def language(self, n: int, t: int) -> GroupJob:
        # TP with Megatron sequence parallelism where the module has it, as a skilled user runs it: the residual
        # stream, norms and the blocks' saved inputs are split over the tp ranks (all-gather + reduce-scatter in
        # place of each all-reduce, the same bytes)
        lang = self.family.language
        dp = n // t
        return GroupJob(lang.name, dp=dp, inner=t, inner_kind="tp" if t > 1 else "none", zero=1 if dp > 1 else 0,
                        sequence_parallel=t > 1 and lang.sequence_parallel, **self.base)

    def encoder(self, name: str, m: int, s: int, kind: str = "sp") -> GroupJob:
        dp = m // s
        return GroupJob(name, dp=dp, inner=s, inner_kind=kind if s > 1 else "none",
                        zero=1 if dp * (s if kind == "sp" else 1) > 1 else 0, **self.base)

    def text_tp(self, n: int) -> int:
        """The language model's own TP degree on ``n`` GPUs: the largest its heads allow (at most ``MAX_TP``)."""
        lang = self.family.language
        return max(t for t in _divisors(n, MAX_TP) if _fits(lang, self.model_cfg, tp=t))

    def sp_degrees(self, enc: Any, m: int) -> list[int]:
        return [s for s in SP_DEGREES if m % s == 0 and _fits(enc, self.model_cfg, sp=s)]


def candidate_rows(model_cfg: Any, gpus: int, media: list, text_tokens: int, mbs: int,
                   strategies: tuple[str, ...] = STRATEGIES, device: str = "cuda", precision: str = "fp32_master",
                   family: Any = None) -> list[Row]:
    """Every row of every strategy at every media point (``media``: ``{encoder: tokens}`` per point; an int, the
    family's first encoder's tokens)."""
    family = family_of(family)
    rows = []
    for point in media:
        tokens = as_media(point, family)
        per_sample = sample_tokens(family, model_cfg, tokens, text_tokens)
        for ac in (False, True):
            base = dict(media=media_of(tokens), text_tokens=text_tokens, micro_batch_size=mbs, device=device,
                        precision=precision, activation_checkpointing=ac)
            jobs = _Jobs(family, model_cfg, base)
            new = [*_zero3(jobs, gpus, strategies), *_uniform_tp(jobs, gpus, strategies),
                   *_collocated(jobs, gpus, strategies), *_disaggregated(jobs, gpus, strategies)]
            rows += [replace(r, media=media_of(tokens), ac=ac, tokens_per_sample=per_sample) for r in new]
    return rows


def _row(strategy: str, jobs: dict[str, GroupJob], placement: str = "collocated") -> Row:
    return Row(strategy, (), False, jobs, placement=placement)


def _zero3(j: _Jobs, gpus: int, strategies: tuple[str, ...]) -> list[Row]:
    if "zero3" not in strategies or gpus <= 1:
        return []
    return [_row("zero3", {m.name: GroupJob(m.name, dp=gpus, zero=3, **j.base) for m in j.family.modules})]


def _uniform_tp(j: _Jobs, gpus: int, strategies: tuple[str, ...]) -> list[Row]:
    """One TP degree for every module that has TP, the largest every module's ``check_layout`` accepts (heads,
    key/value heads; an MLP width only where the family cannot shard it unevenly)."""
    if "uniform-tp" not in strategies:
        return []
    with_tp = [m for m in j.family.modules if "tp" in m.inner]
    tp = max(t for t in _divisors(gpus, MAX_TP) if all(_fits(m, j.model_cfg, tp=t) for m in with_tp))
    jobs = {e.name: j.encoder(e.name, gpus, tp if "tp" in e.inner else 1, "tp") for e in j.family.encoders}
    lang = j.family.language
    jobs[lang.name] = j.language(gpus, tp if "tp" in lang.inner else 1)
    return [_row("uniform-tp", jobs)]


def _collocated(j: _Jobs, gpus: int, strategies: tuple[str, ...]) -> list[Row]:
    """Every combination of the encoders' SP degrees, the language model at its own TP, on all GPUs."""
    if "dhp-collocated" not in strategies:
        return []
    encs = j.family.encoders
    lang = j.language(gpus, j.text_tp(gpus))
    rows = []
    for degrees in itertools.product(*(j.sp_degrees(e, gpus) for e in encs)):
        jobs = {e.name: j.encoder(e.name, gpus, s) for e, s in zip(encs, degrees, strict=True)}
        rows.append(_row("dhp-collocated", jobs | {lang.module: lang}))
    return rows


def _splits(gpus: int, encoders: int) -> list[tuple[int, ...]]:
    """GPUs per encoder (each an eighth, a quarter or half of them), leaving at least one for the language model."""
    sizes = sorted({max(1, gpus // share) for share in (8, 4, 2)})  # an eighth, a quarter, half of the GPUs
    return [s for s in itertools.product(sizes, repeat=encoders) if sum(s) < gpus]


def _disaggregated(j: _Jobs, gpus: int, strategies: tuple[str, ...]) -> list[Row]:
    if "dhp-disaggregated" not in strategies or gpus <= 1:
        return []
    encs = j.family.encoders
    rows = []
    for split in _splits(gpus, len(encs)):
        n = gpus - sum(split)
        lang = j.language(n, j.text_tp(n))
        for degrees in itertools.product(*(j.sp_degrees(e, m) for e, m in zip(encs, split, strict=True))):
            jobs = {e.name: j.encoder(e.name, m, s) for e, m, s in zip(encs, split, degrees, strict=True)}
            rows.append(_row("dhp-disaggregated", jobs | {lang.module: lang}, placement="disaggregated"))
    return rows


def _run(args: tuple[GroupJob, Any, Any]) -> tuple[GroupResult, float]:
    """One job's fake runs (``measure_model``) -> (its result, the seconds they took)."""
    from dhp.models.registry import get_family
    from dhp.plan.measure import measure_model

    job, model_cfg, family = args
    start = time.perf_counter()
    res = measure_model(job, model_cfg, get_family(family) if isinstance(family, str) else family)
    return res, time.perf_counter() - start


_DONE: list[Any] = []  # a pool worker's queue to its parent: (job, seconds) as each job of a bundle finishes


def _worker_init(parent: int, done: Any) -> None:
    """A pool worker: it ends with ``parent`` (``dhp.lifetime``) and says on ``done`` when each job is done."""
    from dhp.lifetime import exit_with_parent

    exit_with_parent(parent)
    _DONE[:] = [done]


def _run_bundle(args: tuple[list[GroupJob], Any, Any]) -> list[tuple[GroupJob, GroupResult]]:
    """A bundle's jobs one after another in this process (``bundles``), each one's end told to the parent."""
    jobs, model_cfg, family = args
    out = []
    for j in jobs:
        res, seconds = _run((j, model_cfg, family))
        if _DONE:
            _DONE[0].put((j, seconds))
        out.append((j, res))
    return out


def bundles(jobs: list[GroupJob], family: Any) -> list[list[GroupJob]]:
    """``jobs`` in bundles of one layout each (the same module, degrees, ZeRO level, precision; any media and
    checkpointing), the bundles of the language model (the deepest runs) first, then the largest media, so that
    a pool's last bundles are short. Why: a process runs a layout it has run before at about half the cost (the
    fake tensors' dispatch cache and DTensor's sharding propagation cache hold its parameters' shapes, and its
    activations' at the same media), and a run's figures do not depend on what ran before it in the process
    (``test_a_run_after_its_layouts_other_runs_equals_its_first``), so a bundle goes to one process."""
    out: dict[GroupJob, list[GroupJob]] = {}
    for j in jobs:
        out.setdefault(replace(j, media=(), text_tokens=0, activation_checkpointing=False), []).append(j)

    def size(b: list[GroupJob]) -> tuple:
        return b[0].module != family.language.name, -sum(v for j in b for _, v in j.media)

    return sorted(out.values(), key=size)


def family_ref(family: Any) -> str | None:
    """A name that ``get_family`` resolves to ``family`` in a fresh process (a pool's worker): a built-in family's
    name, or ``module:ATTR`` of the module attribute that holds it (a plugin registered in this process only is
    unknown to a fresh one); None when there is none."""
    import sys

    from dhp.models.registry import UnknownFamily, builtin_names, get_family

    try:
        if family.name in builtin_names() and get_family(family.name) is family:
            return family.name
    except UnknownFamily:
        pass
    module = type(family).__module__
    for attr, value in vars(sys.modules.get(module, object)).items():
        if value is family:
            return f"{module}:{attr}"
    return None


def _reduce_size(job: GroupJob) -> int:
    return job.dp * (job.inner if job.inner_kind == "sp" else 1)


def canonical(job: GroupJob, family: Any = None) -> GroupJob:
    """The job whose fake run stands for ``job``. Under ZeRO 0/1 a rank's activations, FLOPs, collective
    payloads and gradients do not depend on the number of data-parallel replicas; only ZeRO-1's share of the
    optimizer state does (``8/d`` bytes per parameter, ``docs/memory.md``). So every dp >= 2 is run as dp 2
    (dp 1 under SP, whose reduce group is already dp x sp) and the state rescaled (``for_reduce_size``);
    ZeRO-3 (FSDP2) is run at its own size. An encoder's run reads only its own media: the other encoders'
    sizes and the text tokens are dropped from its key."""
    family = family_of(family)
    if job.module != family.language.name:
        job = replace(job, media=tuple((k, v) for k, v in job.media if k == job.module), text_tokens=0)
    if job.zero == 3 or _reduce_size(job) <= 1:
        return job
    return replace(job, dp=1 if job.inner_kind == "sp" else 2)


def for_reduce_size(r: GroupResult, measured: int, d: int) -> GroupResult:
    """``r``, measured with ZeRO-1 over ``measured`` ranks, with its optimizer state over ``d`` instead (a
    balanced share: ZeroRedundancyOptimizer partitions whole parameters, so within one parameter of it)."""
    if measured == d:
        return r
    new = r.optimizer * measured // d
    delta = new - r.optimizer
    out = replace(r, optimizer=new, peak_fb=r.peak_fb + delta, peak_step=r.peak_step + delta,
                  breakdown=dict(r.breakdown))
    out.peak = max(out.peak_fb, out.peak_step)
    for k in ("Optstate", "Total"):
        if k in out.breakdown:
            out.breakdown[k] += delta
    return out


Progress = Callable[[int, int, GroupJob, float], None]  # (jobs done, jobs in all, the job just done, its seconds)


def measure_all(jobs: list[GroupJob], model_cfg: Any, workers: int | None = None, family: Any = None,
                progress: Progress | None = None) -> dict[GroupJob, GroupResult]:
    """Every distinct job's ``canonical`` stand-in once. ``workers`` <= 1: in this process, one after
    another (a run's figures do not depend on what ran before it: ``measure._untracked_sharding_propagation``);
    more: a pool of that many processes, each running many jobs, a layout's jobs in one process (``bundles``;
    default: the CPU count, at most 4, for more than a handful of runs). ``progress`` is called as each
    stand-in's runs finish, in the order they finish."""
    family = family_of(family)
    want = list(dict.fromkeys(jobs))
    uniq = list(dict.fromkeys(canonical(j, family) for j in want))
    if workers is None:
        workers = max(1, min(4, os.cpu_count() or 1)) if len(uniq) > 6 else 1
    ref = family_ref(family)
    done = progress or (lambda *_: None)
    got: dict[GroupJob, GroupResult] = {}
    if workers <= 1 or ref is None:  # (a family no fresh process can find runs here)
        for j in (j for b in bundles(uniq, family) for j in b):
            got[j], seconds = _run((j, model_cfg, family))
            done(len(got), len(uniq), j, seconds)
    else:
        got = _pool(bundles(uniq, family), model_cfg, ref, workers, lambda i, j, s: done(i, len(uniq), j, s))
    return {j: for_reduce_size(got[canonical(j, family)], _reduce_size(canonical(j, family)), _reduce_size(j))
            for j in want}


def _pool(work: list[list[GroupJob]], model_cfg: Any, ref: str, workers: int,
          done: Callable[[int, GroupJob, float], None]) -> dict[GroupJob, GroupResult]:
    """The bundles' jobs in a pool of ``workers`` processes, a bundle to a process, each job's end told to
    ``done`` as it comes (not only at its bundle's)."""
    import multiprocessing as mp
    from queue import Empty

    ctx = mp.get_context("spawn")
    told = ctx.Queue()
    total = sum(len(b) for b in work)
    # each worker ends with this process: a killed `dhp plan` leaves no orphan measuring on (this pid, not the
    # worker's parent when its initializer runs: a worker still starting when the plan was killed has init's)
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx, initializer=_worker_init,
                             initargs=(os.getpid(), told)) as pool:
        futures = [pool.submit(_run_bundle, (b, model_cfg, ref)) for b in work]
        n = 0
        while n < total:
            try:
                job, seconds = told.get(timeout=0.5)
            except Empty:
                job = None
            if job is None:  # a worker that failed sends no more: its bundle's error, raised here
                failed = next((f for f in futures if f.done() and f.exception() is not None), None)
                if failed is not None:
                    raise failed.exception()
                continue
            n += 1
            done(n, job, seconds)
        return {j: r for f in futures for j, r in f.result()}


# ---- time ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pricing:
    """What prices a row: the device profile of each group (``default`` where a group has none of its own: one
    device for every group, as on one pool of GPUs), and the profile of the link between pools (a group on its
    own device: the router crosses it; ``None``: the groups' own router fit)."""

    default: Profile
    groups: tuple[tuple[str, Profile], ...] = ()
    link: Profile | None = None
    memory_gb: tuple[tuple[str, float], ...] = ()  # per group, where its device differs

    def of(self, group: str) -> Profile:
        return dict(self.groups).get(group, self.default)

    @property
    def profiles(self) -> tuple[Profile, ...]:
        """Every profile that prices a group: the default and the groups' own."""
        return (self.default, *dict(self.groups).values())

    def limit_gb(self, group: str, default: float) -> float:
        return dict(self.memory_gb).get(group, default)

    @property
    def label(self) -> str:
        own = dict(self.groups)
        if not own:
            return self.default.label
        return "; ".join(f"{g} {p.label}" for g, p in own.items()) + (
            f"; {self.link.name}" if self.link else "")


def data_plane(row: Row) -> str:
    """How the row's router moves tensors, as the runtime resolves ``runtime.transport=auto``
    (``dhp.runtime.cluster.resolve_data_plane``): point-to-point between disaggregated groups, through Ray
    (object store on CPU, CUDA IPC handles on a shared GPU: Ray calls either way) between collocated ones."""
    return "p2p" if row.placement == "disaggregated" else "ray"


def _pools(row: Row, pricing: Pricing, gpus: int) -> tuple[dict[str, Lane], dict[str, float]]:
    """The replay's lanes and pools: a CPU profile's groups share the host's cores (each rank its threads), their
    loaders too (a thread's worth of a core per rank: the interpreter's lock keeps a rank's loader threads to about
    one); on GPUs collocated groups share the GPUs, disaggregated ones have their own, and each group's loaders
    run on host CPUs of their own (a pool per group, one unit per rank)."""
    lanes, pools = {}, {}
    for k, j in row.jobs.items():
        p = pricing.of(k)
        if p.device_type == "cpu" and p.cores:
            lanes[k] = Lane("host", j.ranks * max(1, p.threads), p.contention_wait_coefficient(), p.busy_slowdown)
            lanes[loader_lane(k)] = Lane("host", j.ranks, busy_slowdown=p.busy_slowdown)
            pools["host"] = float(p.cores)
            continue
        if row.placement == "collocated":
            lanes[k], pools["gpus"] = Lane("gpus", j.ranks), float(gpus)
        else:
            lanes[k], pools[k] = Lane(k, j.ranks), float(j.ranks)
        lanes[loader_lane(k)], pools[loader_lane(k)] = Lane(loader_lane(k), j.ranks), float(j.ranks)
    return lanes, pools


def replay_row(row: Row, costs: dict[str, GroupCost], pricing: Pricing, gpus: int, samples: int,
               language: str, plan: Any = None) -> Replay:
    """The row's step replayed as the runtime runs it (``dhp.plan.schedule``): its batch plan's rounds (each
    encoder replica's samples per round from the trainer's own ``BatchPlanner`` over ``samples`` samples of
    equal cost, or ``plan``, a real step's ``StepPlan``), ``schedule_turns`` with the row's placement,
    ``runtime.encoders_ahead`` and encoder window, each call priced from the groups' costs."""
    from dhp.data.sampler import BatchPlanner, encoder_window

    jobs = row.jobs
    encoders = [k for k in jobs if k != language]
    if plan is None:
        mbs = jobs[language].micro_batch_size
        per_round = mbs * jobs[language].dp
        n_rounds = max(1, samples // per_round)
        window = encoder_window(row.encoder_window, row.placement, [jobs[e].dp for e in encoders], per_round,
                                n_rounds)
        dp = {k: j.dp for k, j in jobs.items()}
        plan = BatchPlanner({k: [1.0] * samples for k in jobs}, dp, n_rounds * per_round, mbs, language=language,
                            encoder_window=window).plan(0)
    busiest = {(e, j): max(len(p) for p in rnd.replicas(e)) for e in encoders for j, rnd in enumerate(plan.rounds)}
    ahead = row.encoders_ahead if row.placement == "disaggregated" else 0
    loads = bool(row.load_s) and row.loader_workers > 0  # in the background; else in the calls themselves

    def load_s(group: str, rnd: int) -> float:
        """A rank's seconds to load its samples of round ``rnd`` (its replica's, the busiest one's)."""
        return row.load_s.get(group, 0.0) * max((len(p) for p in plan.rounds[rnd].replicas(group)), default=0)

    def per_call(forward: str, backward: str, router: str | None, whole: Callable[[Any], float], reduce: str | None,
                 step: str | None) -> Callable[[Call], float]:
        """A call's share of its group's per-micro-batch figures (``GroupCosts`` fields by name): its work, or
        the part of it that waits for a peer rank."""

        def of(c: Call) -> float:
            g = costs[c.group]
            if c.kind in ("forward", "backward"):
                n = busiest[(c.group, c.round)] / jobs[c.group].micro_batch_size
                part = getattr(g, forward if c.kind == "forward" else backward)
                return n * part + (getattr(g, router) / 2 if n and router else 0.0)
            if c.kind == "forward_backward":
                return whole(g)
            if c.kind == "finish_gradients":
                return getattr(g, reduce) if reduce else 0.0
            if c.kind == "step" and step is not None:
                return getattr(g, step)
            return 0.0  # emit, emit_grads: the router's transfer is priced in the calls that make and take it

        return of

    priced = per_call("forward_mb", "backward_mb", "router_mb", lambda g: g.micro_batch_s, "reduce_s", "optimizer_s")
    # the calls' waits for a peer rank (priced where the host is oversubscribed)
    waits = per_call("forward_waits_mb", "backward_waits_mb", "router_waits_mb",
                     lambda g: g.forward_waits_mb + g.backward_waits_mb + g.router_waits_mb, "reduce_waits", None)
    # their compute (slowed on a full CPU host); a load is all compute
    compute = per_call("forward_compute_mb", "backward_compute_mb", None, lambda g: g.compute_mb, None, "optimizer_s")

    def work(c: Call) -> float:  # without background loaders a forward loads its own samples first
        inline = c.kind == "load" or (not loads and c.kind in ("forward", "forward_backward"))
        return priced(c) + (load_s(c.group, c.round) if inline and row.load_s else 0.0)

    lanes, pools = _pools(row, pricing, gpus)
    script = driver_script(len(plan.rounds), encoders, language, plan.window, ahead, data_plane=data_plane(row),
                           loads=loads)
    call_s = max(pricing.of(k).actor_call_s for k in jobs)
    busy_call_s = max(pricing.of(k).busy_call_s for k in jobs)
    return steady_replay(script, lanes, pools, work, call_s, waits,
                         lambda c: compute(c) + work(c) - priced(c),  # (a load is all compute)
                         busy_call_s, "host" if "host" in pools else None)  # the driver runs on a CPU host's cores


def evaluate(row: Row, results: dict[GroupJob, GroupResult], dev: Device, gpus: int, limit_gb: float,
             text_tokens: int, family: Any = None, model_cfg: Any = None, pricing: Pricing | None = None,
             samples: int | None = None, plan: Any = None) -> Row:
    """The row's step time, throughput, per-group peaks (a group's own peak, plus on a collocated GPU what the
    other groups hold meanwhile) and per-group time breakdown. ``pricing``: the device profiles (default: the
    roofline of ``dev``); ``samples``: per step (default ``micro_batch_size`` per GPU); ``plan``: a real step's
    ``StepPlan`` (``dhp bench --profile``: its rounds, and each group's samples, those that carry its media).
    ``model_cfg`` is needed only for a row without ``tokens_per_sample``."""
    family = family_of(family)
    pricing = pricing or Pricing(roofline(dev))
    language = family.language.name
    samples = samples or gpus * next(iter(row.jobs.values())).micro_batch_size
    res = {k: results[j] for k, j in row.jobs.items()}
    per_group = {k: (sum(len(p) for rnd in plan.rounds for p in rnd.replicas(k)) if plan is not None else samples)
                 for k in row.jobs}
    costs = {k: group_cost(row.jobs[k], res[k], pricing.of(k), per_group[k], pricing.link, data_plane(row))
             for k in row.jobs}
    rep = replay_row(row, costs, pricing, gpus, samples, language, plan)
    step, path = rep.step_s, rep.critical_path
    resident = {k: r.weights + r.grads + r.optimizer + (r.retained if k != language else 0) for k, r in res.items()}
    groups = {}
    for k, r in res.items():
        peak = r.peak
        if row.placement == "collocated":
            peak += sum(v for o, v in resident.items() if o != k)
        elif k != language:
            peak += r.retained  # runtime.encoders_ahead=1: one more micro-batch's activations held
        times = costs[k].breakdown()
        groups[k] = {"ranks": row.jobs[k].ranks, "peak_gb": peak / GiB, "weights_gb": r.weights / GiB,
                     "grads_gb": r.grads / GiB, "optimizer_gb": r.optimizer / GiB,
                     "activations_gb": r.activations / GiB, "limit_gb": pricing.limit_gb(k, limit_gb),
                     **times, "busy_s": rep.busy_s[k], "idle_s": rep.idle_s[k],
                     "data_wait_s": rep.data_wait_s.get(k, 0.0), "loader_s": rep.loader_s.get(k, 0.0)}
    per_sample = row.tokens_per_sample
    if not per_sample:
        if model_cfg is None:
            raise ValueError(f"evaluate: row {row.strategy} has no tokens_per_sample; give model_cfg to count them")
        per_sample = sample_tokens(family, model_cfg, as_media(row.media, family), text_tokens)
    tokens = samples * per_sample
    return replace(row, groups=groups, fits=all(g["peak_gb"] <= g["limit_gb"] for g in groups.values()),
                   step_time_s=step, tokens_per_s=tokens / step if step > 0 else 0.0, tokens_per_sample=per_sample,
                   critical_path=path, pricing=pricing.label, replay=rep)


def best(rows: list[Row]) -> list[Row]:
    """One row per (strategy, media, checkpointing): the fastest that fits, else the smallest peak."""
    out: dict[tuple, Row] = {}
    for r in rows:
        key = (r.strategy, tuple(sorted(r.media_tokens().items())), r.ac)
        cur = out.get(key)
        score = (r.fits, r.tokens_per_s if r.fits else -max(g["peak_gb"] for g in r.groups.values()))
        if cur is None or score > (cur.fits, cur.tokens_per_s if cur.fits else
                                   -max(g["peak_gb"] for g in cur.groups.values())):
            out[key] = r
    return list(out.values())


def plan(model_cfg: Any, gpus: int, dev: Device, limit_gb: float, media: list, text_tokens: int,
         mbs: int, strategies: tuple[str, ...] = STRATEGIES, workers: int | None = None,
         precision: str = "fp32_master", family: Any = None, pricing: Pricing | None = None,
         keep: Callable[[Row], bool] | None = None, lora: dict[str, int] | None = None,
         progress: Progress | None = None) -> list[Row]:
    """Every candidate row measured and priced; ``media``: the sample sizes, ``{encoder: tokens}`` each;
    ``precision`` (``train.precision``) is what every group's weights, gradients and optimizer state are held
    in; ``keep``: the candidates to measure (default: all); ``lora``: ``{module: rank}``, the modules that train
    LoRA adapters on every Linear (``<module>.lora.r``), their bases frozen; ``progress``: told of every
    distinct fake run as it finishes (``measure_all``)."""
    family = family_of(family)
    rows = candidate_rows(model_cfg, gpus, media, text_tokens, mbs, strategies, precision=precision, family=family)
    rows = [with_lora(r, lora or {}) for r in rows if keep is None or keep(r)]
    results = measure_all([j for r in rows for j in r.jobs.values()], model_cfg, workers, family, progress)
    return best([evaluate(r, results, dev, gpus, limit_gb, text_tokens, family, pricing=pricing) for r in rows])


def with_lora(row: Row, lora: dict[str, int]) -> Row:
    """``row`` with LoRA of rank ``lora[module]`` on those of its modules (the others trained whole)."""
    if not lora:
        return row
    return replace(row, jobs={m: replace(j, lora_rank=lora.get(m, 0)) for m, j in row.jobs.items()})


# ---- a training config's layout, and the largest sample it fits ----------------------------------------------


def config_jobs(cfg: Any, family: Any, media: dict[str, int], text_tokens: int, device: str = "cpu",
                micro_batch_size: int = 1) -> dict[str, GroupJob]:
    """The planner's jobs (one per module group, in the family's order) of a training config's layout
    (``cfg.modules``), each on samples of ``media`` and ``text_tokens``."""
    jobs = {}
    for name in [m for m in family.module_names if m in cfg.modules]:
        m = cfg.module(name)
        p = m.parallel
        if p.sp > 1 and p.tp > 1:
            raise ValueError(f"{name}.parallel has sp {p.sp} and tp {p.tp}; one of them")
        inner, kind = (p.sp, "sp") if p.sp > 1 else (p.tp, "tp") if p.tp > 1 else (1, "none")
        jobs[name] = GroupJob(name, dp=p.dp, inner=inner, inner_kind=kind, zero=p.zero,
                              activation_checkpointing=m.activation_checkpointing,
                              sequence_parallel=p.sequence_parallel, media=media_of(media), text_tokens=text_tokens,
                              micro_batch_size=micro_batch_size, device=device, dtype=cfg.train.dtype,
                              optimizer=cfg.train.optimizer, precision=cfg.train.precision,
                              loss_chunk_tokens=cfg.train.loss_chunk_tokens, lora_rank=m.lora.r,
                              pad_to_multiple_of=cfg.data.pad_to_multiple_of,
                              lora_targets=m.lora.target_modules if isinstance(m.lora.target_modules, str)
                              else ",".join(m.lora.target_modules))
    return jobs


def largest_fitting(jobs: dict[str, GroupJob], model_cfg: Any, family: Any, encoder: str, budget: int, start: int,
                    stop: int, step: int, placement: str = "collocated", media_per_token: int = 1,
                    name: str = "layout") -> dict[str, dict[str, Any]]:
    """The largest ``encoder`` media of a layout whose every group fits ``budget`` bytes per rank, by the planner
    (``search.grow`` over its fake runs, sizes in the language model's tokens of that encoder, ``media_per_token``
    of its own input each), two ways: ``one_micro_batch``, the fake run's per-rank peak itself (the accounting of
    one measured training step), and ``planner``, ``evaluate``'s verdict for this placement (a disaggregated
    encoder also holds one micro-batch ahead, a collocated rank the other groups' state)."""
    from dhp.observe.devices import get_device
    from dhp.plan.search import grow

    gpus = sum(j.ranks for j in jobs.values())
    cache: dict[int, dict[str, dict[str, int]]] = {}

    def peaks(tokens: int) -> dict[str, dict[str, int]]:
        """{"one_micro_batch": {group: bytes}, "planner": {group: bytes}} at this size (fake runs once)."""
        if tokens not in cache:
            js = {m: replace(j, media=media_of({encoder: tokens * media_per_token})) for m, j in jobs.items()}
            res = measure_all([js[encoder]], model_cfg, workers=1, family=family)
            if res[js[encoder]].peak > budget:  # fails either way (the verdict only adds to a group's peak)
                cache[tokens] = {k: {encoder: res[js[encoder]].peak} for k in ("one_micro_batch", "planner")}
                return cache[tokens]
            res |= measure_all([j for m, j in js.items() if m != encoder], model_cfg, workers=1, family=family)
            r = Row(name, media_of({encoder: tokens * media_per_token}), js[encoder].activation_checkpointing, js,
                    placement=placement)
            r = evaluate(r, res, get_device("h100"), gpus, budget / GiB, next(iter(js.values())).text_tokens,
                         family, model_cfg)  # the device: time only
            cache[tokens] = {"one_micro_batch": {m: res[j].peak for m, j in js.items()},
                             "planner": {m: round(g["peak_gb"] * GiB) for m, g in r.groups.items()}}
        return cache[tokens]

    out = {}
    for kind in ("one_micro_batch", "planner"):
        g = grow(lambda n, kind=kind: max(peaks(n)[kind].values()), budget, start, stop, step)
        at = peaks(g.largest)[kind] if g.largest is not None else {}
        out[kind] = {"tokens": g.largest, "first_failed": g.first_failed,
                     "peak_gb": {m: b / GiB for m, b in at.items()}}
    return out
