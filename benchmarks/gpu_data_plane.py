"""GPU part of the data plane's proof (issue 21): CUDA IPC against a host round trip, and a collocated run.

Prepared on a CPU machine, to be run where a GPU is lent (nothing here runs without CUDA):

1. ``ipc``: the collocated data plane's own code (``dhp.runtime.data_plane.share_cuda``/``open_cuda``)
   between two processes on one GPU, against the path the object store takes (device to host, pickled bytes
   through a pipe, host to device), in GB/s per size. With Ray importable, also Ray's object store between
   two actors holding half a GPU each (what ``runtime.transport=object_store`` does collocated).
2. ``train``: a collocated vision 1 + text 1 ``dhp train`` on one GPU (two Ray actors at 0.5 GPU each, the
   data plane ``cuda_ipc``, bfloat16): median step time, MFU per group and peak memory per group, from its
   metrics.jsonl. Needs Ray on the GPU machine (``../shared/FACTS.md``: ``pack-ray.sh``/``unpack-ray.py``).

    python benchmarks/gpu_data_plane.py [--checks ipc,train] [--sizes-mb 16,256,1024] [--steps 12]
                                        [--out outputs/bench/gpu_data_plane.json] [key=value ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

from dhp.runtime.data_plane import open_cuda, share_cuda

REPEATS = 5


def _consumer(q_in, q_out) -> None:
    """The receiving process: opens each message (IPC handles or host bytes) onto the GPU, says when done."""
    torch.cuda.set_device(0)
    while True:
        kind, payload = q_in.get()
        if kind == "stop":
            return
        t = open_cuda(payload) if kind == "ipc" else torch.frombuffer(bytearray(payload), dtype=torch.uint8).cuda()
        torch.cuda.synchronize()
        q_out.put(int(t.numel()))
        del t


def ipc_against_host(sizes_mb: list[int]) -> dict:
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_consumer, args=(q_in, q_out))
    proc.start()
    out = {}
    try:
        for mb in sizes_mb:
            t = torch.randint(0, 255, (mb * 2**20,), dtype=torch.uint8, device="cuda")
            row = {}
            for kind in ("ipc", "host"):
                times = []
                for _ in range(REPEATS + 1):  # the first is a warm-up
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    payload = share_cuda(t) if kind == "ipc" else t.cpu().numpy().tobytes()  # pickled by the queue
                    q_in.put((kind, payload))
                    assert q_out.get(timeout=120) == t.numel()
                    times.append(time.perf_counter() - t0)
                sec = statistics.median(times[1:])
                row[kind] = {"s": sec, "GB_per_s": t.numel() / sec / 1e9}
            out[f"{mb}MB"] = row
            print(f"{mb:>6} MB: cuda_ipc {row['ipc']['GB_per_s']:.2f} GB/s, host round trip "
                  f"{row['host']['GB_per_s']:.2f} GB/s", flush=True)
    finally:
        q_in.put(("stop", None))
        proc.join(timeout=60)
    return out


def ray_object_store(sizes_mb: list[int]) -> dict | None:
    try:
        import ray
    except ImportError:
        print("ray is not importable here: the object-store figure is left out", flush=True)
        return None

    @ray.remote(num_gpus=0.5)
    class Holder:
        def make(self, n: int):
            return torch.ones(n, dtype=torch.uint8, device="cuda")

        def take(self, t) -> int:
            t = t.cuda()
            torch.cuda.synchronize()
            return int(t.numel())

    ray.init(num_gpus=1, include_dashboard=False)
    try:
        a, b = Holder.remote(), Holder.remote()
        out = {}
        for mb in sizes_mb:
            n = mb * 2**20
            times = []
            for _ in range(REPEATS + 1):
                ref = a.make.remote(n)
                ray.wait([ref])
                t0 = time.perf_counter()
                assert ray.get(b.take.remote(ref)) == n
                times.append(time.perf_counter() - t0)
            sec = statistics.median(times[1:])
            out[f"{mb}MB"] = {"s": sec, "GB_per_s": n / sec / 1e9}
            print(f"{mb:>6} MB: Ray object store {out[f'{mb}MB']['GB_per_s']:.2f} GB/s", flush=True)
        return out
    finally:
        ray.shutdown()


def collocated_train(steps: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "dhp.cli", "train", "runtime.backend=ray", "runtime.placement=collocated",
               "runtime.gpus_per_worker=0.5", "runtime.cpus_per_worker=1", "train.dtype=bfloat16",
               f"train.steps={steps}", "train.log_every=1", f"output.dir={tmp}/run", "output.save_final=false",
               "train.eval_at_end=false", "train.resume=none", *overrides]
        subprocess.run(cmd, check=True)
        rows = [json.loads(line) for line in Path(tmp, "run", "metrics.jsonl").read_text().splitlines() if line]
    measured = [r for r in rows if r.get("step", 0) > 2] or rows
    keys = sorted({k for r in measured for k in r if k.startswith(("mfu_", "memory_gb_", "time_", "router_"))})
    out = {"median_step_s": statistics.median(r["step_time_s"] for r in measured),
           **{k: max(r.get(k, 0.0) for r in measured) if k.startswith("memory_gb_")
              else statistics.mean(r.get(k, 0.0) for r in measured) for k in keys}}
    print(json.dumps(out, indent=2), flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checks", default="ipc,train")
    p.add_argument("--sizes-mb", default="16,256,1024")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--out", default="outputs/bench/gpu_data_plane.json")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_data_plane.py needs a CUDA device")
    sizes = [int(x) for x in args.sizes_mb.split(",")]
    checks = set(args.checks.split(","))
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if "ipc" in checks:
        results["ipc_vs_host"] = ipc_against_host(sizes)
        results["ray_object_store"] = ray_object_store(sizes)
    if "train" in checks:
        results["collocated_train"] = collocated_train(args.steps, args.overrides)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
