"""``dhp bench``: layouts measured side by side on the same model, data, global batch and workers.

Each layout is a list of config overrides applied on top of the run's config (the same
``dhp train`` rules: defaults, then CONFIG, then key=value overrides). The layouts run one
after another in this process, on the Ray backend, each for ``warmup + steps`` steps; the
warm-up steps are left out of every figure. Per layout ``bench.json`` holds:

* ``tokens_per_s`` and ``ratio_to_uniform_tp``; ``step_time_s`` (the mean) and ``step_time_median_s`` (a step
  the host stalled counts once, not by its length);
* per group: ``busy`` and ``idle`` (mean over its ranks of the fraction of the step they compute),
  ``imbalance`` (busiest replica over the mean), ``mfu``, ``peak_memory_gb`` (the peak of its busiest rank);
* ``comm_bytes_per_step``: bytes each group hands to each kind of collective per step (all ranks);
  ``router_bytes_per_step``: embeddings and gradients moved between the groups, and
  ``router_bytes_per_step_by_direction`` (``forward``: embeddings, ``backward``: their gradients);
* ``vision_comm_ratio_sp_tp`` (top level): vision collective bytes under ``dhp`` over ``uniform_tp``.

The default layouts for ``--workers W`` (even, >= 4) use W workers each, W/2 per group, on
separate workers (disaggregated):

* ``dhp``: vision Ulysses SP W/2, text TP W/2, vision one micro-batch ahead;
* ``uniform_tp``: vision TP W/2, text TP W/2 (the uniform tensor-parallel baseline);
* ``fsdp``: vision and text data parallel W/2 with ZeRO-3 (FSDP2).

With ``--workers 2`` (a machine of two devices), the same three collocated, both groups on the two workers
(degree 2 each, taking turns), as the reference implementation lays dhp out: W/2 per group would leave every
layout one worker per group, the three alike. Layouts given as ``name=key=value;...`` need no default.

PNG bar charts are written beside ``bench.json``.

``--max-vision-tokens --memory-budget-gb G``: instead, for each layout, the largest single image whose
training step keeps every worker within G (``run_max_vision_tokens``), beside the planner's prediction.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean, median
from typing import TYPE_CHECKING, Any

from dhp.config import Config, ConfigError, load_config
from dhp.observe.metrics_file import metric_rows
from dhp.plan.search import Growth, grow
from dhp.storage import check_writable

if TYPE_CHECKING:
    from collections.abc import Callable

    from dhp.plan.measure import GroupJob

GiB = 1024**3
DEFAULT_NAMES = ("dhp", "uniform_tp", "fsdp")  # ``default_layouts``' names


def default_layouts(workers: int) -> dict[str, list[str]]:
    """The named layouts of ``--workers W`` (module docstring): W/2 per group on separate workers, or for W = 2
    both groups collocated on the two."""
    if workers < 2 or workers % 2:
        raise ConfigError(f"--workers {workers}: the default layouts need an even number of workers (W/2 per "
                          "group, or 2 collocated); give other counts' layouts as name=key=value;key=value")
    collocated = workers == 2
    h = workers if collocated else workers // 2
    common = (["runtime.placement=collocated"] if collocated
              else ["runtime.placement=disaggregated", "runtime.encoders_ahead=1"])
    plain = {"dp": 1, "sp": 1, "tp": 1, "zero": 0}

    def layout(vision: dict, text: dict) -> list[str]:
        out = list(common)
        for module, par in (("vision", plain | vision), ("text", {k: v for k, v in (plain | text).items()
                                                                  if k != "sp"})):
            out += [f"{module}.parallel.{k}={v}" for k, v in par.items()]
        return out

    return {
        "dhp": layout({"sp": h}, {"tp": h}),
        "uniform_tp": layout({"tp": h}, {"tp": h}),
        "fsdp": layout({"dp": h, "zero": 3}, {"dp": h, "zero": 3}),
    }


def parse_layouts(spec: str, workers: int) -> dict[str, list[str]]:
    """``dhp,uniform_tp,fsdp`` (names of the default layouts) and/or ``name=key=value;key=value`` (which needs no
    default layout: any worker count)."""
    out: dict[str, list[str]] = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        name, sep, rest = item.partition("=")
        if sep:
            overrides = [o.strip() for o in rest.split(";") if o.strip()]
            bad = [o for o in overrides if "=" not in o]
            if not overrides or bad:
                raise ConfigError(f"--layouts: {item!r}: a layout is name=key=value;key=value (got {bad or rest!r})")
            out[name] = overrides
        elif name in DEFAULT_NAMES:
            out[name] = default_layouts(workers)[name]
        else:
            raise ConfigError(f"--layouts: unknown layout {name!r}; known: {', '.join(DEFAULT_NAMES)}, or give "
                              "name=key=value;key=value")
    if not out:
        raise ConfigError("--layouts: no layout given")
    return out


def layout_config(config: str | Path | None, overrides: list[str], layout: list[str], name: str, out: Path,
                  steps: int, warmup: int) -> Config:
    fixed = ["runtime.backend=ray", "runtime.count_collectives=true", f"train.steps={warmup + steps}",
             f"output.dir={out / name}",
             "output.overwrite=true", "output.save_final=false", "train.eval_at_end=false",
             "train.checkpoint_every=0", "train.resume=none"]
    return load_config(config, [*overrides, *layout, *fixed])


def check_layouts(cfgs: dict[str, Config]) -> None:
    """Every layout the model cannot take (a TP degree that does not divide its heads, ...), named, before the
    first layout trains: not after minutes of measuring the others."""
    from dhp.backends.ray_backend import module_layouts
    from dhp.inputs import resolve_inputs

    for name, cfg in cfgs.items():
        inputs = resolve_inputs(cfg)
        try:
            module_layouts(cfg, inputs.family, inputs.model_cfg)
        except ConfigError as e:
            raise ConfigError(f"--layouts {name}: {e}") from None


def summarize(rows: list[dict], warmup: int, modules: list[str]) -> dict[str, Any]:
    """A layout's figures from its metrics rows, warm-up steps left out."""
    measured = [r for r in rows if r["step"] > warmup] or rows[-1:]
    seconds = sum(r["step_time_s"] for r in measured)
    out: dict[str, Any] = {
        "steps_measured": [r["step"] for r in measured],
        "step_time_s": seconds / len(measured),
        "step_time_median_s": median(r["step_time_s"] for r in measured),
        "tokens_per_s": sum(r["tokens"] for r in measured) / seconds,
        "router_bytes_per_step": mean(r.get("router_bytes", 0) for r in measured),
        "router_bytes_per_step_by_direction": {d: mean(r.get(f"router_bytes_{d}", 0) for r in measured)
                                               for d in ("forward", "backward")},
        "loss": [r["loss"] for r in measured],
        "groups": {},
        "comm_bytes_per_step": {},
    }
    for m in modules:
        busy = mean(r.get(f"busy_{m}", 0.0) for r in measured)
        group = {"busy": busy, "idle": max(0.0, 1.0 - busy),
                 "imbalance": mean(r.get(f"imbalance_{m}", 1.0) for r in measured),
                 "data_wait_s": mean(r.get(f"time_{m}_data_wait_s", 0.0) for r in measured),
                 "peak_memory_gb": max(r.get(f"memory_gb_{m}", 0.0) for r in measured)}
        if all(f"mfu_{m}" in r for r in measured):
            group["mfu"] = mean(r[f"mfu_{m}"] for r in measured)
        out["groups"][m] = group
        comm = {}
        for key in sorted({k for r in measured for k in r if k.startswith(f"comm_{m}_")}):
            comm[key.removeprefix(f"comm_{m}_").removesuffix("_bytes")] = mean(r.get(key, 0) for r in measured)
        out["comm_bytes_per_step"][m] = comm
    return out


