"""``dhp plan MODEL --gpus N``: the table, the JSON and the plot (see ``docs/plan.md``)."""

from __future__ import annotations

import json
import math
import shlex
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from dhp.observe.devices import Device, get_device
from dhp.plan.planner import STRATEGIES, Pricing, Row, plan
from dhp.plan.profile import CALIBRATED, ROOFLINE, Profile, machine_profile_path, roofline

POOL_LINK_GBS = 50.0  # between pools of a device per group: 400 Gb/s InfiniBand per GPU, one direction


def model_config(name: str, family_name: str | None = None) -> tuple[Any, Any]:
    """(family, model config) of a preset (``tiny``, ``7b``, ``omni-7b``...), an HF checkpoint directory or its
    config.json; the family is ``family_name`` (``--family``) or the one the registry finds for the name (the
    checkpoint's model_type, else the family with that preset)."""
    from dhp.models.registry import get_family, resolve_family

    p = Path(name)
    if p.is_file():  # a bare config.json: the directory that holds it
        p = p.parent
    hf_dir = str(p) if (p / "config.json").is_file() else None
    family = get_family(family_name) if family_name else resolve_family(None, hf_dir, None if hf_dir else name)
    if hf_dir is None and name not in family.presets and not p.exists():
        raise ValueError(f"{name}: no such preset of {family.name} ({', '.join(family.presets) or 'none'}) and no "
                         "such directory; give a preset or a Hugging Face checkpoint directory")
    return family, family.preset_config(hf_dir or name)


def media_points(family: Any, args: Any) -> list[dict[str, int]]:
    """The sample sizes to plan: per encoder of the family its ``--<name>-tokens`` list (comma-separated), every
    combination of them."""
    import itertools

    from dhp.errors import UsageError

    lists = []
    for enc in family.encoders:
        given = getattr(args, f"{enc.name}_tokens", None)
        if given is None:
            raise UsageError(f"dhp plan: the {enc.name} encoder of {family.name} has no --{enc.name}-tokens option; "
                             "plan it through dhp.plan.planner.plan(media=...)")
        try:
            sizes = [int(x) for x in str(given).split(",") if x.strip()]
        except ValueError:
            sizes = []
        if not sizes or min(sizes) < 1:
            raise UsageError(f"--{enc.name}-tokens: give positive sizes, comma-separated (got {given!r})")
        lists.append([(enc.name, n) for n in sizes])
    return [dict(c) for c in itertools.product(*lists)]


def _layout(job: Any) -> str:
    """``sp8xdp1 z1``, ``tp4xdp2 z1``, ``dp8 z3``: a group's layout in the table."""
    inner = f"{job.inner_kind}{job.inner}x" if job.inner > 1 else ""
    return f"{inner}dp{job.dp} z{job.zero}"


def job_label(job: Any) -> str:
    """``text tp8xdp1 z0 AC off, 16384 vision + 4096 text tokens``: a fake run's group, layout and sample."""
    sizes = [f"{n} {k}" for k, n in job.media] + ([f"{job.text_tokens} text"] if job.text_tokens else [])
    return (f"{job.module} {_layout(job)} AC {'on' if job.activation_checkpointing else 'off'}, "
            f"{' + '.join(sizes) or 'no'} tokens")


def job_done(done: int, total: int, job: Any, seconds: float) -> None:
    """A line on stderr per finished fake run of ``measure_all`` (its depth copies included): what and how long."""
    print(f"dhp: plan: [{done}/{total}] {job_label(job)}: {seconds:.0f} s", file=sys.stderr, flush=True)


def _short(name: str) -> str:
    return name[:1].upper()


