"""`dhp train` on the Ray backend: end to end, failures that name module and rank, nothing left running."""

from __future__ import annotations

import json

import pytest
import ray

from dhp.cli import main
from dhp.config import load_config
from dhp.data.sampler import BatchPlanner
from dhp.inputs import dataset_spec, module_costs, open_dataset, resolve_inputs
from dhp.runtime import WorkerError


def _alive_dhp_actors() -> list[str]:
    """Live dhp actors, from the GCS actor table (the state API needs the dashboard)."""
    table = ray._private.state.actors().values()
    return sorted(a["Name"] for a in table if a["State"] == "ALIVE" and a["Name"].startswith("dhp-"))


def test_dhp_train_on_ray_disaggregated(ray_cluster, demo_overrides, tmp_path):
    rc = main(["train", *demo_overrides, "runtime.backend=ray", "runtime.placement=disaggregated",
               "runtime.cpus_per_worker=0.5", "vision.parallel.dp=2", "train.steps=2", "data.eval_samples=2"])
    assert rc == 0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        assert row["router_bytes"] > 0  # embeddings out and gradients back, worker to worker
        assert row["time_vision_forward_s"] > 0 and row["time_text_forward_backward_s"] > 0
        assert row["time_vision_backward_s"] > 0 and "time_text_idle_s" in row
        assert row["imbalance_vision"] >= 1.0 and row["imbalance_text"] == 1.0  # one text replica: balanced
    assert _alive_dhp_actors() == []


def test_worker_failure_names_module_and_rank_and_cleans_up(ray_cluster, demo_overrides):
    from dhp.backends.ray_backend import RayBackend

    cfg = load_config(None, demo_overrides + ["runtime.backend=ray", "runtime.cpus_per_worker=0.5",
                                              "vision.parallel.dp=2", "runtime.placement=disaggregated"])
    inputs = resolve_inputs(cfg)
    spec = dataset_spec(inputs, inputs.train_path)
    ds = open_dataset(spec)
    costs = module_costs(inputs.family, inputs.model_cfg, ds)
    plan = BatchPlanner(costs, {"vision": 2, "text": 1}, 8, 4).plan(0)
    backend = RayBackend(inputs, spec)
    victim = next(i for i in plan.sample_ids if ds.get(i, pixels=False).image_grid_thw.shape[0])
    image = ds._records[ds.source_index(victim)].images[0]
    saved = image.read_bytes()
    try:
        assert len(_alive_dhp_actors()) == 3
        image.write_bytes(b"not a png")  # breaks after the workers validated the data
        with pytest.raises(WorkerError) as err:
            backend.run_step(plan)
        message = str(err.value)
        assert err.value.module in ("vision", "text") and f"{err.value.module} rank {err.value.rank}" in message
        assert image.name in message and "sample" in message  # the worker's own DataError, with its traceback
        assert "File \"" in message
    finally:
        backend.shutdown()
        image.write_bytes(saved)
    assert _alive_dhp_actors() == []


def test_impossible_layouts_are_rejected_before_any_actor(ray_cluster, demo_overrides):
    assert main(["train", *demo_overrides, "runtime.backend=ray", "text.parallel.dp=3"]) == 2  # 8 % (4 x 3)
    assert main(["train", *demo_overrides, "runtime.backend=ray", "runtime.placement=disaggregated",
                 "vision.parallel.dp=4", "text.parallel.dp=2", "train.micro_batch_size=2"]) == 2  # 6 CPUs > 4
    assert _alive_dhp_actors() == []