def run_bench(config: str | Path | None, overrides: list[str], layouts: dict[str, list[str]], steps: int,
              warmup: int, profile: str | Path | None = None) -> dict[str, Any]:
    """Train every layout in turn; write ``output.dir/bench.json`` and the charts; return the results. Each
    layout's config is read once, and all are checked before any runs. ``profile``: a device profile (``dhp plan
    calibrate``); each layout then carries the planner's ``predicted_step_s`` beside its measured step time."""
    from dhp.train import train

    base = load_config(config, overrides)
    out = Path(base.output.dir)
    check_writable(out)  # bench.json is written after every layout has run: its folder is checked first
    cfgs = {name: layout_config(config, overrides, layout, name, out, steps, warmup)
            for name, layout in layouts.items()}
    check_layouts(cfgs)
    share = machine_share(base, list(cfgs.values()), overrides)
    if share is not None:
        for cfg in cfgs.values():
            cfg.runtime.cpus_per_worker = share
        overrides = [*overrides, f"runtime.cpus_per_worker={share:g}"]
    results: dict[str, Any] = {"steps": steps, "warmup": warmup, "overrides": overrides, "layouts": {}}
    predicted = predictions(cfgs, profile, step=warmup) if profile else {}
    for name, cfg in cfgs.items():
        print(f"dhp bench: layout {name}: {' '.join(layouts[name])}", flush=True)
        train(cfg)
        metrics = Path(cfg.output.dir) / "metrics.jsonl"
        rows = [row for _, row in metric_rows(metrics.read_text(), metrics)]
        results["layouts"][name] = {"overrides": layouts[name], **summarize(rows, warmup, list(cfg.modules)),
                                    **predicted.get(name, {})}
    res = results["layouts"]
    if "uniform_tp" in res:
        for r in res.values():
            r["ratio_to_uniform_tp"] = r["tokens_per_s"] / res["uniform_tp"]["tokens_per_s"]
    if "dhp" in res and "uniform_tp" in res:
        def vision_bytes(r: dict) -> float:
            return sum(r["comm_bytes_per_step"].get("vision", {}).values())

        tp = vision_bytes(res["uniform_tp"])
        results["vision_comm_ratio_sp_tp"] = vision_bytes(res["dhp"]) / tp if tp else None
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    results["plots"] = [str(p) for p in plot_bench(results, out)]
    print_table(results)
    print(f"dhp bench: {out / 'bench.json'}; charts: {', '.join(results['plots'])}", flush=True)
    return results


