"""``dhp plan MODEL --gpus N``: the table, the JSON and the plot (see ``docs/plan.md``)."""

from __future__ import annotations

import json
import shlex
import sys
import threading
import time
from pathlib import Path
from typing import Any

from dhp.plan.devices import get_device
from dhp.plan.planner import STRATEGIES, Row, plan


def model_config(name: str) -> Any:
    """A preset (tiny, 3b, 7b, 32b, 72b), an HF checkpoint directory, or a config.json file."""
    from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig, preset

    p = Path(name)
    if p.is_dir():
        p = p / "config.json"
    d = json.loads(p.read_text()) if p.is_file() else {}
    if name.startswith("omni-") or str(d.get("model_type", "")).startswith("qwen2_5_omni"):
        raise ValueError(f"{name}: dhp plan models Qwen2.5-VL's two groups (vision, text); Qwen2.5-Omni's audio "
                         "group is not in its search yet: give a Qwen2.5-VL preset or checkpoint")
    return Qwen2_5_VLConfig.from_hf_dict(d) if d else preset(name)


def _layout(job: Any) -> str:
    """``sp8xdp1 z1``, ``tp4xdp2 z1``, ``dp8 z3``: a group's layout in the table."""
    inner = f"{job.inner_kind}{job.inner}x" if job.inner > 1 else ""
    return f"{inner}dp{job.dp} z{job.zero}"


def table(rows: list[Row], limit: float) -> str:
    head = f"{'strategy':<18} {'vision tok':>10} {'AC':>3} {'fits':>4} {'vision GB':>9} {'text GB':>8} " \
           f"{'step s':>8} {'tokens/s':>10}  layout"
    out = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: (r.vision_tokens, r.ac, r.strategy)):
        v, t = r.jobs["vision"], r.jobs["text"]
        lay = f"V {_layout(v)} | T {_layout(t)}"
        out.append(f"{r.strategy:<18} {r.vision_tokens:>10} {'on' if r.ac else 'off':>3} "
                   f"{'yes' if r.fits else 'no':>4} {r.groups['vision']['peak_gb']:>9.1f} "
                   f"{r.groups['text']['peak_gb']:>8.1f} {r.step_time_s:>8.2f} {r.tokens_per_s:>10.0f}  {lay}")
    return "\n".join(out)


def run_plan(args: Any) -> int:
    try:
        model_cfg = model_config(args.model)
    except (ValueError, KeyError) as e:
        from dhp.errors import ModelError

        raise ModelError(str(e).strip("'\"")) from None
    dev = get_device(args.device, args.peak_tflops)
    limit = args.gpu_memory_gb or dev.memory_gb
    tokens = [int(x) for x in str(args.vision_tokens).split(",") if x]
    strategies = tuple(s for s in (args.strategies or ",".join(STRATEGIES)).split(",") if s)
    precision = getattr(args, "precision", "fp32_master")
    with Heartbeat(f"{args.model} on {args.gpus} GPUs: measuring every layout by fake runs of the real code "
                   f"({', '.join(strategies)}; vision tokens {', '.join(map(str, tokens))})"):
        rows = plan(model_cfg, args.gpus, dev, limit, tokens, args.text_tokens, args.micro_batch_size, strategies,
                    precision=precision)
    fitting = [r for r in rows if r.fits]
    rec = max(fitting, key=lambda r: r.tokens_per_s) if fitting else None
    print(f"{args.model} on {args.gpus} x {dev.name} ({limit:g} GB), efficiency {dev.efficiency:.0%} of "
          f"{dev.peak_bf16_tflops:g} TFLOP/s; {args.text_tokens} text tokens + one image per sample, "
          f"{args.micro_batch_size} sample(s) per micro-batch; precision {precision}")
    print(table(rows, limit))
    if rec is not None:
        print(f"\nfastest that fits: {rec.strategy} at {rec.vision_tokens} vision tokens, "
              f"{rec.tokens_per_s:.0f} tokens/s\n  " + train_command(args.model, rec))
    else:
        print("\nno layout fits")
    if args.json:
        doc = {"model": args.model, "gpus": args.gpus, "gpu_memory_gb": limit,
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

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key in sorted({(r.strategy, r.ac) for r in rows}):
        pts = sorted((r.vision_tokens, max(g["peak_gb"] for g in r.groups.values()))
                     for r in rows if (r.strategy, r.ac) == key)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                label=f"{key[0]}{' +AC' if key[1] else ''}")
    ax.axhline(limit, color="red", linestyle="--", label=f"GPU limit {limit:g} GB")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("vision tokens per sample")
    ax.set_ylabel("per-rank peak (GB)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
