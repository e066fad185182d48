"""How a data set's start scales: index build (cold), cached start (warm), the start to the first step, a worker.

Writes N samples (the demo set's rows repeated, its images reused: JSONL, or parquet with the images inline), then
runs each phase in a fresh process so that its memory is its own:

* ``cold``: validation with an empty cache (the index built over ``data.index_workers`` processes, stored);
* ``warm``: the same open again (the index read back from the cache);
* ``plan``: a warm open plus the batch planner's costs and the per-sample FLOPs (MFU) of every sample, the first
  time (computed, then kept beside the index: what a cold start does after its index is built);
* ``start``: what ``dhp train`` does before step 1 on a second start, imports aside: ``dhp.train.Run`` (the data
  opened from its index, the costs read back, the planner, the per-sample FLOPs, the data's fingerprint) and the
  first step's plan (``Run._plan(0)``: the epoch's order, the step balanced, its media read through under
  ``data.validate=lazy``); the groups' start is left out (it does not depend on the data);
* ``worker``: a worker's open of the driver's index and 256 samples spread over the data set read by id, pixels
  decoded, in a process that holds the imports only.

    .venv/bin/python benchmarks/data_scale.py --samples 5000 50000 1000000 [--format parquet] [--workers 0]

Prints a markdown table (seconds; memory in MB; the driver's peak is its ``VmHWM``). A worker's growth is split as
Linux counts it (``/proc/self/status``): ``RssAnon``, its private memory (what must not grow with the data set),
and ``RssFile``, the pages of mapped files it touched (the index's columns, the data file, libraries: shared page
cache, one copy per node).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PHASES = ("cold", "warm", "plan", "start", "worker")
WORKER_READS = 256
ROW_GROUP = 1000  # rows per parquet row group


def write_data(demo: Path, n: int, fmt: str, out: Path) -> Path:
    rows = [json.loads(line) for line in (demo / "train.jsonl").read_text().splitlines()]
    if fmt == "jsonl":
        path = out / f"train_{n}.jsonl"
        with path.open("w") as f:
            for row in itertools.islice(itertools.cycle(rows), n):
                f.write(json.dumps(row) + "\n")
        return path
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = {p: (demo / p).read_bytes() for row in rows for p in _paths(row)}
    path = out / f"train_{n}.parquet"
    schema = pa.schema([("conversations", pa.list_(pa.struct([("from", pa.string()), ("value", pa.string())]))),
                        ("images", pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())])))])
    with pq.ParquetWriter(str(path), schema) as writer:
        cycle = itertools.cycle(rows)
        for start in range(0, n, ROW_GROUP):
            batch = [next(cycle) for _ in range(min(ROW_GROUP, n - start))]
            cells = [[{"bytes": images[p], "path": p} for p in _paths(r)] for r in batch]
            writer.write_table(pa.table({"conversations": [r["conversations"] for r in batch], "images": cells},
                                        schema=schema), row_group_size=ROW_GROUP)
    return path


def _paths(row: dict) -> list[str]:
    image = row.get("image")
    return [] if image is None else [image] if isinstance(image, str) else list(image)


def memory() -> dict[str, float]:
    """This process's memory in MB: peak (``VmHWM``), private (``RssAnon``) and mapped files' (``RssFile``)."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) / 1024
    return {"peak_mb": fields["VmHWM"], "anon_mb": fields["RssAnon"], "file_mb": fields["RssFile"]}