def predictions(cfgs: dict[str, Config], profile: str | Path, step: int = 0) -> dict[str, dict[str, Any]]:
    """Per layout the planner's ``predicted_step_s`` on ``profile`` and its breakdown (``dhp.plan.predict``), of
    the config's step ``step`` (0-based: the first measured one), its own samples."""
    from dhp.plan.predict import predict_config
    from dhp.plan.profile import Profile

    try:
        prof = Profile.load(profile)
    except ValueError as e:
        raise ConfigError(f"--profile: {e}") from None
    out = {}
    for name, cfg in cfgs.items():
        p = predict_config(cfg, prof, step=step)
        out[name] = {"predicted_step_s": p["predicted_step_s"], "prediction": p}
        print(f"dhp bench: layout {name}: predicted {p['predicted_step_s']:.3f} s per step ({p['pricing']})",
              flush=True)
    return out


def machine_share(base: Config, cfgs: list[Config], overrides: list[str], cpus: int | None = None) -> float | None:
    """The ``runtime.cpus_per_worker`` that fits the largest layout on this machine's CPUs, as the demo's config
    fits its two workers on two cores, said before Ray starts; None: leave it (the user set the key on the
    command line, the run joins a Ray cluster whose resources are its own, or the layouts fit as they are)."""
    import os

    if any(o.split("=", 1)[0].strip() == "runtime.cpus_per_worker" for o in overrides):
        return None
    if base.runtime.ray_address or os.environ.get("RAY_ADDRESS"):
        return None
    cpus = cpus if cpus is not None else (os.cpu_count() or 1)
    workers = max(sum(p.dp * p.sp * p.tp for p in (m.parallel for m in cfg.modules.values())) for cfg in cfgs)
    if workers * base.runtime.cpus_per_worker <= cpus + 1e-9:
        return None
    share = cpus / workers
    print(f"dhp bench: {workers} workers per layout on this machine's {cpus} CPUs: "
          f"runtime.cpus_per_worker={share:g} (was {base.runtime.cpus_per_worker:g}; set it to choose)", flush=True)
    return share


