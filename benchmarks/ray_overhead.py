"""The demo's step time under Ray (disaggregated and collocated) over the single-process backend's, same cores.

Why: the Ray runtime adds actors, a driver loop and a data plane between the
groups to the same module engines the local backend runs; on the demo's two
CPU cores that overhead is what separates them. Each variant trains the demo
(``dhp train``, the embedded config, the demo data) for ``--steps`` steps
with evaluation, checkpoints and export off, and reports the median step time
of the steps after ``--warmup``, read from its metrics.jsonl, and the
router's bytes per step. Run it from a checkout (``python benchmarks/ray_overhead.py``); to measure another
version, put that version first on PYTHONPATH (Ray's workers inherit it).

``--repeat N`` runs the variants N times, interleaved (variant by variant, round after round, so that a change
of the machine's load falls on all of them), and reports the median of the runs' medians with the load average
at each run. On a shared machine, that is the figure to trust. The ``*_1t`` and ``*_2t`` variants fix the
intra-op threads of every process (``OMP_NUM_THREADS``; Ray gives each worker its CPUs' worth, 1 at
``runtime.cpus_per_worker=1``, where it is unset), to separate the thread count from the runtime's overhead.

    python benchmarks/ray_overhead.py [--steps 12] [--warmup 2] [--repeat 3] [--out outputs/bench/ray_overhead.json]
                                      [--variants local,disaggregated,collocated] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BACKENDS = {
    "local": ["runtime.backend=local"],
    "disaggregated": ["runtime.backend=ray", "runtime.placement=disaggregated"],
    "collocated": ["runtime.backend=ray", "runtime.placement=collocated"],
}
VARIANTS = {**{name: (over, {}) for name, over in BACKENDS.items()},
            **{f"{name}_{n}t": (over, {"OMP_NUM_THREADS": str(n)}) for name, over in BACKENDS.items() for n in (1, 2)}}
DEFAULT = ("local", "disaggregated", "collocated")


def run_variant(name: str, steps: int, extra: list[str], root: Path) -> list[dict]:
    out = root / name
    overrides, env = VARIANTS[name]
    cmd = [sys.executable, "-m", "dhp.cli", "train", *overrides, f"train.steps={steps}", "train.log_every=1",
           f"output.dir={out}", "output.overwrite=true", "output.save_final=false", "train.eval_at_end=false",
           "train.checkpoint_every=0", "train.resume=none", *extra]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env={**os.environ, **env})
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def summarize(rows: list[dict], warmup: int) -> dict:
    measured = [r for r in rows if r.get("step", 0) > warmup and "step_time_s" in r]
    return {"median_step_s": statistics.median(r["step_time_s"] for r in measured),
            "router_bytes_per_step": statistics.mean(r.get("router_bytes", 0) for r in measured),
            "steps_measured": len(measured)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeat", type=int, default=1, help="runs of every variant, interleaved; medians reported")
    p.add_argument("--variants", default=",".join(DEFAULT), help=f"of {', '.join(VARIANTS)}")
    p.add_argument("--out", default="outputs/bench/ray_overhead.json")
    p.add_argument("overrides", nargs="*", help="config overrides for every variant (key=value)")
    args = p.parse_args()
    names = args.variants.split(",")
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        p.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeat):
            for name in names:
                load = os.getloadavg()[0]
                r = summarize(run_variant(name, args.steps, args.overrides, Path(tmp)), args.warmup)
                runs[name].append({**r, "load_before": load, "load_after": os.getloadavg()[0]})
                print(f"[{rep + 1}/{args.repeat}] {name:>16}: {r['median_step_s']:.3f} s/step, router "
                      f"{r['router_bytes_per_step'] / 1e3:.1f} kB/step (load {load:.1f} -> "
                      f"{os.getloadavg()[0]:.1f})", flush=True)
    results = {name: {"median_step_s": statistics.median(r["median_step_s"] for r in rs),
                      "router_bytes_per_step": rs[0]["router_bytes_per_step"], "runs": rs}
               for name, rs in runs.items()}
    if "local" in results:
        for name, r in results.items():
            r["over_local"] = r["median_step_s"] / results["local"]["median_step_s"]
            print(f"{name:>16}: {r['median_step_s']:.3f} s/step, {r['over_local']:.2f}x the local backend")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