def phase(name: str, overrides: list[str]) -> dict:
    """One phase in this process (run as a child by ``main``): its times and memory, as JSON on stdout."""
    from dhp.config import load_config
    from dhp.inputs import dataset_spec, make_planner, open_dataset, resolve_inputs

    cfg = load_config(None, overrides)
    if name == "start":
        return start_phase(cfg)
    inputs = resolve_inputs(cfg)
    spec = dataset_spec(inputs, inputs.train_path)
    if name == "worker":
        return worker_phase(spec, os.environ["DHP_SCALE_INDEX"])
    t0 = time.perf_counter()
    ds = open_dataset(spec)
    out = {"open_s": time.perf_counter() - t0, "samples": len(ds), "index_dir": str(ds.index_dir)}
    if name == "plan":
        from dhp.engine import encoder_trains
        from dhp.inputs import sample_flops

        t1 = time.perf_counter()
        make_planner(inputs, ds)
        trains = {e.name: encoder_trains(cfg, e) for e in inputs.family.encoders}
        sample_flops(inputs.family, inputs.model_cfg, ds, trains)
        out["plan_s"] = time.perf_counter() - t1
    # (the pool's largest worker, as getrusage has it; not shown: a spawned child's peak starts from its parent's
    # RSS at the fork)
    return {**out, **memory(), "pool_peak_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}


def start_phase(cfg) -> dict:  # noqa: ANN001 - a dhp Config
    """A second ``dhp train``'s driver up to its first step's plan (``Run``'s constructor, then ``Run._plan(0)``)."""
    import dhp.train as train
    from dhp.data.lazy import LazyPlanner

    t0 = time.perf_counter()
    run = train.Run(cfg, train.location(cfg.output.dir))
    t1 = time.perf_counter()
    run._plan(0)
    t2 = time.perf_counter()
    if isinstance(run.planner, LazyPlanner):
        run.planner.close()
    return {"run_s": t1 - t0, "first_plan_s": t2 - t1, "start_s": t2 - t0, **memory()}


def worker_phase(spec, index_dir: str) -> dict:  # noqa: ANN001 - a DatasetSpec
    """A worker's open of the driver's index and ``WORKER_READS`` samples read, against the imports alone."""
    from dataclasses import replace

    import PIL.PngImagePlugin  # noqa: F401 - the decode's own import, before the base
    import pyarrow.parquet  # noqa: F401

    from dhp.inputs import open_dataset

    base = memory()
    t0 = time.perf_counter()
    worker = open_dataset(replace(spec, index_dir=index_dir))
    t1 = time.perf_counter()
    for j in range(WORKER_READS):
        worker.get(j * len(worker) // WORKER_READS)
    t2 = time.perf_counter()
    now = memory()
    return {"open_s": t1 - t0, "reads_s": t2 - t1, **now,
            "growth_peak_mb": now["peak_mb"] - base["peak_mb"], "growth_anon_mb": now["anon_mb"] - base["anon_mb"],
            "growth_file_mb": now["file_mb"] - base["file_mb"]}


def run_phase(name: str, overrides: list[str], env: dict[str, str]) -> dict:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--phase", name, *overrides], env=env, capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(f"phase {name} failed:\n{done.stderr[-4000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t0}


HEADER = ("| samples | format | cold: index built s | warm: index read s | warm + costs, FLOPs computed s "
          "| start to step 1 s (Run / first plan) | worker open / 256 reads s | driver peak MB: cold / warm / start "
          "| worker growth MB: anon / file (peak) |")


def row(n: int, fmt: str, res: dict[str, dict]) -> str:
    cold, warm, plan, start, worker = (res[p] for p in PHASES)
    return (f"| {n:,} | {fmt} | {cold['open_s']:.1f} | {warm['open_s']:.2f} | {plan['open_s'] + plan['plan_s']:.1f} "
            f"| {start['start_s']:.1f} ({start['run_s']:.1f} / {start['first_plan_s']:.2f}) "
            f"| {worker['open_s']:.2f} / {worker['reads_s']:.1f} "
            f"| {cold['peak_mb']:.0f} / {warm['peak_mb']:.0f} / {start['peak_mb']:.0f} "
            f"| {worker['growth_anon_mb']:.1f} / {worker['growth_file_mb']:.1f} ({worker['growth_peak_mb']:.1f}) |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[5000, 50000])
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    ap.add_argument("--workers", type=int, default=0, help="data.index_workers (0: one per CPU core)")
    ap.add_argument("--demo", type=Path, default=None, help="the demo set (default: the cached one, made if missing)")
    ap.add_argument("--json", type=Path, default=None, help="also write every phase's figures to this file")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.overrides)))
        return
    from dhp.data.demo import ensure_demo_dataset

    demo = args.demo or ensure_demo_dataset()
    print(HEADER)
    print("| --- " * HEADER.count(" | ") + "| --- |")
    results = []
    with tempfile.TemporaryDirectory(prefix="dhp-data-scale-") as tmp:
        tmp_path = Path(tmp)
        env = {**os.environ, "DHP_CACHE": str(tmp_path / "cache")}
        for n in args.samples:
            path = write_data(demo, n, args.format, tmp_path)
            over = [f"data.path={path}", f"data.image_root={demo}", f"data.tokenizer={demo / 'tokenizer'}",
                    f"data.index_workers={args.workers}", "runtime.backend=local",
                    f"output.dir={tmp_path / f'run_{n}'}"]
            res: dict[str, dict] = {}
            for name in PHASES:
                res[name] = run_phase(name, over, env)
                env["DHP_SCALE_INDEX"] = res["cold"]["index_dir"]
            print(row(n, args.format, res), flush=True)
            results.append({"samples": n, "format": args.format, "file_mb": path.stat().st_size / 2**20, **res})
            path.unlink()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