def print_table(results: dict[str, Any]) -> None:
    res = results["layouts"]
    modules = sorted({m for r in res.values() for m in r["groups"]})
    pred = any("predicted_step_s" in r for r in res.values())
    head = (f"{'layout':<12} {'tokens/s':>9} {'vs TP':>6} " + (f"{'step s':>7} {'pred s':>7} " if pred else "")
            + " ".join(f"{m + ' busy':>11} {m + ' mfu':>10} {m + ' GB':>8}" for m in modules))
    print(head)
    for name, r in res.items():
        cells = []
        for m in modules:
            g = r["groups"].get(m, {})
            cells.append(f"{g.get('busy', 0):>11.0%} {g.get('mfu', float('nan')):>10.2%} "
                         f"{g.get('peak_memory_gb', 0):>8.2f}")
        ratio = r.get("ratio_to_uniform_tp")
        times = f"{r['step_time_s']:>7.3f} {r.get('predicted_step_s', float('nan')):>7.3f} " if pred else ""
        print(f"{name:<12} {r['tokens_per_s']:>9.0f} {(f'{ratio:.2f}' if ratio else '-'):>6} " + times
              + " ".join(cells))
    if results.get("vision_comm_ratio_sp_tp") is not None:
        print(f"vision collective bytes, dhp (SP) / uniform_tp (TP): {results['vision_comm_ratio_sp_tp']:.3f}")


