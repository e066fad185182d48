"""``dhp plan MODEL --gpus N``: the table, the JSON and the plot (see ``docs/plan.md``)."""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dhp.observe.devices import get_device
from dhp.plan.planner import STRATEGIES, Row, plan


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
        sizes = [int(x) for x in str(given).split(",") if x]
        if not sizes or min(sizes) < 1:
            raise UsageError(f"--{enc.name}-tokens: give positive sizes, comma-separated (got {given!r})")
        lists.append([(enc.name, n) for n in sizes])
    return [dict(c) for c in itertools.product(*lists)]


def _layout(job: Any) -> str:
    """``sp8xdp1 z1``, ``tp4xdp2 z1``, ``dp8 z3``: a group's layout in the table."""
    inner = f"{job.inner_kind}{job.inner}x" if job.inner > 1 else ""
    return f"{inner}dp{job.dp} z{job.zero}"


def _short(name: str) -> str:
    return name[:1].upper()


def table(rows: list[Row], limit: float) -> str:
    """One line per row: its media sizes, checkpointing, fit, every group's peak, step time and throughput."""
    encs = list(dict.fromkeys(k for r in rows for k in r.jobs if k in r.media_tokens()))  # the family's order
    groups = list(dict.fromkeys(k for r in rows for k in r.jobs))
    head = (f"{'strategy':<18} " + " ".join(f"{e + ' tok':>10}" for e in encs) + f" {'AC':>3} {'fits':>4} "
            + " ".join(f"{g + ' GB':>9}" for g in groups) + f" {'step s':>8} {'tokens/s':>10}  layout")
    out = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (tuple(r.media_tokens().get(e, 0) for e in encs), r.ac, r.strategy)):
        media = r.media_tokens()
        lay = " | ".join(f"{_short(k)} {_layout(j)}" for k, j in r.jobs.items())
        out.append(f"{r.strategy:<18} " + " ".join(f"{media.get(e, 0):>10}" for e in encs)
                   + f" {'on' if r.ac else 'off':>3} {'yes' if r.fits else 'no':>4} "
                   + " ".join(f"{r.groups[g]['peak_gb']:>9.1f}" for g in groups)
                   + f" {r.step_time_s:>8.2f} {r.tokens_per_s:>10.0f}  {lay}")
    return "\n".join(out)


def _sizes(media: dict[str, int]) -> str:
    return ", ".join(f"{n} {k} tokens" for k, n in media.items()) or "no media"


def run_plan(args: Any) -> int:
    from dhp.errors import ModelError

    try:
        family, model_cfg = model_config(args.model, getattr(args, "family", None))
    except (ValueError, KeyError, FileNotFoundError) as e:
        raise ModelError(str(e).strip("'\"")) from None
    dev = get_device(args.device, args.peak_tflops)
    limit = args.gpu_memory_gb or dev.memory_gb
    points = media_points(family, args)
    strategies = tuple(s for s in (args.strategies or ",".join(STRATEGIES)).split(",") if s)
    precision = getattr(args, "precision", "fp32_master")
    with Heartbeat(f"{args.model} ({family.name}: {', '.join(family.module_names)}) on {args.gpus} GPUs: measuring "
                   f"every layout by fake runs of the real code ({', '.join(strategies)}; "
                   f"{'; '.join(_sizes(p) for p in points)})"):
        rows = plan(model_cfg, args.gpus, dev, limit, points, args.text_tokens, args.micro_batch_size, strategies,
                    precision=precision, family=family)
    fitting = [r for r in rows if r.fits]
    rec = max(fitting, key=lambda r: r.tokens_per_s) if fitting else None
    print(f"{args.model} on {args.gpus} x {dev.name} ({limit:g} GB), efficiency {dev.efficiency:.0%} of "
          f"{dev.peak_bf16_tflops:g} TFLOP/s; {args.text_tokens} text tokens + the media per sample, "
          f"{args.micro_batch_size} sample(s) per micro-batch; precision {precision}")
    print(table(rows, limit))
    if rec is not None:
        media = rec.media_tokens()
        print(f"\nfastest that fits: {rec.strategy} at {_sizes({k: media[k] for k in rec.jobs if k in media})}, "
              f"{rec.tokens_per_s:.0f} tokens/s\n  " + train_command(args.model, rec))
    else:
        print("\nno layout fits")
    if args.json:
        doc = {"model": args.model, "family": family.name, "gpus": args.gpus, "gpu_memory_gb": limit,
               "rows": [r.to_dict() for r in rows], "recommended": rec.to_dict() if rec else None}
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plot:
        plot(rows, limit, args.plot)
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    axis = next(iter(rows[0].media_tokens()), "media") if rows else "media"  # the first encoder's sizes
    fig, ax = plt.subplots(figsize=(7, 4.5))
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
    fig.tight_layout()
    fig.savefig(path)
