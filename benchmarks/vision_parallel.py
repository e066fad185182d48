"""Vision encoder under Ulysses SP vs tensor parallelism: activation memory per rank, and bytes communicated.

Not a test: it prints figures and writes them to ``outputs/bench/vision_parallel.json``.

* Activation memory of one vision rank for sp = 1, 2, 4 on one long image (``--patches``,
  default 16,384 = 128 x 128 patches) at the tiny width: the bytes of the tensors autograd
  keeps for backward (``saved_tensors_hooks``, each storage counted once) during one forward —
  what sequence parallelism divides; on CPU there is no allocator peak to read.
* Bytes every collective moved (``CommCounter``, forward + backward, all ranks) for the same
  batch under sp=2 and tp=2. Only the full-attention blocks talk under SP; every block talks
  twice per pass under TP.

    python benchmarks/vision_parallel.py [--patches 16384] [--depth 4]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from dhp.models.qwen2_5_vl.config import tiny
from dhp.models.qwen2_5_vl.vision import VisionTransformer, init_weights, vision_layout
from dhp.parallel.comm import CommCounter
from dhp.parallel.tensor import local_tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for the test harness
from tests.spawn import run_distributed  # noqa: E402


def build(depth: int) -> VisionTransformer:
    cfg = tiny().vision
    cfg = replace(cfg, depth=depth, fullatt_block_indexes=tuple(i for i in range(depth) if i % 4 == 3))
    torch.manual_seed(0)
    model = VisionTransformer(cfg)
    init_weights(model, 0.02)
    return model


def inputs(patches: int, model: VisionTransformer) -> tuple[torch.Tensor, torch.Tensor]:
    side = int(math.isqrt(patches)) // 2 * 2  # a square image, even sides (2x2 merge)
    grid = torch.tensor([[1, side, side]])
    g = torch.Generator().manual_seed(0)
    return torch.randn(side * side, model.cfg.patch_dim, generator=g), grid


class SavedBytes:
    """Bytes autograd saves for backward, each storage once; parameters (not activations) left out."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = {local_tensor(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        local = local_tensor(t)
        key = local.untyped_storage().data_ptr()
        if key not in self.seen and key not in self.params:
            self.seen.add(key)
            self.bytes += local.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def rank_run(rank: int, world: int, mode: str, patches: int, depth: int) -> dict:
    model = build(depth)
    pixels, grid = inputs(patches, model)
    saved = SavedBytes(model)
    comm = CommCounter()
    t0 = time.perf_counter()
    if mode == "sp":
        from dhp.models.qwen2_5_vl.sequence_parallel import parallelize_vision_sp, shard_vision, sp_forward

        parallelize_vision_sp(model, dist.group.WORLD)
        shard = shard_vision(vision_layout(grid, model.cfg), world)[rank]
        with comm, saved.hooks():
            out = sp_forward(model, pixels, shard, dist.group.WORLD)
        local_patches = shard.num_patches
    else:
        from torch.distributed.device_mesh import init_device_mesh

        from dhp.models.qwen2_5_vl.parallelize import parallelize_vision_tp

        parallelize_vision_tp(model, init_device_mesh("cpu", (world,)))
        with comm, saved.hooks():
            out = model(pixels, grid)
        local_patches = pixels.shape[0]
    forward_s = time.perf_counter() - t0
    with comm:
        out.float().square().mean().backward()
    return {"mode": mode, "ranks": world, "rank": rank, "local_patches": local_patches,
            "saved_activation_bytes": saved.bytes, "comm_bytes": comm.snapshot(), "comm_calls": dict(comm.calls),
            "forward_s": forward_s}


def single_run(patches: int, depth: int) -> dict:
    model = build(depth)
    pixels, grid = inputs(patches, model)
    saved = SavedBytes(model)
    with saved.hooks():
        model(pixels, grid)
    return {"mode": "sp", "ranks": 1, "rank": 0, "local_patches": pixels.shape[0],
            "saved_activation_bytes": saved.bytes, "comm_bytes": {}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--patches", type=int, default=16384)
    p.add_argument("--depth", type=int, default=8, help="vision blocks (every 4th is full attention)")
    p.add_argument("--out", default="outputs/bench/vision_parallel.json")
    args = p.parse_args()
    rows = [single_run(args.patches, args.depth)]
    for sp in (2, 4):
        rows += run_distributed(rank_run, sp, "sp", args.patches, args.depth, timeout_s=1800)
    rows += run_distributed(rank_run, 2, "tp", args.patches, args.depth, timeout_s=1800)
    base = rows[0]["saved_activation_bytes"]
    print(f"vision encoder, tiny width, depth {args.depth}, one image of {rows[0]['local_patches']} patches")
    print(f"{'layout':<8} {'rank':>4} {'patches':>8} {'activations MB':>15} {'vs sp=1':>8} {'comm MB (fwd+bwd)':>18}")
    for r in rows:
        mb = r["saved_activation_bytes"] / 2**20
        comm = sum(r["comm_bytes"].values()) / 2**20
        print(f"{r['mode']}={r['ranks']:<5} {r['rank']:>4} {r['local_patches']:>8} {mb:>15.1f} "
              f"{r['saved_activation_bytes'] / base:>8.2f} {comm:>18.1f}")
    for mode in ("sp", "tp"):
        total = sum(sum(r["comm_bytes"].values()) for r in rows if r["mode"] == mode and r["ranks"] == 2)
        print(f"all ranks, {mode}=2: {total / 2**20:.1f} MB communicated by the vision encoder (fwd + bwd)")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