def plot_bench(results: dict[str, Any], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = results["layouts"]
    names = list(res)
    modules = sorted({m for r in res.values() for m in r["groups"]})
    written = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(names, [res[n]["tokens_per_s"] for n in names], color="#4C72B0")
    ax.set_ylabel("tokens/s")
    ax.set_title("throughput (warm-up excluded)")
    fig.tight_layout()
    fig.savefig(out / "bench_throughput.png", dpi=100)
    plt.close(fig)
    written.append(out / "bench_throughput.png")

    panels = [("busy", "busy fraction"), ("mfu", "MFU"), ("peak_memory_gb", "peak memory (GB)"), ("comm", "MB/step")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 4))
    width = 0.8 / max(1, len(modules))
    for ax, (key, label) in zip(axes, panels, strict=True):
        for j, m in enumerate(modules):
            if key == "comm":
                values = [sum(res[n]["comm_bytes_per_step"].get(m, {}).values()) / 2**20 for n in names]
            else:
                values = [res[n]["groups"].get(m, {}).get(key, 0.0) for n in names]
            ax.bar([i + j * width for i in range(len(names))], values, width, label=m)
        ax.set_xticks([i + width * (len(modules) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names)
        ax.set_title(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bench_groups.png", dpi=100)
    plt.close(fig)
    written.append(out / "bench_groups.png")
    return written


# ---- --max-vision-tokens: the largest image each layout trains under a per-worker memory budget -----------------

SHORT_TEXT = 64  # text tokens of the probe's sample besides the image's placeholders
RAM_HEADROOM = 3  # a probe may overshoot the budget (doubling: up to 2x), plus the process itself
SEARCHED = "vision"  # the encoder whose media --max-vision-tokens grows (a sample of one image)


def layout_jobs(cfg: Config, family: Any = None) -> dict[str, GroupJob]:
    """The planner's jobs (one per module group) of a layout's config, one sample of ``SHORT_TEXT`` text tokens
    (the searched media are set per probe; another encoder's group gets none: it runs no micro-batch)."""
    from dhp.models.registry import resolve_family
    from dhp.plan.planner import config_jobs

    family = family or resolve_family(cfg.model.family, cfg.model.hf_path, cfg.model.preset)
    try:
        return config_jobs(cfg, family, {}, SHORT_TEXT, device="cpu")
    except ValueError as e:
        raise ConfigError(f"--max-vision-tokens: {e}") from None


def media_per_token(family: Any, model_cfg: Any, encoder: str = SEARCHED, probe: int = 4096) -> int:
    """The encoder's input tokens per placeholder token of the language model (Qwen's vision: 4 patches per merged
    token), read off the family's synthetic sample."""
    from dhp.plan.measure import GroupJob, synthetic_samples

    (s,) = synthetic_samples(GroupJob(encoder, media=((encoder, probe),), text_tokens=0), model_cfg, family)
    n = family.module(encoder).num_placeholders(s, model_cfg)
    if n < 1 or probe % n:
        raise ConfigError(f"--max-vision-tokens: the {encoder} encoder's {probe} input tokens fill {n} placeholders; "
                          "its sizes are not a whole number of input tokens per placeholder")
    return probe // n


def check_max_tokens_args(budget_gb: float | None, start: int, stop: int, step: int | None = None) -> None:
    """Bad flags, each named; ``step`` (the resolution, known once the model is read) checks the sizes too."""
    from dhp.errors import UsageError

    if budget_gb is None:
        raise UsageError("--max-vision-tokens needs --memory-budget-gb (the per-worker budget in GiB; on CPU a "
                         "figure of the planner's memory tracker, not the machine's RAM)")
    if not budget_gb > 0:
        raise UsageError(f"--memory-budget-gb must be > 0 (got {budget_gb:g})")
    if start < 1:
        raise UsageError(f"--vision-tokens-start must be >= 1 (got {start})")
    if start > stop:
        raise UsageError(f"--vision-tokens-start ({start}) must be <= --vision-tokens-max ({stop})")
    if step is not None:
        for flag, n in (("--vision-tokens-start", start), ("--vision-tokens-max", stop)):
            if n % step:
                raise UsageError(f"{flag} must be a multiple of {step} vision tokens (one attention window, "
                                 f"the search's resolution); got {n}")


def _check_ram(budget: int, ranks: int) -> None:
    """A probe's tensors are real: refuse a budget whose failing probe could outgrow this machine's RAM."""
    from dhp.errors import UsageError

    try:
        meminfo = Path("/proc/meminfo").read_text().split("\n")
        free = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return
    if RAM_HEADROOM * budget * ranks > free:
        raise UsageError(f"--memory-budget-gb {budget / GiB:g}: {ranks} probe processes at up to {RAM_HEADROOM}x "
                         f"the budget need more than the {free / GiB:.1f} GiB this machine has free; give a smaller "
                         "budget")


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _search_rank(rank: int, world: int, port: int, out: str, job: GroupJob, model_cfg: Any, family: str,
                 budget: int, start: int, stop: int, step: int, unit: int, parent: int,
                 cap_first: bool = False) -> None:
    """One rank of a group's search (a spawned process in a gloo group of the group's size): every probe is
    ``measure(fake=False)`` on real tensors; the group's peak is the largest rank's (all-reduced), so every
    rank takes the same next size."""
    import os
    from dataclasses import replace
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from dhp.lifetime import exit_with_parent
    from dhp.models.registry import get_family
    from dhp.plan.measure import measure, media_of

    exit_with_parent(parent)  # a killed `dhp bench` leaves no rank behind (its pid: it may be gone already)

    torch.set_num_threads(1)  # the group's ranks share the machine's cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(minutes=10))
    try:
        spec = get_family(family)

        def probe(tokens: int) -> int:
            r = measure(replace(job, media=media_of({SEARCHED: tokens * unit})), model_cfg, spec, fake=False)
            peak = torch.tensor([r.peak], dtype=torch.int64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            return int(peak.item())

        g = _grow_from_cap(probe, budget, start, stop, step) if cap_first else grow(probe, budget, start, stop, step)
        if rank == 0:
            Path(out).write_text(json.dumps({"largest": g.largest, "first_failed": g.first_failed,
                                             "probes": g.probes}))
        dist.barrier()  # rank 0 hosts the store: nobody leaves while a peer still needs it
    finally:
        dist.destroy_process_group()
    os._exit(0)  # gloo's threads do not survive interpreter finalization reliably (see tests/spawn.py)


def _grow_from_cap(probe: Callable[[int], int], budget: int, start: int, stop: int, step: int) -> Growth:
    """``grow``'s answer, probing ``stop`` first: a group that fits there (memory grows with the size, as ``grow``
    takes it) needs no smaller probe; otherwise ``grow`` from ``start``, the cap's probe not run twice."""
    first = probe(stop)
    if first <= budget:
        return Growth(stop, None, [(stop, first)])
    g = grow(lambda n: first if n == stop else probe(n), budget, start, stop, step)
    if stop not in dict(g.probes):
        g.probes.insert(0, (stop, first))
    return g


def search_group(job: GroupJob, model_cfg: Any, family: str, budget: int, start: int, stop: int,
                 step: int, unit: int, cap_first: bool = False) -> Growth:
    """``grow`` over one group, run by ``job.ranks`` fresh processes in a real gloo group (``cap_first``: a
    group searched under an earlier group's answer ``stop`` probes it first, ``_grow_from_cap``)."""
    import os
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="dhp-maxtok-") as d:
        out = str(Path(d) / "growth.json")
        mp.start_processes(_search_rank, args=(job.ranks, _free_port(), out, job, model_cfg, family, budget, start,
                                               stop, step, unit, os.getpid(), cap_first), nprocs=job.ranks, join=True,
                           start_method="spawn")
        doc = json.loads(Path(out).read_text())
    return Growth(doc["largest"], doc["first_failed"], [tuple(p) for p in doc["probes"]])


def _combine(searches: dict[str, Growth]) -> tuple[int | None, int | None]:
    """The layout's largest (every group fits) and first failure, from per-group searches."""
    if any(s.largest is None for s in searches.values()):
        return None, min(s.first_failed for s in searches.values() if s.largest is None)
    fails = [s.first_failed for s in searches.values() if s.first_failed is not None]
    return min(s.largest for s in searches.values()), (min(fails) if fails else None)


def measured_max_tokens(jobs: dict[str, GroupJob], model_cfg: Any, family: str, budget: int, start: int, stop: int,
                        step: int, unit: int) -> dict[str, Any]:
    """The groups one after another (the searched encoder's first); a later group searches only up to what the
    earlier ones allow (a larger image could not train anyway), that cap probed first. A group whose peak at the
    layout's largest was not among its probes gets one more probe there, so every group's peak at the answer is a
    measurement."""
    searches: dict[str, Growth] = {}
    cap = stop
    for name in sorted(jobs, key=lambda m: m != SEARCHED):
        if start > cap:
            break
        searches[name] = search_group(jobs[name], model_cfg, family, budget, start, cap, step, unit,
                                      cap_first=bool(searches))
        if searches[name].largest is None:
            break
        cap = min(cap, searches[name].largest)
    largest, failed = _combine(searches)
    peaks: dict[str, int] = {}
    if largest is not None:
        for name, job in jobs.items():
            seen = dict(searches[name].probes)
            if largest not in seen:
                extra = search_group(job, model_cfg, family, budget, largest, largest, step, unit)
                searches[name].probes += extra.probes
                seen = dict(searches[name].probes)
            peaks[name] = seen[largest]
    return {"largest": largest, "first_failed": failed, "peaks": peaks,
            "probes": {m: s.probes for m, s in searches.items()}}


def planner_max_tokens(name: str, cfg: Config, jobs: dict[str, GroupJob], model_cfg: Any, family: Any, budget: int,
                       start: int, stop: int, step: int, unit: int) -> dict[str, dict[str, Any]]:
    """The planner's answers by the same search on its fake runs (``planner.largest_fitting``): ``one_micro_batch``,
    the fake run's per-rank peak itself, and ``planner``, ``dhp plan``'s verdict for this placement."""
    from dhp.plan.planner import largest_fitting

    got = largest_fitting(jobs, model_cfg, family, SEARCHED, budget, start, stop, step, cfg.runtime.placement,
                          media_per_token=unit, name=name)
    return {k: {"vision_tokens": v["tokens"], "first_failed": v["first_failed"], "peak_gb": v["peak_gb"]}
            for k, v in got.items()}


def run_max_vision_tokens(config: str | Path | None, overrides: list[str], layouts: dict[str, list[str]],
                          budget_gb: float, start: int, stop: int) -> dict[str, Any]:
    """For each layout, the largest single image (in vision tokens, 4 patches each) whose training step keeps
    every worker's tracked peak within ``budget_gb``; ``bench.json``'s ``max_vision_tokens``, a chart and the
    table "largest vision sequence per layout", each beside the planner's prediction.

    How a probe runs, and why so: each module group of the layout is run as its own real gloo process group
    of its size (vision SP 2: two processes), through ``dhp.plan.measure.measure(fake=False)``: the family's
    build and ``parallelize`` (Ulysses SP, TP, FSDP2, checkpointing), the engine's optimizer, one sample's
    forward and backward and the optimizer step, on real tensors, under the planner's own tracker
    (``MemTracker`` / ``FSDPMemTracker``) -- the code ``dhp train`` runs for that layout, one rank's figure
    exactly as the planner takes it, so the two can be compared. Not a Ray ``dhp train`` per probe: that
    costs seconds of start-up per probe, needs a data set with an image of each size, and its CPU memory
    figure is the process's, not the tracked one. A group's search runs inside one set of processes (the
    ranks agree on the next size by all-reducing their peak), so a search costs one process start. On CPU the
    budget is a tracked figure: the search stops growing once a probe's tracked peak exceeds it, and a budget
    whose failing probe (at most 2x the last fit) could outgrow the machine's free RAM is refused."""
    from dhp.inputs import resolve_inputs

    check_max_tokens_args(budget_gb, start, stop)
    budget = round(budget_gb * GiB)
    base = load_config(config, overrides)
    out = Path(base.output.dir)
    check_writable(out)
    cfgs = {name: layout_config(config, overrides, layout, name, out, 1, 0) for name, layout in layouts.items()}
    check_layouts(cfgs)
    from dhp.plan.planner import family_ref

    inputs = resolve_inputs(base)
    model_cfg, family = inputs.model_cfg, inputs.family
    ref = family_ref(family)
    if ref is None:
        raise ConfigError(f"--max-vision-tokens: the {family.name} family is registered in this process only; name "
                          "it as model.family=package.module:ATTR so that the probe processes can load it")
    if SEARCHED not in family.module_names:
        raise ConfigError(f"--max-vision-tokens: the {family.name} family has no {SEARCHED} encoder")
    step = model_cfg.vision.window_merged ** 2  # one attention window of merged tokens: the search's resolution
    unit = media_per_token(family, model_cfg)
    check_max_tokens_args(budget_gb, start, stop, step)
    jobs = {name: layout_jobs(cfg, family) for name, cfg in cfgs.items()}
    _check_ram(budget, max(j.ranks for js in jobs.values() for j in js.values()))
    found: dict[str, Any] = {}
    for name, cfg in cfgs.items():
        print(f"dhp bench: --max-vision-tokens: layout {name}: {' '.join(layouts[name])}", flush=True)
        m = measured_max_tokens(jobs[name], model_cfg, ref, budget, start, stop, step, unit)
        found[name] = {
            "overrides": layouts[name], "vision_tokens": m["largest"],
            "patches": m["largest"] * unit if m["largest"] else None,
            "first_failed": m["first_failed"], "budget_gb": budget_gb, "resolution": step,
            "groups": {g: {"ranks": jobs[name][g].ranks, "peak_gb": p / GiB} for g, p in m["peaks"].items()},
            "probes": {g: [{"vision_tokens": n, "peak_gb": p / GiB, "fits": p <= budget} for n, p in ps]
                       for g, ps in m["probes"].items()},
            **planner_max_tokens(name, cfg, jobs[name], model_cfg, family, budget, start, stop, step, unit),
        }
    results = {"budget_gb": budget_gb, "vision_tokens_start": start, "vision_tokens_max": stop,
               "text_tokens": SHORT_TEXT, "memory": "tracked (torch.distributed._tools MemTracker), CPU",
               "layouts": found}
    out.mkdir(parents=True, exist_ok=True)
    path = out / "bench.json"
    doc = json.loads(path.read_text()) if path.is_file() else {}
    doc["max_vision_tokens"] = results
    path.write_text(json.dumps(doc, indent=2) + "\n")
    results["plot"] = str(plot_max_tokens(results, out))
    print_max_tokens(results)
    print(f"dhp bench: {path} (max_vision_tokens); chart: {results['plot']}", flush=True)
    return results


def print_max_tokens(results: dict[str, Any]) -> None:
    def n(x: int | None) -> str:
        return "-" if x is None else str(x)

    res = results["layouts"]
    modules = sorted({g for r in res.values() for g in r["groups"]} | {"text", "vision"})
    print(f"largest vision sequence per layout (one image + {results['text_tokens']} text tokens per sample; "
          f"budget {results['budget_gb']:g} GiB per worker, {results['memory']})")
    head = (f"{'layout':<12} {'vision tok':>10} {'patches':>8} {'failed at':>9} "
            + " ".join(f"{m + ' GiB':>10}" for m in modules) + f" {'plan 1-mb':>9} {'plan':>6}")
    print(head)
    for name, r in res.items():
        peaks = " ".join(f"{r['groups'].get(m, {}).get('peak_gb', float('nan')):>10.4f}" for m in modules)
        print(f"{name:<12} {n(r['vision_tokens']):>10} {n(r['patches']):>8} {n(r['first_failed']):>9} {peaks} "
              f"{n(r['one_micro_batch']['vision_tokens']):>9} {n(r['planner']['vision_tokens']):>6}")
    print(f"(measured to {next(iter(res.values()))['resolution']} vision tokens; plan 1-mb: the planner's fake run "
          "of the same step; plan: `dhp plan`'s verdict, which adds what the placement holds besides)")


def plot_max_tokens(results: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = results["layouts"]
    names = list(res)
    series = [("measured", lambda r: r["vision_tokens"]), ("planner, same step", lambda r:
              r["one_micro_batch"]["vision_tokens"]), ("planner verdict", lambda r: r["planner"]["vision_tokens"])]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(6, 4))
    for j, (label, get) in enumerate(series):
        ax.bar([i + j * width for i in range(len(names))], [get(res[n]) or 0 for n in names], width, label=label)
    ax.set_xticks([i + width * (len(series) - 1) / 2 for i in range(len(names))])
    ax.set_xticklabels(names)
    ax.set_ylabel("vision tokens (one image)")
    ax.set_title(f"largest vision sequence per layout ({results['budget_gb']:g} GiB per worker)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out / "bench_max_vision_tokens.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