def table(rows: list[Row], limit: float) -> str:
    """One line per row: its media sizes, checkpointing, fit, every group's peak, step time and throughput."""
    encs = list(dict.fromkeys(k for r in rows for k in r.jobs if k in r.media_tokens()))  # the family's order
    groups = list(dict.fromkeys(k for r in rows for k in r.jobs))
    head = (f"{'strategy':<18} " + " ".join(f"{e + ' tok':>10}" for e in encs) + f" {'AC':>3} {'fits':>4} "
            + " ".join(f"{g + ' GB':>9}" for g in groups) + f" {'step s':>8} {'tokens/s':>10} "
            + f"{'compute':>8} {'comm':>7} {'hidden':>7} {'router':>7} "
            + " ".join(f"{_short(g) + ' idle':>7}" for g in groups) + "  layout")
    unit, scale = time_unit(rows)
    head = head.replace(f"{'step s':>8}", f"{'step ' + unit:>8}")
    out = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (tuple(r.media_tokens().get(e, 0) for e in encs), r.ac, r.strategy)):
        media = r.media_tokens()
        lay = " | ".join(f"{_short(k)} {_layout(j)}" for k, j in r.jobs.items())
        out.append(f"{r.strategy:<18} " + " ".join(f"{media.get(e, 0):>10}" for e in encs)
                   + f" {'on' if r.ac else 'off':>3} {'yes' if r.fits else 'no':>4} "
                   + " ".join(f"{r.groups[g]['peak_gb']:>9.1f}" for g in groups)
                   + f" {figure(r.step_time_s * scale):>8} {r.tokens_per_s:>10.0f} " + _times(r, groups, scale)
                   + f"  {lay}")
    return "\n".join(out)


def cpu_priced(pricing: Pricing) -> bool:
    """Whether a CPU's calibrated profile prices a group of the plan, which lays the model out on GPUs."""
    return any(p.source == CALIBRATED and p.device_type == "cpu" for p in pricing.profiles)


def time_unit(rows: list[Row]) -> tuple[str, float]:
    """The table's unit of time: ms where every step is under a second (a small model), else s."""
    return ("ms", 1e3) if rows and max(r.step_time_s for r in rows) < 1.0 else ("s", 1.0)


def figure(x: float) -> str:
    """A time in the table: three significant digits in fixed notation (never 1.05e-05), 0 as 0."""
    if x == 0:
        return "0"
    digits = max(0, min(4, 2 - math.floor(math.log10(abs(x)))))
    return f"{x:.{digits}f}"


def _times(r: Row, groups: list[str], scale: float) -> str:
    """Time per step over the row's groups (in the table's unit, ``scale`` per second): compute, exposed and
    hidden communication, router; each group's idle time (waiting on the others)."""
    def total(key: str) -> str:
        return figure(scale * sum(g.get(key, 0.0) for g in r.groups.values()))

    idle = " ".join(f"{figure(scale * r.groups[g].get('idle_s', 0.0)):>7}" if g in r.groups else f"{'-':>7}"
                    for g in groups)
    return (f"{total('compute_s'):>8} {total('comm_exposed_s'):>7} {total('comm_hidden_s'):>7} "
            f"{total('router_s'):>7} {idle}")


def _sizes(media: dict[str, int]) -> str:
    return ", ".join(f"{n} {k} tokens" for k, n in media.items()) or "no media"


def _assignments(spec: str, what: str) -> tuple[str | None, dict[str, str]]:
    """``X`` -> (X, {}); ``group=X,group=Y`` -> (None, {group: X}); for ``--device`` and ``--profile``."""
    from dhp.errors import UsageError

    if "=" not in spec:
        return spec, {}
    out = {}
    for part in (p for p in spec.split(",") if p):
        group, eq, value = part.partition("=")
        if not eq or not group or not value:
            raise UsageError(f"{what} {spec!r}: give one value or group=value pairs, comma-separated "
                             f"(e.g. vision=l40s,text=h100)")
        out[group.strip()] = value.strip()
    return None, out


def pricing_of(args: Any, family: Any) -> tuple[Device, Pricing, dict[str, Device]]:
    """The default device, the pricing (a profile per group: ``--profile`` files, else the roofline of the
    group's ``--device``) and the devices of groups that have their own (``--device vision=l40s,text=h100``)."""
    from dhp.errors import UsageError

    dev_name, dev_map = _assignments(args.device, "--device")
    prof_file, prof_map = _assignments(getattr(args, "profile", None) or "", "--profile")
    names = set(family.module_names)
    for flag, given in (("--device", dev_map), ("--profile", prof_map)):
        unknown = sorted(set(given) - names)
        if unknown:
            raise UsageError(f"{flag} {','.join(unknown)}=...: not a module of {family.name}; its groups are "
                             f"{', '.join(family.module_names)}")
    try:
        dev = get_device(dev_name or dev_map.get(family.language.name, "h100"), args.peak_tflops)
        devices = {g: get_device(n, args.peak_tflops) for g, n in dev_map.items()}
    except KeyError as e:
        raise UsageError(str(e).strip("'\"")) from None
    try:
        default = Profile.load(prof_file) if prof_file else roofline(dev)
        own = {g: Profile.load(f) for g, f in prof_map.items()}
    except ValueError as e:
        raise UsageError(str(e)) from None
    own = {g: own.get(g) or roofline(d) for g, d in devices.items()} | own
    link = None
    if own:
        gbs = getattr(args, "pool_link_gbs", None) or POOL_LINK_GBS
        link = Profile(name=f"link between pools {gbs:g} GB/s", link_bytes_per_s=gbs * 1e9)
    memory = tuple((g, d.memory_gb) for g, d in devices.items())
    return dev, Pricing(default, tuple(own.items()), link, memory), devices


