"""Balancing each module group by its own cost vs by the language model's token counts.

Not a test: it prints figures. A skewed set (a few ~2k-patch images among many small
images and text-only samples) is planned for a vision group of ``--vision-dp`` replicas
and a text group of ``--text-dp`` replicas, two ways:

* old: every sample of a round goes to the vision replicas, split by text token counts
  (what the planner did before it was keyed by module);
* new: only the round's samples with images go to the vision replicas, split by the
  vision cost below; the text group splits by the text cost below.

It prints the imbalance (``StepPlan.imbalance``: sum over rounds of the busiest replica's
cost / sum over rounds of the mean replica cost; 1.0 is perfect) of both groups under a
FLOP cost model with the real Qwen2.5-VL-7B widths, then measures it: the tiny
Qwen2.5-VL vision encoder runs each vision replica's load of each round (random pixels,
forward only, one thread) and the same metric is taken over measured busy times.

    .venv/bin/python benchmarks/balance.py [--steps 20] [--measure-steps 20] [--big-patches 2048]

The cost models are the Qwen2.5-VL family's own: the forward part of its model FLOPs (``vision_flops``,
``text_flops`` in ``dhp/models/qwen2_5_vl/flops.py``), what ``Module.cost`` gives ``dhp train`` to balance
with and what MFU counts.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from dhp.data.sampler import BatchPlanner, StepPlan
from dhp.models.qwen2_5_vl.config import PRESETS, tiny
from dhp.models.qwen2_5_vl.flops import text_flops, vision_flops
from dhp.models.qwen2_5_vl.vision import VisionTransformer, init_weights

Grid = tuple[int, int, int]  # (t, h, w) in patches


# ---- the skewed set ---------------------------------------------------------------------------------------


def skewed_set(n: int, n_big: int, n_small: int, big_patches: int, seed: int) -> tuple[list[list[Grid]], list[int]]:
    """Per sample: its images' grids (one image or none) and its text token count (text + image tokens).

    ``n_big`` images of ``big_patches`` patches (a 2:1 grid, sides multiples of 2), ``n_small`` images of
    64-256 patches (even sides), the rest text-only; 40-400 text tokens each, plus ``patches / 4``
    image tokens (the 2x2 merge) for a sample with an image.
    """
    rng = random.Random(seed)
    side = max(2, int((big_patches / 2) ** 0.5) // 2 * 2)
    big = (1, side, 2 * side)
    small_shapes = [(1, h, w) for h in range(2, 33, 2) for w in range(2, 33, 2) if 64 <= h * w <= 256]
    grids: list[list[Grid]] = [[big] for _ in range(n_big)]
    grids += [[rng.choice(small_shapes)] for _ in range(n_small)]
    grids += [[] for _ in range(n - n_big - n_small)]
    rng.shuffle(grids)
    tokens = [rng.randint(40, 400) + sum(t * h * w for t, h, w in g) // 4 for g in grids]
    return grids, tokens


# ---- plans and measurement --------------------------------------------------------------------------------


def plans(costs: dict[str, list[float]], dp: dict[str, int], args: argparse.Namespace, steps: int) -> list[StepPlan]:
    planner = BatchPlanner(costs, dp, args.global_batch_size, args.micro_batch_size, seed=args.seed)
    return [planner.plan(s) for s in range(steps)]


def mean_imbalance(step_plans: list[StepPlan], module: str, cost: list[float]) -> float:
    """The imbalance over all the steps' rounds together (sum of busiest / sum of mean)."""
    whole = StepPlan(step=0, epoch=0, rounds=tuple(r for p in step_plans for r in p.rounds))
    return whole.imbalance({module: cost})[module]


def best_possible(step_plans: list[StepPlan], module: str, cost: list[float]) -> float:
    """A lower bound on the imbalance of any split of the same rounds: a round takes at least its
    largest sample (samples are not cut) and at least the mean."""
    busiest = ideal = 0.0
    for p in step_plans:
        for rnd in p.rounds:
            parts = rnd.replicas(module)
            loads = [cost[i] for part in parts for i in part]
            mean = sum(loads) / len(parts)
            busiest += max([mean, *loads])
            ideal += mean
    return busiest / ideal if ideal else 1.0


