"""``dhp report RUN_DIR``: PNG plots of a run from its files (matplotlib, no display needed).

* ``loss_lr.png``: loss and learning rate per step;
* ``throughput_mfu.png``: tokens/s, and MFU per module group (``mfu_<module>``);
* ``memory.png``: peak memory per group;
* ``timeline.png``: a Gantt chart of ``trace.json`` (one row per rank, a colour per phase),
  when the run wrote one (``output.trace_steps``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from dhp.errors import UsageError
from dhp.observe.metrics_file import metric_rows

REPORTED = ("step", "loss", "lr", "tokens_per_s", "memory_gb")  # what every plot reads from each row

PHASE_COLORS = {"forward": "#4C72B0", "emit": "#8172B2", "forward_backward": "#DD8452", "backward": "#55A868",
                "reduce": "#C44E52", "optimizer": "#937860", "waiting": "#DDDDDD", "step": "#999999"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_metrics(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{run_dir}: no metrics.jsonl; give the output.dir of a run")
    rows = [row for _, row in metric_rows(path.read_text(), path)]
    if not rows:
        raise UsageError(f"{path} is empty: the run finished no step")
    for row in rows:
        missing = [k for k in REPORTED if k not in row]
        if missing:
            raise UsageError(f"{path}: the row of step {row['step']} has no {', '.join(missing)}: not a row dhp train "
                             "wrote; give the output.dir of a dhp run")
    return rows


def _modules(rows: list[dict], prefix: str) -> list[str]:
    return sorted({k[len(prefix):] for r in rows for k in r if k.startswith(prefix)})


def _save(plt: Any, fig: Any, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def plot_loss_lr(rows: list[dict], out: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["loss"] for r in rows], color="#4C72B0", label="loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss", color="#4C72B0")
    lr = ax.twinx()
    lr.plot(steps, [r["lr"] for r in rows], color="#DD8452", label="learning rate")
    lr.set_ylabel("learning rate", color="#DD8452")
    ax.set_title("loss and learning rate")
    return _save(plt, fig, out)


def plot_throughput_mfu(rows: list[dict], out: Path) -> Path:
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [r["step"] for r in rows]
    a.plot(steps, [r["tokens_per_s"] for r in rows], marker=".")
    a.set_xlabel("step")
    a.set_ylabel("tokens/s")
    a.set_title("throughput")
    for m in _modules(rows, "mfu_"):
        b.plot(steps, [100 * r.get(f"mfu_{m}", float("nan")) for r in rows], marker=".", label=m)
    b.set_xlabel("step")
    b.set_ylabel("MFU (%)")
    b.set_title("MFU per group")
    if _modules(rows, "mfu_"):
        b.legend()
    return _save(plt, fig, out)


def plot_memory(rows: list[dict], out: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [r["step"] for r in rows]
    modules = _modules(rows, "memory_gb_")
    for m in modules:
        ax.plot(steps, [r.get(f"memory_gb_{m}", float("nan")) for r in rows], marker=".", label=m)
    if not modules:
        ax.plot(steps, [r["memory_gb"] for r in rows], marker=".", label="peak")
    ax.set_xlabel("step")
    ax.set_ylabel("peak memory (GB)")
    ax.set_title("memory per group (peak over its ranks)")
    ax.legend()
    return _save(plt, fig, out)


def plot_timeline(trace: Path, out: Path) -> Path:
    from dhp.observe.trace import read_trace

    plt = _pyplot()
    events = read_trace(trace)
    rows = sorted({(e["pid"], e["module"], e["rank"]) for e in events})
    index = {(m, r): i for i, (_, m, r) in enumerate(rows)}
    fig, ax = plt.subplots(figsize=(12, 1 + 0.6 * len(rows)))
    seen = set()
    for e in events:
        name = "step" if e["module"] == "driver" else e["name"]
        color = PHASE_COLORS.get(name, "#000000")
        ax.barh(index[(e["module"], e["rank"])], e["dur"] / 1e3, left=e["ts"] / 1e3, height=0.7, color=color,
                edgecolor="white", linewidth=0.3, label=None if name in seen else name)
        seen.add(name)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels(["driver" if m == "driver" else f"{m} {r}" for _, m, r in rows])
    ax.invert_yaxis()
    ax.set_xlabel("time (ms)")
    ax.set_title("timeline (trace.json)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=8, fontsize="small")
    return _save(plt, fig, out)


def make_report(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    """Every plot the run's files allow, into ``out_dir`` (default ``RUN_DIR/plots``); their paths."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    out_dir = Path(out_dir) if out_dir else run_dir / "plots"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = [plot_loss_lr(rows, out_dir / "loss_lr.png"), plot_throughput_mfu(rows, out_dir / "throughput_mfu.png"),
               plot_memory(rows, out_dir / "memory.png")]
    trace = run_dir / "trace.json"
    if trace.is_file():
        try:
            written.append(plot_timeline(trace, out_dir / "timeline.png"))
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # not the file dhp writes (whole, atomically)
            print(f"dhp report: {trace}: not a trace dhp wrote ({type(e).__name__}: {e}); the timeline is left out",
                  file=sys.stderr)
    return written