def lora_of(spec: str | None, family: Any) -> dict[str, int]:
    """``--lora text=16,vision=8`` -> {module: rank}; a bare ``16``: the language model's. Unknown modules and
    ranks < 1 are usage errors naming the flag."""
    from dhp.errors import UsageError

    if not spec:
        return {}
    bare, pairs = _assignments(spec, "--lora")
    given = {family.language.name: bare} if bare is not None else pairs
    out = {}
    for module, rank in given.items():
        if module not in family.module_names:
            raise UsageError(f"--lora {spec!r}: {module} is not a module of {family.name} "
                             f"({', '.join(family.module_names)})")
        if not rank.isdigit() or int(rank) < 1:
            raise UsageError(f"--lora {spec!r}: the rank of {module} must be a whole number >= 1")
        out[module] = int(rank)
    return out


def check_numbers(args: Any) -> None:
    """Usage errors naming the flag for numbers out of range (a zero micro-batch, negative tokens, a GPU count
    below one): they would otherwise fail deep in a fake run as a traceback."""
    from dhp.errors import UsageError

    floors = (("gpus", 1, "GPUs to lay the model out on"), ("micro_batch_size", 1, "samples per micro-batch"),
              ("text_tokens", 0, "text tokens per sample besides the placeholders"),
              ("gpu_memory_gb", 1e-9, "GB per GPU"), ("peak_tflops", 1e-9, "TFLOP/s"),
              ("pool_link_gbs", 1e-9, "GB/s between pools"), ("threads", 1, "torch threads"))
    for name, floor, what in floors:
        value = getattr(args, name, None)
        if value is not None and value < floor:
            bound = f"{floor} or more" if floor in (0, 1) else "a number above 0"
            raise UsageError(f"--{name.replace('_', '-')} {value:g}: give {bound} ({what})")


def strategies_of(spec: str | None) -> tuple[str, ...]:
    """``--strategies a,b`` -> (a, b), each one of ``STRATEGIES`` (an unknown name is a usage error: it would
    otherwise plan nothing and print "no layout fits")."""
    from dhp.errors import UsageError

    names = tuple(s.strip() for s in (spec or ",".join(STRATEGIES)).split(",") if s.strip())
    unknown = [s for s in names if s not in STRATEGIES]
    if unknown or not names:
        raise UsageError(f"--strategies {spec!r}: {', '.join(unknown) or 'none given'}: choose among "
                         f"{', '.join(STRATEGIES)}")
    return names


