"""`dhp train` on the Ray backend: end to end, failures that name module and rank, nothing left running."""

from __future__ import annotations

import json

import pytest
import ray

from dhp.cli import main
from dhp.config import load_config
from dhp.data.sampler import BatchPlanner
from dhp.inputs import dataset_spec, module_costs, open_dataset, resolve_inputs
from dhp.runtime import Broadcast, WorkerError


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


def _recording(monkeypatch) -> list[tuple[str, str, str, int]]:
    """The driver's calls as it makes them: (submit | wait, group, kind, round), one entry per call (not per
    rank); a prefetch is a ``load``. Waits inside ``get_watching`` on the watched calls are not the driver's."""
    from dhp.backends import ray_backend
    from dhp.runtime.worker_group import WorkerGroup

    log: list[tuple[str, str, str, int]] = []
    calls: dict = {}
    watching: list[set] = []
    submit, submit_rank, gather, wait_tensors = (WorkerGroup.submit, WorkerGroup.submit_rank, WorkerGroup._gather,
                                                 WorkerGroup.wait_tensors)
    get_watching = ray_backend.get_watching

    def call_of(module: str, method: str, args: tuple) -> tuple[str, str, int]:
        first = args[0].value if args and isinstance(args[0], Broadcast) else args[0] if args else None
        return module, "load" if method == "prefetch" else method, first if type(first) is int else -1

    def submitted(group, method, args, refs):
        if method != "arm_gradient_reduction":
            for ref in refs:
                calls[ref] = call_of(group.module, method, args)
            log.append(("submit", *call_of(group.module, method, args)))

    def waited(refs):
        if not watching or set(refs) <= watching[-1]:
            log.extend(("wait", *c) for c in dict.fromkeys(calls[r] for r in refs if r in calls))

    def rec_submit(self, method, *args, **kwargs):
        refs = submit(self, method, *args, **kwargs)
        submitted(self, method, args, refs)
        return refs

    def rec_submit_rank(self, rank, method, *args, **kwargs):
        ref = submit_rank(self, rank, method, *args, **kwargs)
        submitted(self, method, args, [ref])
        return ref

    def rec_gather(self, method, refs, ranks=None, timeout_s=None):
        waited(refs)
        return gather(self, method, refs, ranks, timeout_s)

    def rec_wait_tensors(self, method, refs, ranks):
        waited(refs)
        return wait_tensors(self, method, refs, ranks)

    def rec_get_watching(target, watched):
        watching.append(set(target.refs))
        try:
            return get_watching(target, watched)
        finally:
            watching.pop()

    monkeypatch.setattr(WorkerGroup, "submit", rec_submit)
    monkeypatch.setattr(WorkerGroup, "submit_rank", rec_submit_rank)
    monkeypatch.setattr(WorkerGroup, "_gather", rec_gather)
    monkeypatch.setattr(WorkerGroup, "wait_tensors", rec_wait_tensors)
    monkeypatch.setattr(ray_backend, "get_watching", rec_get_watching)
    return log


def _ray_backend(demo_overrides: list[str], layout: list[str]) -> tuple:
    """(a RayBackend of the demo set on ``layout``, the trainer's batch planner for its replicas)."""
    from dhp.backends.ray_backend import RayBackend

    cfg = load_config(None, demo_overrides + ["runtime.backend=ray", "runtime.cpus_per_worker=0.5", *layout])
    inputs = resolve_inputs(cfg)
    spec = dataset_spec(inputs, inputs.train_path)
    costs = module_costs(inputs.family, inputs.model_cfg, open_dataset(spec))
    replicas = {m: cfg.module(m).parallel.dp for m in inputs.family.module_names}
    planner = BatchPlanner(costs, replicas, cfg.train.global_batch_size, cfg.train.micro_batch_size)
    return RayBackend(inputs, spec), planner


def _once(entries):
    """Consecutive repeats dropped (a call submitted to each rank, a wait on several of its ranks)."""
    return [e for i, e in enumerate(entries) if i == 0 or entries[i - 1] != e]