def measure(step_plans: list[StepPlan], grids: list[list[Grid]], model: VisionTransformer,
            repeats: int) -> tuple[float, float]:
    """Runs every vision replica's load of every round; returns (sum of per-round max, sum of per-round mean) s."""
    patch_dim = model.cfg.patch_dim
    busiest = ideal = 0.0
    g = torch.Generator().manual_seed(0)
    for plan in step_plans:
        for rnd in plan.rounds:
            times = []
            for part in rnd.replicas("vision"):
                images = [grid for i in part for grid in grids[i]]
                if not images:  # text-only samples (old plan) or an empty replica: nothing to encode
                    times.append(0.0)
                    continue
                grid_thw = torch.tensor(images, dtype=torch.long)
                pixels = torch.randn(int(grid_thw.prod(-1).sum()), patch_dim, generator=g)
                best = float("inf")
                with torch.no_grad():
                    for _ in range(repeats):
                        t0 = time.perf_counter()
                        model(pixels, grid_thw)
                        best = min(best, time.perf_counter() - t0)
                times.append(best)
            busiest += max(times)
            ideal += sum(times) / len(times)
    return busiest, ideal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=256)
    ap.add_argument("--big", type=int, default=6, help="images of --big-patches patches")
    ap.add_argument("--small", type=int, default=150, help="images of 64-256 patches")
    ap.add_argument("--big-patches", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20, help="steps for the cost-model figures")
    ap.add_argument("--measure-steps", type=int, default=20, help="steps run through the tiny encoder")
    ap.add_argument("--repeats", type=int, default=3, help="timed forwards per replica load (the fastest counts)")
    ap.add_argument("--global-batch-size", type=int, default=32)
    ap.add_argument("--micro-batch-size", type=int, default=4)
    ap.add_argument("--text-dp", type=int, default=2)
    ap.add_argument("--vision-dp", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one replica = one device: time each load alone, on one core

    grids, tokens = skewed_set(args.samples, args.big, args.small, args.big_patches, args.seed)
    real, small = PRESETS["7b"](), tiny()
    tok = [float(t) for t in tokens]
    v_real = [vision_flops(gs, real.vision)[0] for gs in grids]  # forward FLOPs: what the groups balance
    t_real = [text_flops([t], real.text)[0] for t in tokens]
    v_tiny = [vision_flops(gs, small.vision)[0] for gs in grids]
    dp = {"text": args.text_dp, "vision": args.vision_dp}
    n_big = sum(1 for gs in grids for t, h, w in gs if t * h * w == args.big_patches)
    big_shape = next((g for gs in grids for g in gs if g[0] * g[1] * g[2] == args.big_patches), None)
    print(f"set: {args.samples} samples, {n_big} images of {args.big_patches} patches (grid {big_shape}), "
          f"{args.small} of 64-256, {args.samples - args.big - args.small} text-only; "
          f"global batch {args.global_batch_size}, micro batch {args.micro_batch_size}, "
          f"text dp {args.text_dp}, vision dp {args.vision_dp}")

    # cost model, real widths: old = vision split of all round samples by tokens; new = own costs
    old = plans({"text": tok, "vision": tok}, dp, args, args.steps)
    new = plans({"text": t_real, "vision": v_real}, dp, args, args.steps)
    rows = [
        ("vision", "text tokens, all samples (old)", old, v_real),
        ("vision", "own cost, image samples (new)", new, v_real),
        ("text", "text tokens (old)", old, t_real),
        ("text", "own cost (new)", new, t_real),
    ]
    print(f"\ncost model, Qwen2.5-VL-7B widths, {args.steps} steps ({len(new[0].rounds)} rounds each); "
          "imbalance = sum(max replica cost) / sum(mean replica cost)")
    print(f"  {'group':<8}{'split by':<34}{'imbalance':>10}{'bound':>8}")
    for group, how, step_plans, cost in rows:
        print(f"  {group:<8}{how:<34}{mean_imbalance(step_plans, group, cost):>10.3f}"
              f"{best_possible(step_plans, group, cost):>8.3f}")
    print("  (bound: no split of the same rounds does better: a round takes at least its largest sample)")

    # measured: the tiny encoder on every vision replica's load
    cfg = small.vision
    torch.manual_seed(0)
    model = VisionTransformer(cfg).eval()
    init_weights(model, 0.02)
    with torch.no_grad():  # warm-up
        model(torch.randn(args.big_patches, cfg.patch_dim), torch.tensor([big_shape or (1, 2, 2)]))
    steps = args.measure_steps
    old_m = plans({"text": tok, "vision": tok}, dp, args, steps)
    new_m = plans({"text": tok, "vision": v_tiny}, dp, args, steps)
    t0 = time.perf_counter()
    old_busy, old_ideal = measure(old_m, grids, model, args.repeats)
    new_busy, new_ideal = measure(new_m, grids, model, args.repeats)
    took = time.perf_counter() - t0
    print(f"\nmeasured, tiny vision encoder (depth {cfg.depth}, width {cfg.hidden_size}, "
          f"{len(cfg.fullatt_block_indexes)} full-attention blocks), forward, 1 thread, {steps} steps "
          f"({len(new_m[0].rounds)} rounds each), fastest of {args.repeats}; {took:.1f} s")
    print(f"  {'vision split by':<34}{'model':>8}{'measured':>10}{'busiest s':>11}{'mean s':>9}")
    print(f"  {'text tokens, all samples (old)':<34}{mean_imbalance(old_m, 'vision', v_tiny):>8.3f}"
          f"{old_busy / old_ideal:>10.3f}{old_busy:>11.3f}{old_ideal:>9.3f}")
    print(f"  {'own cost, image samples (new)':<34}{mean_imbalance(new_m, 'vision', v_tiny):>8.3f}"
          f"{new_busy / new_ideal:>10.3f}{new_busy:>11.3f}{new_ideal:>9.3f}")
    print("  (busiest s: the vision group's busy time, sum over rounds of its slowest replica; "
          "mean s: the same with a perfect split)")


if __name__ == "__main__":
    main()