def run_plan(args: Any) -> int:
    from dhp.errors import ModelError, UsageError

    check_numbers(args)
    if args.model == "calibrate":
        return run_calibrate(args)
    if not args.gpus and not getattr(args, "published", False):  # --published sets its own 8 GPUs
        raise UsageError("dhp plan MODEL: give --gpus N (the GPUs to lay the model out on)")
    try:
        family, model_cfg = model_config(args.model, getattr(args, "family", None))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ModelError(str(e).strip("'\"")) from None
    for flag, path, what, example in (("--json", getattr(args, "json", None), "JSON", "plan.json"),
                                      ("--plot", getattr(args, "plot", None), "PNG", "plan.png")):
        if path:
            check_output_file(flag, Path(path), what, example)
    dev, pricing, devices = pricing_of(args, family)
    limit = args.gpu_memory_gb or dev.memory_gb
    points = media_points(family, args)
    strategies = strategies_of(args.strategies)
    if devices:  # groups on their own devices: only the disaggregated layouts put each group on its own pool
        strategies = tuple(s for s in strategies if s == "dhp-disaggregated")
        if not strategies:
            raise UsageError("--device group=NAME puts groups on pools of their own: only dhp-disaggregated lays "
                             "them out that way; add it to --strategies")
        if args.gpu_memory_gb:
            pricing = replace(pricing, memory_gb=())
    precision = getattr(args, "precision", "fp32_master")
    lora = lora_of(getattr(args, "lora", None), family)
    keep = None
    if getattr(args, "published", False):
        points, strategies, precision, keep = published(args, family)
    with Heartbeat(f"{args.model} ({family.name}: {', '.join(family.module_names)}) on {args.gpus} GPUs: measuring "
                   f"every layout by fake runs of the real code ({', '.join(strategies)}; "
                   f"{'; '.join(_sizes(p) for p in points)})"):
        rows = plan(model_cfg, args.gpus, dev, limit, points, args.text_tokens, args.micro_batch_size, strategies,
                    precision=precision, family=family, pricing=pricing, keep=keep, lora=lora, progress=job_done)
    fitting = [r for r in rows if r.fits]
    rec = max(fitting, key=lambda r: r.tokens_per_s) if fitting else None
    pools = ", ".join(f"{g} on {d.name}" for g, d in devices.items())
    print(f"{args.model} on {args.gpus} x {dev.name if not devices else 'GPUs (' + pools + ')'} ({limit:g} GB); "
          f"{args.text_tokens} text tokens + the media per sample, {args.micro_batch_size} sample(s) per "
          f"micro-batch; precision {precision}"
          + ("; LoRA " + ", ".join(f"{m} r={r} (base frozen)" for m, r in lora.items()) if lora else "")
          + f"\npriced by {pricing.label}"
          + ("  [ROOFLINE: no calibrated profile; `dhp plan calibrate` measures one]"
             if any(p.source == ROOFLINE for p in pricing.profiles) else "")
          + ("\n  [CPU PROFILE: the times are this CPU's, the memory limit the GPU's; calibrate on the GPU "
             "(`dhp plan calibrate --on cuda`) for its times]" if cpu_priced(pricing) else ""))
    print(table(rows, limit))
    unit = {"s": "seconds", "ms": "milliseconds"}[time_unit(rows)[0]]
    print(f"({unit} per step: compute and communication summed over the groups, comm exposed / hidden behind "
          "compute; idle: a group waiting on the others)")
    if rec is not None:
        media = rec.media_tokens()
        print(f"\nfastest that fits: {rec.strategy} at {_sizes({k: media[k] for k in rec.jobs if k in media})}, "
              f"{rec.tokens_per_s:.0f} tokens/s; critical path {rec.critical_path}\n  "
              + train_command(args.model, rec))
    else:
        print("\nno layout fits")
    if getattr(args, "published", False):
        print(published_ratio(rows))
    if args.json:
        doc = {"model": args.model, "family": family.name, "gpus": args.gpus, "gpu_memory_gb": limit,
               "pricing": pricing.label, "rows": [r.to_dict() for r in rows],
               "recommended": rec.to_dict() if rec else None}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plot:
        plot(rows, limit, args.plot)
    return 0


PUBLISHED_VISION = "1024,4096,16384,65536"
PUBLISHED_RATIO = (1.26, 1.37)  # dhp's throughput over uniform TP, the published 32B runs on 8 x H100


def published(args: Any, family: Any) -> tuple[list[dict[str, int]], tuple[str, ...], str, Callable[[Row], bool]]:
    """``--published``: the published experiment's setting. 8 x H100 80 GB, 512 text tokens, 1k-65k vision
    tokens, pure bf16 (8 bytes per parameter), collocated: uniform TP against vision SP 8 + text TP 8. Sets
    ``args`` (gpus, device, text tokens, vision sizes) and returns (media points, strategies, precision, the
    candidates to keep)."""
    args.gpus, args.text_tokens = 8, 512
    setattr(args, f"{family.encoders[0].name}_tokens", PUBLISHED_VISION)
    enc, lang = family.encoders[0].name, family.language.name

    def keep(r: Row) -> bool:
        if r.strategy != "dhp-collocated":
            return True
        return r.jobs[enc].inner_kind == "sp" and r.jobs[enc].inner == 8 and r.jobs[lang].inner == 8

    return media_points(family, args), ("uniform-tp", "dhp-collocated"), "bf16", keep