@pytest.mark.parametrize("placement", ["disaggregated", "collocated"])
def test_the_drivers_calls_are_the_planners_script(ray_cluster, demo_overrides, monkeypatch, placement):
    """One schedule definition for the runtime and the planner: a real step's submissions and waits, in the
    driver's order, are ``dhp.plan.schedule.driver_script``'s (the p2p plane with encoders 1 and 0 rounds ahead,
    disaggregated; the object-store router, collocated, with its emits), loads included (the step's first two
    rounds are the step before's: the script's carried loads, the driver's first prefetches)."""
    from dhp.plan.schedule import driver_script

    backend, planner = _ray_backend(demo_overrides, [f"runtime.placement={placement}", "vision.parallel.sp=2",
                                                     "text.parallel.tp=2", "train.micro_batch_size=2"])
    try:
        for step, ahead in enumerate([1, 0] if placement == "disaggregated" else [backend.ahead]):
            backend.ahead = ahead
            plan = planner.plan(step)
            assert len(plan.rounds) == 4
            log = _recording(monkeypatch)
            backend.run_step(plan, planner.plan(step + 1))
            monkeypatch.undo()
            first = next(i for i, e in enumerate(log) if e[2] == "forward")
            ran = _once([e for i, e in enumerate(log) if i >= first or e[2] != "load"])
            script = _once([(a.op, c.group, c.kind, c.round) for a in driver_script(
                len(plan.rounds), backend.encoders, backend.lang, plan.window, ahead, backend.trains,
                backend.data_plane, loads=True) for c in a.calls if c.source != "carried"])
            assert backend.data_plane == ("p2p" if placement == "disaggregated" else "ray")
            assert ran == script, f"ahead {ahead}"
    finally:
        backend.shutdown()


def test_impossible_layouts_are_rejected_before_any_actor(ray_cluster, demo_overrides):
    assert main(["train", *demo_overrides, "runtime.backend=ray", "text.parallel.dp=3"]) == 2  # 8 % (4 x 3)
    assert main(["train", *demo_overrides, "runtime.backend=ray", "runtime.placement=disaggregated",
                 "vision.parallel.dp=4", "text.parallel.dp=2", "train.micro_batch_size=2"]) == 2  # 6 CPUs > 4
    assert _alive_dhp_actors() == []


def test_workers_freeze_startups_objects_and_collect_on_the_steps_schedule(ray_cluster, demo_overrides):
    """``runtime.gc_every_steps=2``: every rank of every group froze start-up's objects (Python's collections never
    walk them again), collects on its own no more, and ran a collection at the end of step 2, not step 1."""
    backend, planner = _ray_backend(demo_overrides, ["runtime.placement=disaggregated", "vision.parallel.dp=2",
                                                     "runtime.gc_every_steps=2"])
    try:
        def states() -> list[dict]:
            return [s for m in backend.modules for s in backend.group(m).gc_state.submit().get()]

        started = states()
        assert len(started) == 3 and all(s["steps"] == 0 and not s["automatic"] for s in started)
        assert all(s["frozen_objects"] > 10_000 for s in started)  # torch, Ray and the model: frozen at init
        backend.run_step(planner.plan(0), planner.plan(1))
        first = states()  # the first step's objects frozen too (a collection of the unfrozen ones only)
        assert all(s["steps"] == 1 and s["collect_s"] > a["collect_s"] for s, a in zip(first, started, strict=True))
        assert all(s["frozen_objects"] > 10_000 for s in first)
        backend.run_step(planner.plan(1), planner.plan(2))
        second = states()  # step 2 of every 2: collected, nothing more frozen (frozen objects freed since: fewer)
        assert all(s["steps"] == 2 and s["collect_s"] > a["collect_s"] for s, a in zip(second, first, strict=True))
        assert all(s["frozen_objects"] <= a["frozen_objects"] for s, a in zip(second, first, strict=True))
    finally:
        backend.shutdown()
