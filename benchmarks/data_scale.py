"""How a data set's start scales: index build (cold), cached start (warm), a worker's open, and peak memory.

Writes N samples (the demo set's rows repeated, its images reused: JSONL, or parquet with the images inline), then
runs each phase in a fresh process so that its peak RSS is its own:

* ``cold``: validation with an empty cache (the index built over ``data.index_workers`` processes, stored);
* ``warm``: the same command again (the index read back from the cache);
* ``plan``: a warm open plus the batch planner's costs of every sample (what the driver does before step 1), the
  first time (computed, then kept beside the index);
* ``replan``: the same again (the costs read back): a second start to the first step, less the imports;
* ``worker``: a worker's open (the driver's index mapped) and 256 samples read by id, pixels decoded.

    .venv/bin/python benchmarks/data_scale.py --samples 5000 50000 500000 [--format parquet] [--workers 2]

Prints a markdown table (seconds; peak RSS in MB: the process, and for ``cold`` its pool's largest worker).
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

PHASES = ("cold", "warm", "plan", "replan", "worker")
WORKER_READS = 256


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
        for start in range(0, n, 1000):
            batch = [next(cycle) for _ in range(min(1000, n - start))]
            cells = [[{"bytes": images[p], "path": p} for p in _paths(r)] for r in batch]
            writer.write_table(pa.table({"conversations": [r["conversations"] for r in batch], "images": cells},
                                        schema=schema), row_group_size=1000)
    return path


def _paths(row: dict) -> list[str]:
    image = row.get("image")
    return [] if image is None else [image] if isinstance(image, str) else list(image)


def phase(name: str, overrides: list[str]) -> dict:
    """One phase in this process (run as a child by ``main``): its time and peak RSS, as JSON on stdout."""
    from dhp.config import load_config
    from dhp.inputs import dataset_spec, make_planner, open_dataset, resolve_inputs

    cfg = load_config(None, overrides)
    inputs = resolve_inputs(cfg)
    t0 = time.perf_counter()
    spec = dataset_spec(inputs, inputs.train_path)
    ds = open_dataset(spec)
    out = {"open_s": time.perf_counter() - t0, "samples": len(ds)}
    if name in ("plan", "replan"):
        t1 = time.perf_counter()
        make_planner(inputs, ds)
        out["plan_s"] = time.perf_counter() - t1
    if name == "worker":
        from dataclasses import replace

        base = rss_mb()
        t1 = time.perf_counter()
        worker = open_dataset(replace(spec, index_dir=str(ds.index_dir)))
        del ds
        for i in range(0, len(worker), max(1, len(worker) // WORKER_READS)):
            worker.get(i)
        out["worker_s"] = time.perf_counter() - t1
        out["worker_growth_mb"] = rss_mb() - base
    out["rss_mb"] = rss_mb()
    out["pool_rss_mb"] = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return out


def rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--samples", type=int, nargs="+", default=[5000, 50000])
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    ap.add_argument("--workers", type=int, default=0, help="data.index_workers (0: one per CPU core)")
    ap.add_argument("--demo", type=Path, default=None, help="the demo set (default: the cached one, made if missing)")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args.phase, args.overrides)))
        return
    from dhp.data.demo import ensure_demo_dataset

    demo = args.demo or ensure_demo_dataset()
    print(f"| samples | format | cold: index built s | warm: index read s | warm + costs, first / kept s "
          f"| worker open + {WORKER_READS} reads s | peak RSS cold / warm / worker MB | worker growth MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory(prefix="dhp-data-scale-") as tmp:
        tmp_path = Path(tmp)
        env = {**os.environ, "DHP_CACHE": str(tmp_path / "cache")}
        for n in args.samples:
            path = write_data(demo, n, args.format, tmp_path)
            over = [f"data.path={path}", f"data.image_root={demo}", f"data.tokenizer={demo / 'tokenizer'}",
                    f"data.index_workers={args.workers}", "runtime.backend=local"]
            res = {}
            for name in PHASES:
                t0 = time.perf_counter()
                done = subprocess.run([sys.executable, __file__, "--phase", name, *over], env=env, check=True,
                                      capture_output=True, text=True)
                res[name] = {**json.loads(done.stdout.strip().splitlines()[-1]), "wall_s": time.perf_counter() - t0}
            cold, warm, plan, replan, worker = (res[p] for p in PHASES)
            print(f"| {n:,} | {args.format} | {cold['open_s']:.1f} | {warm['open_s']:.2f} | "
                  f"{plan['open_s'] + plan['plan_s']:.2f} / {replan['open_s'] + replan['plan_s']:.2f} | "
                  f"{worker['worker_s']:.1f} | "
                  f"{max(cold['rss_mb'], cold['pool_rss_mb']):.0f} / {warm['rss_mb']:.0f} / {worker['rss_mb']:.0f} | "
                  f"{worker['worker_growth_mb']:.0f} |", flush=True)
            path.unlink()


if __name__ == "__main__":
    main()