def published_ratio(rows: list[Row]) -> str:
    """Per vision size and checkpointing: dhp's tokens/s over uniform TP's, beside the published ratio, and
    both rows' breakdown (what differs)."""
    lines = [f"\npredicted dhp (vision SP 8 + text TP 8) / uniform TP, against the published "
             f"{PUBLISHED_RATIO[0]}-{PUBLISHED_RATIO[1]}x:"]
    by = {(tuple(sorted(r.media_tokens().items())), r.ac, r.strategy): r for r in rows}
    for (media, ac, strategy), d in sorted(by.items()):
        u = by.get((media, ac, "uniform-tp"))
        if strategy != "dhp-collocated" or u is None:
            continue
        size = ", ".join(f"{n} {k}" for k, n in media)
        lines.append(f"  {size} tokens, AC {'on' if ac else 'off'}: {d.tokens_per_s / u.tokens_per_s:.2f}x "
                     f"(dhp {d.step_time_s:.2f} s, uniform {u.step_time_s:.2f} s; uniform TP here: "
                     + " | ".join(f"{k} {_layout(j)}" for k, j in u.jobs.items()) + ")")
        for name, row in (("dhp", d), ("uniform", u)):
            lines.append(f"    {name:<8}" + "; ".join(
                f"{g}: compute {v['compute_s']:.2f}, comm {v['comm_exposed_s']:.2f} exposed / "
                f"{v['comm_hidden_s']:.2f} hidden, router {v['router_s']:.2f}, optimizer {v['optimizer_s']:.2f} s"
                for g, v in row.groups.items()))
    return "\n".join(lines)


