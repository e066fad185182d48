"""What the comm counter costs a training step: CPU time per step with and without ``CommCounter`` active.

Why: ``CommCounter`` is a ``TorchDispatchMode``; while it is on, every aten op of the forward and the backward
passes through Python. Ray workers used to keep it on around every call of every step; now only
``runtime.count_collectives=true`` (which ``dhp bench`` sets) turns it on. This measures the price it had, on
the tiny demo model in one process (the local backend's engines, each engine call wrapped in the counter exactly
as a worker wrapped it), alternating the two modes step by step so that drift on a shared machine hits both.

    python benchmarks/comm_counter.py [--steps 8] [--out outputs/bench/comm_counter.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dhp.backends.local import LocalBackend
from dhp.config import load_config
from dhp.data.demo import make_demo_dataset
from dhp.data.sampler import BatchPlanner
from dhp.inputs import dataset_spec, module_costs, open_dataset, resolve_inputs
from dhp.parallel.comm import CommCounter

ENGINE_CALLS = ("forward", "backward", "forward_backward", "finish_gradients", "grad_norm_sq", "step")


def counted(backend: LocalBackend) -> None:
    """Wrap every engine call in a ``CommCounter``, as ``EngineWorker`` did before ``runtime.count_collectives``."""
    for engine in backend.engines:
        for name in ENGINE_CALLS:
            bound = getattr(engine, name, None)
            if bound is None:
                continue

            def wrapper(*args, _bound=bound, **kwargs):
                with CommCounter():
                    return _bound(*args, **kwargs)

            setattr(engine, name, wrapper)


def plain(backend: LocalBackend) -> None:
    for engine in backend.engines:
        for name in ENGINE_CALLS:
            engine.__dict__.pop(name, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per mode (after one warm-up step each)")
    ap.add_argument("--out", type=Path, default=Path("outputs/bench/comm_counter.json"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = make_demo_dataset(Path(tmp) / "demo", seed=0, n_train=64, n_eval=8)
        cfg = load_config(None, [f"data.path={data.train}", f"data.tokenizer={data.tokenizer}",
                                 "data.max_pixels=12544", "train.global_batch_size=8", "train.micro_batch_size=4",
                                 "train.warmup_steps=1", f"output.dir={tmp}/run", "runtime.backend=local"])
        inputs = resolve_inputs(cfg)
        dataset = open_dataset(dataset_spec(inputs, inputs.train_path))
        backend = LocalBackend(inputs, dataset)
        costs = module_costs(inputs.family, inputs.model_cfg, dataset)
        planner = BatchPlanner(costs, {m: 1 for m in costs}, cfg.train.global_batch_size, cfg.train.micro_batch_size)
        cpu: dict[str, list[float]] = {"plain": [], "counted": []}
        wall: dict[str, list[float]] = {"plain": [], "counted": []}
        step = 0
        for i in range(2 * (args.steps + 1)):
            mode = ("plain", "counted")[i % 2]
            (plain if mode == "plain" else counted)(backend)
            plan = planner.plan(step)
            step += 1
            c0, w0 = time.process_time(), time.perf_counter()
            backend.run_step(plan)
            if i >= 2:  # one warm-up step per mode
                cpu[mode].append(time.process_time() - c0)
                wall[mode].append(time.perf_counter() - w0)
    result = {
        "machine": f"{torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "steps_per_mode": args.steps,
        "cpu_s_per_step": {m: statistics.median(v) for m, v in cpu.items()},
        "wall_s_per_step": {m: statistics.median(v) for m, v in wall.items()},
    }
    result["cpu_ratio_counted_to_plain"] = result["cpu_s_per_step"]["counted"] / result["cpu_s_per_step"]["plain"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
