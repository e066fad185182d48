"""Moving a tensor from a vision actor to a text actor: Ray Direct Transport (gloo) vs the object store.

Why: the router moves embeddings and their gradients between the module groups
every micro-batch, so its cost decides whether disaggregation pays. This
measures both transports through the real runtime (``dhp.runtime``), not a
hand-made pair of actors. Per size and transport: the median wall time of
produce -> transfer -> consume, and a baseline where the producing actor also
consumes (no transfer); ``transfer_s`` is the difference.

    python benchmarks/transfer.py [--sizes-mb 1 20] [--repeats 10] [--out outputs/bench/transfer.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import ray
import torch

from dhp.runtime import GroupSpec, Mode, Runtime, WorkerBase, dispatch, produces_tensors


class BenchWorker(WorkerBase):
    """Produces float32 tensors of a given size and consumes them."""

    def __init__(self) -> None:
        self.cache: dict[int, torch.Tensor] = {}

    def _tensor(self, numel: int) -> torch.Tensor:
        if numel not in self.cache:
            self.cache[numel] = torch.randn(numel)
        return self.cache[numel].clone()

    @produces_tensors
    def produce(self, numel: int) -> torch.Tensor:
        return self._tensor(numel)

    def consume(self, t: torch.Tensor) -> float:
        return float(t[-1])

    @dispatch(Mode.RANK_ZERO)
    def local(self, numel: int) -> float:
        return self.consume(self._tensor(numel))


def _median_s(fn, repeats: int) -> float:
    fn()  # warm-up: first use of a size/transport sets up buffers and connections
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(rt: Runtime, size_mb: float, transport: str | None, repeats: int) -> float:
    vision, text = rt["vision"], rt["text"]
    numel = int(size_mb * 2**20) // 4
    vision.tensor_transport = transport

    def once() -> None:
        ref = vision.submit_rank(0, "produce", numel)
        text.get("consume", [text.submit_rank(0, "consume", ref)])

    return _median_s(once, repeats)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", type=float, nargs="+", default=[1.0, 20.0])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", default="outputs/bench/transfer.json")
    args = ap.parse_args(argv)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    spec = {"vision": GroupSpec(BenchWorker, 1), "text": GroupSpec(BenchWorker, 1)}
    rows = []
    try:
        with Runtime(spec, placement="disaggregated", transport="direct", cpus_per_worker=1.0) as rt:
            for size in args.sizes_mb:
                numel = int(size * 2**20) // 4
                base = _median_s(lambda n=numel: rt["vision"].call("local", n), args.repeats)
                for name, transport in (("direct (RDT gloo)", "GLOO"), ("object_store", None)):
                    total = measure(rt, size, transport, args.repeats)
                    rows.append({"size_mb": size, "transport": name, "total_s": total, "baseline_s": base,
                                 "transfer_s": max(0.0, total - base), "repeats": args.repeats})
    finally:
        ray.shutdown()
    _report(rows, Path(args.out))


def _report(rows: list[dict], out: Path) -> None:
    print(f"{'size MB':>8} {'transport':<18} {'total s':>9} {'baseline s':>10} {'transfer s':>10} {'GB/s':>6}")
    for r in rows:
        rate = r["size_mb"] / 1024 / r["transfer_s"] if r["transfer_s"] > 0 else float("inf")
        print(f"{r['size_mb']:>8g} {r['transport']:<18} {r['total_s']:>9.4f} {r['baseline_s']:>10.4f} "
              f"{r['transfer_s']:>10.4f} {rate:>6.2f}")
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "ray": ray.__version__, "unit": "seconds, median"}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
