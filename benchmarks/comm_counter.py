"""What the comm counter costs a training step: CPU time per step without a counter, with ``CommCounter``, and
with the same counting done by a ``TorchDispatchMode`` (how ``CommCounter`` was written until 2026-12-03).

Why: a dispatch mode sees every aten op of the forward and the backward, so every op passed through Python;
``dhp bench`` turns counting on (``runtime.count_collectives=true``), so every step it measured paid that.
``CommCounter`` now puts its Python kernel on the collective ops alone. This measures the three on the tiny demo
model in one process (the local backend's engines, each engine call wrapped in the counter exactly as a worker
wraps it), the modes taking turns step by step so that drift on a shared machine hits each.

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
from torch.utils._python_dispatch import TorchDispatchMode

from dhp.backends.local import LocalBackend
from dhp.config import load_config
from dhp.data.demo import make_demo_dataset
from dhp.data.sampler import BatchPlanner
from dhp.inputs import dataset_spec, module_costs, open_dataset, resolve_inputs
from dhp.parallel.comm import CommCounter

ENGINE_CALLS = ("forward", "backward", "forward_backward", "finish_gradients", "grad_norm_sq", "step")


class ModeCounter(TorchDispatchMode):
    """The same counting by a dispatch mode: every op enters ``__torch_dispatch__``, the collectives are counted."""

    def __init__(self) -> None:
        super().__init__()
        self.counter = CommCounter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.counter.record(func, args, kwargs)
        return func(*args, **kwargs)


COUNTERS = {"counted": CommCounter, "dispatch_mode": ModeCounter}


def counted(backend: LocalBackend, mode: str = "counted") -> None:
    """Wrap every engine call in a counter (``COUNTERS[mode]``), as ``EngineWorker`` does under
    ``runtime.count_collectives``."""
    for engine in backend.engines:
        for name in ENGINE_CALLS:
            bound = getattr(engine, name, None)  # the engine's own method: ``plain`` ran first
            if bound is None:
                continue

            def wrapper(*args, _bound=bound, **kwargs):
                with COUNTERS[mode]():
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
        modes = ("plain", "counted", "dispatch_mode")
        cpu: dict[str, list[float]] = {m: [] for m in modes}
        wall: dict[str, list[float]] = {m: [] for m in modes}
        step = 0
        for i in range(len(modes) * (args.steps + 1)):
            mode = modes[i % len(modes)]
            plain(backend)
            if mode != "plain":
                counted(backend, mode)
            plan = planner.plan(step)
            step += 1
            c0, w0 = time.process_time(), time.perf_counter()
            backend.run_step(plan)
            if i >= len(modes):  # one warm-up step per mode
                cpu[mode].append(time.process_time() - c0)
                wall[mode].append(time.perf_counter() - w0)
    result = {
        "machine": f"{torch.get_num_threads()} torch threads, torch {torch.__version__}",
        "steps_per_mode": args.steps,
        "cpu_s_per_step": {m: statistics.median(v) for m, v in cpu.items()},
        "wall_s_per_step": {m: statistics.median(v) for m, v in wall.items()},
    }
    for m in modes[1:]:
        result[f"cpu_ratio_{m}_to_plain"] = result["cpu_s_per_step"][m] / result["cpu_s_per_step"]["plain"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