def check_output_file(flag: str, out: Path, what: str, example: str) -> None:
    """Make the folder of the file ``flag`` names and check that ``what`` can be written there, before the minutes
    of measuring that produce it; a ``UsageError`` naming the flag, the path and the fix where not."""
    from dhp.errors import UsageError

    if out.is_dir():
        raise UsageError(f"{flag} {out}: a directory; give the {what}'s file name, e.g. {flag} {out / example}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        existed = out.exists()
        with open(out, "a"):  # appends nothing: an existing file stays as it is until the new one is written
            pass
        if not existed:
            out.unlink()
    except OSError as e:
        raise UsageError(f"{flag} {out}: cannot write the {what} there ({type(e).__name__}: {e}); choose a path "
                         "this user can write to") from None


def run_calibrate(args: Any) -> int:
    """``dhp plan calibrate --out profile.json [--on cpu|cuda] [--quick] [--threads N] [--no-runtime]``."""
    from dhp.plan.calibrate import calibrate

    out = getattr(args, "out", None) or "profile.json"
    check_output_file("--out", Path(out), "profile", "profile.json")
    prof = calibrate(getattr(args, "on", None), quick=bool(getattr(args, "quick", False)),
                     log=lambda s: print(s, file=sys.stderr, flush=True), threads=getattr(args, "threads", None),
                     runtime=not getattr(args, "no_runtime", False))
    prof.save(out)
    mine, kept = machine_profile_path(prof.device_type), True  # the machine's own: `dhp bench` prices with it
    try:
        mine.parent.mkdir(parents=True, exist_ok=True)
        if Path(out).resolve() != mine.resolve():
            prof.save(mine)
    except OSError as e:  # a read-only cache: the profile is still where --out says
        kept = False
        print(f"dhp: plan calibrate: could not keep a copy as this machine's profile ({mine}: {e})", file=sys.stderr)
    busy = f" ({prof.busy_call_s * 1e3:.2f} ms on a busy host)" if prof.busy_call_s else ""
    ray = f", runtime hop {prof.actor_call_s * 1e3:.2f} ms{busy}" if prof.actor_call_s else ""
    print(f"wrote {out}: {prof.label}; GEMM up to {prof.peak_flops / 1e9:.1f} GFLOP/s, memory "
          f"{prof.hbm_bytes_per_s / 1e9:.1f} GB/s, {prof.cpu_op_s * 1e6:.1f} us per op, "
          f"{len(prof.collectives)} collective fits{ray}"
          + (f"\n  and as this machine's {prof.device_type} profile, {mine} (`dhp bench` predicts every layout's "
             "step with it when given no --profile)" if kept else ""))
    return 0


def train_command(model: str, row: Row) -> str:
    """The ``dhp train`` line that runs ``row`` as printed: the Ray backend, the model, the row's layout (data,
    output and the rest of the config are the user's to add)."""
    p = Path(model)
    if p.is_file():  # a bare config.json: the checkpoint directory that holds it, weights and tokenizer
        p = p.parent
    what = f"model.hf_path={shlex.quote(str(p))}" if p.is_dir() else f"model.preset={model}"
    return " ".join(["dhp train", "runtime.backend=ray", what, *row.overrides()])


class Heartbeat:
    """A line on stderr when a long phase starts, one every ``every_s`` while it runs, and its time at the end:
    a plan of a large model measures for minutes, and a silent terminal looks hung."""

    def __init__(self, what: str, every_s: float = 30.0) -> None:
        self.what, self.every_s = what, every_s
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Heartbeat:
        self.start = time.perf_counter()
        print(f"dhp: plan: {self.what}; this can take minutes", file=sys.stderr, flush=True)
        self._thread = threading.Thread(target=self._beat, daemon=True)
        self._thread.start()
        return self

    def _beat(self) -> None:
        while not self._done.wait(self.every_s):
            print(f"dhp: plan: still measuring, {time.perf_counter() - self.start:.0f} s", file=sys.stderr,
                  flush=True)

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()
        print(f"dhp: plan: measured in {time.perf_counter() - self.start:.0f} s", file=sys.stderr, flush=True)


def plot(rows: list[Row], limit: float, path: str) -> None:
    """Two panels: per-rank peak against the first encoder's tokens per strategy (the GPU limit marked), and the
    step-time breakdown of every row at the largest size (compute, exposed communication, router, optimizer, data
    wait and idle, per group; hidden communication hatched over the compute)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = next(iter(rows[0].media_tokens()), "media") if rows else "media"  # the first encoder's sizes
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(14, 5))
    for key in sorted({(r.strategy, r.ac) for r in rows}):
        pts = sorted((r.media_tokens().get(axis, 0), max(g["peak_gb"] for g in r.groups.values()))
                     for r in rows if (r.strategy, r.ac) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{key[0]}{' +AC' if key[1] else ''}")
    ax.axhline(limit, color="red", linestyle="--", label=f"GPU limit {limit:g} GB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{axis} tokens per sample")
    ax.set_ylabel("per-rank peak (GB)")
    ax.legend(fontsize=7)
    breakdown(bx, rows, axis)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


PARTS = (("compute_s", "compute"), ("comm_exposed_s", "comm exposed"), ("router_s", "router"),
         ("optimizer_s", "optimizer"), ("data_wait_s", "data wait"), ("idle_s", "idle"))


def breakdown(ax: Any, rows: list[Row], axis: str) -> None:
    """Stacked seconds per step, one bar per (row, group), the rows at the largest ``axis`` size; the communication
    hidden behind compute hatched over the compute (it adds no time)."""
    if not rows:
        return
    top = max(r.media_tokens().get(axis, 0) for r in rows)
    at = sorted((r for r in rows if r.media_tokens().get(axis, 0) == top), key=lambda r: (r.strategy, r.ac))
    bars = [(f"{r.strategy}{' +AC' if r.ac else ''}\n{g}{'' if r.fits else ' (no fit)'}", r.groups[g])
            for r in at for g in r.groups]
    bottom = [0.0] * len(bars)
    for key, label in PARTS:
        vals = [g.get(key, 0.0) for _, g in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    hidden = [g.get("comm_hidden_s", 0.0) for _, g in bars]  # under the compute: drawn over it, not stacked
    if any(hidden):
        ax.bar(range(len(bars)), hidden, fill=False, hatch="//", edgecolor="black", linewidth=0.5,
               label="comm hidden (under compute)")
    ax.set_xticks(range(len(bars)))
    ax.set_xticklabels([n for n, _ in bars], rotation=70, fontsize=6)
    ax.set_ylabel("seconds per step (per rank of the group)")
    ax.set_title(f"step-time breakdown at {top} {axis} tokens")
    ax.legend(fontsize=7)
