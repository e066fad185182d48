"""`dhp bench` on CPU: the three default layouts in one command; the vision communication ratio SP/TP equals
its closed form."""

from __future__ import annotations

import json

import pytest
import torch

from dhp.cli import main
from dhp.config import load_config
from dhp.inputs import prepare
from dhp.models.registry import get_family
from dhp.observe.trace import read_trace
from dhp.plan.calibrate import calibrate


def vision_comm_closed_form(patches: int, params: int, model_cfg, sp: int, tp: int) -> tuple[int, int]:
    """Bytes the vision group hands to collectives in one step (all ranks, float32, CommCounter's payload bytes).

    Ulysses SP (dp 1): per full-attention block, forward sends q, k, v seq->heads (``3 S_r C`` per rank) and the
    output heads->seq (``S C / sp``), backward the adjoints (``S_r C`` and ``3 S C / sp``): ``8 S C`` over the
    ranks, whatever sp; then every SP rank all-reduces the gradients of the whole encoder (``sp * params``).
    (``dhp.parallel.ulysses.expected_alltoall_bytes`` is the ``sent`` counterpart: the payload less what a rank
    keeps.)

    TP: every block all-reduces [S, C] twice in forward (attention proj, MLP down: row-parallel) and twice in
    backward (the input gradients of the fused qkv, and of gate and up together: the MLP's input is one
    Replicate DTensor, so its two partial gradients are summed before one reduction), on each of the tp ranks;
    plus one float64 all-reduce of the squared gradient norm per rank. No gradient all-reduce (one replica)."""
    c, blocks = model_cfg.hidden_size, model_cfg.depth
    n_full = len(model_cfg.fullatt_block_indexes)
    sp_bytes = 4 * 8 * patches * c * n_full + 4 * sp * params
    tp_bytes = 4 * 4 * tp * patches * c * blocks + 8 * tp
    return sp_bytes, tp_bytes


def test_bench_three_layouts(ray_cluster, demo_overrides, tmp_path):
    prof = calibrate("cpu", quick=True, threads=1)  # with Ray's costs, measured in the session's Ray
    assert prof.actor_call_s > 0 and prof.busy_call_s > 0  # the hop alone and on the busy host
    assert prof.object_store is not None and prof.object_store.beta_bytes_per_s > 0
    prof.save(tmp_path / "cpu.json")
    rc = main(["bench", *demo_overrides, "runtime.cpus_per_worker=0.5", "output.trace_steps=1", "--layouts",
               "dhp,uniform_tp,fsdp", "--steps", "2", "--warmup", "1", "--workers", "4",
               "--profile", str(tmp_path / "cpu.json")])
    assert rc == 0
    out = tmp_path / "run"
    bench = json.loads((out / "bench.json").read_text())
    layouts = bench["layouts"]
    assert list(layouts) == ["dhp", "uniform_tp", "fsdp"]
    for r in layouts.values():
        assert r["steps_measured"] == [2, 3] and r["tokens_per_s"] > 0 and r["ratio_to_uniform_tp"] > 0
        for g in r["groups"].values():
            assert 0 < g["busy"] <= 1 and g["imbalance"] >= 1 and 0 < g["mfu"] < 1 and g["peak_memory_gb"] > 0
        assert r["router_bytes_per_step"] > 0
    assert layouts["uniform_tp"]["ratio_to_uniform_tp"] == 1.0
    assert set(layouts["dhp"]["comm_bytes_per_step"]["vision"]) == {"all_to_all", "all_reduce"}
    assert set(layouts["fsdp"]["comm_bytes_per_step"]["vision"]) >= {"all_gather", "reduce_scatter"}
    for name in ("bench_throughput.png", "bench_groups.png"):
        assert (out / name).stat().st_size > 1000

    # the measured SP/TP ratio of vision bytes against the closed form, on the measured step's patches
    cfg = load_config(None, demo_overrides)
    prepared = prepare(cfg)
    with torch.device("meta"):
        vision = get_family("qwen2_5_vl").module("vision").build(prepared.inputs.model_cfg)
    params = sum(p.numel() for p in vision.parameters())
    per_step = []
    for step in (1, 2):  # steps 2 and 3, the measured ones: bench reports their mean
        plan = prepared.planner.plan(step)
        patches = sum(t * h * w for i in plan.sample_ids for t, h, w in prepared.dataset.info(i).image_grids)
        per_step.append(vision_comm_closed_form(patches, params, prepared.inputs.model_cfg.vision, sp=2, tp=2))
    sp_bytes, tp_bytes = (sum(x) / len(per_step) for x in zip(*per_step, strict=True))
    assert sum(layouts["dhp"]["comm_bytes_per_step"]["vision"].values()) == pytest.approx(sp_bytes, rel=1e-3)
    assert sum(layouts["uniform_tp"]["comm_bytes_per_step"]["vision"].values()) == pytest.approx(tp_bytes, rel=1e-3)
    assert bench["vision_comm_ratio_sp_tp"] == pytest.approx(sp_bytes / tp_bytes, rel=0.01)
    check_prediction(layouts, out)
    check_look_ahead(layouts, out)


def check_prediction(layouts: dict, out) -> None:
    """The planner's prediction beside the measurement (issue: the ranking right, a loose bound: CPU times are
    noisy, the machine is shared by the suite's other workers) and its replay of the runtime's order against the
    trace: every group runs the calls the replay says, in its order.

    The suite's other workers slow every measured step, by 10-25x at times (the CI run of 2026-12-03: the dhp
    layout 11.8 s a step against 0.5 s on the idle machine), never speed one up: so the bound is one-sided
    (the prediction not above twice the measurement), and the load is taken out of the rest by comparing the
    layouts with one another: each layout's predicted / measured within 4x of every other's; the ranking of the
    fastest and the slowest layout measured (they must be 1.25x apart), and of every pair measured 2x apart.
    Why not every pair 1.25x or 1.5x apart: the load moves within a layout's minute of steps, so under the suite
    two layouts' order can flip (the CI run of 2026-12-06 06:00 UTC measured fsdp at 2.63 s, dhp at 1.74 and
    uniform_tp at 5.70, against 0.25, 0.37 and 0.56 s on the idle machine), and since the language model's
    packed lengths are rounded up (2026-12-06) its TP layouts are nearer fsdp's step (within 1.42x under the
    suite's load in another run)."""
    measured = {n: r["step_time_s"] for n, r in layouts.items()}
    predicted = {n: r["predicted_step_s"] for n, r in layouts.items()}
    ratio = {n: predicted[n] / measured[n] for n in layouts}
    for n in layouts:
        assert 0 < ratio[n] < 2.0, (n, predicted[n], measured[n])
    assert max(ratio.values()) < 4 * min(ratio.values()), (predicted, measured)
    fastest, slowest = min(measured, key=measured.get), max(measured, key=measured.get)
    assert measured[fastest] * 1.25 < measured[slowest], measured  # the layouts are told apart at all
    apart = [(fastest, slowest)] + [(a, b) for a in layouts for b in layouts if measured[a] * 2 < measured[b]]
    for a, b in apart:
        assert predicted[a] < predicted[b], (a, b, predicted, measured)
    for n, r in layouts.items():
        events = [e for e in read_trace(out / n / "trace.json") if e["args"].get("step") == 2 and e["rank"] == 0
                  and e["name"] in ("forward", "backward", "forward_backward")]
        for group, calls in r["prediction"]["calls"].items():
            traced = [[e["name"], e["args"]["round"]] for e in sorted(events, key=lambda e: e["ts"])
                      if e["module"] == group]
            assert traced == [c for c in calls if c[0] in ("forward", "backward", "forward_backward")], (n, group)


def check_look_ahead(layouts: dict, out) -> None:
    """The loaders start on a step's first round during the step before it (``RayBackend.run_step``'s
    ``upcoming``): in the traced step 2, every encoder rank's load of round 0 began before the driver's step did
    (the prefetch was submitted behind step 1's last calls), where a step that prefetched its own first round
    would begin it after."""
    for n in layouts:
        events = read_trace(out / n / "trace.json")
        start = next(e["ts"] for e in events if e["module"] == "driver" and e["args"].get("step") == 2)
        loads = [e for e in events if e["name"] == "load" and e["args"].get("step") == 2
                 and e["args"].get("round") == 0]
        assert loads and all(e["ts"] < start for e in loads), (n, start, loads)
