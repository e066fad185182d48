"""The Ray runtime equals the single-process reference trainer (CPU, gloo, real Ray actors).

Weights are compared under SGD with momentum: its update is linear in the gradient, so
the float rounding of the summation order stays rounding. (Adam divides by the square
root of the second moment; on its first steps a near-zero gradient's rounding becomes a
learning-rate-sized weight difference, which says nothing about correctness.) One layout
also runs AdamW and compares its losses.
"""

from __future__ import annotations

import pytest
import torch

from dhp.config import load_config
from dhp.data.sampler import BatchPlanner
from dhp.train import LocalBackend, dataset_spec, open_dataset, resolve_inputs

STEPS = 3
SGD = ["train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9"]


def run(overrides, backend_name):
    cfg = load_config(None, overrides + [f"runtime.backend={backend_name}", "runtime.cpus_per_worker=0.5"])
    inputs = resolve_inputs(cfg)
    spec = dataset_spec(cfg, inputs.tokenizer_dir, inputs.train_path)
    ds = open_dataset(spec)
    planner = BatchPlanner(ds.lengths(), cfg.train.global_batch_size, cfg.train.micro_batch_size,
                           text_dp=cfg.text.parallel.dp, vision_dp=cfg.vision.parallel.dp, seed=cfg.train.seed)
    if backend_name == "local":
        backend = LocalBackend(inputs, ds)
    else:
        from dhp.runtime.backend import RayBackend

        backend = RayBackend(inputs, spec)
    try:
        initial = backend.state_dict() if backend_name == "local" else None
        stats = [backend.run_step(planner.plan(s)) for s in range(STEPS)]
        return stats, backend.state_dict(), initial
    finally:
        backend.shutdown()


@pytest.fixture(scope="module")
def reference(demo_overrides_module):
    return run(demo_overrides_module + SGD, "local")


@pytest.fixture(scope="module")
def demo_overrides_module(demo_data, tmp_path_factory):
    return [
        f"data.path={demo_data.train}",
        f"data.tokenizer={demo_data.tokenizer}",
        "data.max_pixels=12544",
        "train.global_batch_size=8",
        "train.micro_batch_size=2",
        "train.warmup_steps=1",
        "train.clip_grad_norm=1.0",
        f"output.dir={tmp_path_factory.mktemp('run')}",
    ]


def assert_same(result, ref, check_weights=True):
    stats, state, _ = result
    ref_stats, ref_state, initial = ref
    assert [s.loss for s in stats] == pytest.approx([s.loss for s in ref_stats], rel=1e-5)
    assert [s.grad_norm for s in stats] == pytest.approx([s.grad_norm for s in ref_stats], rel=1e-4)
    assert [s.supervised_tokens for s in stats] == [s.supervised_tokens for s in ref_stats]
    if check_weights:
        assert state.keys() == ref_state.keys()
        worst = max((state[k] - ref_state[k]).abs().max().item() for k in state)
        assert worst < 1e-5
        for prefix in ("visual.", "language."):  # both modules trained: the comparison is not of untouched weights
            moved = max((ref_state[k] - initial[k]).abs().max().item() for k in ref_state if k.startswith(prefix))
            assert moved > 1e-3, prefix


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.mark.parametrize("placement", ["collocated", "disaggregated"])
@pytest.mark.parametrize("vision_dp, text_dp", LAYOUTS)
def test_data_parallel_layouts_match_reference(ray_cluster, reference, demo_overrides_module, placement,
                                               vision_dp, text_dp):
    over = demo_overrides_module + SGD + [
        f"vision.parallel.dp={vision_dp}", f"text.parallel.dp={text_dp}", f"runtime.placement={placement}",
    ]
    assert_same(run(over, "ray"), reference)


@pytest.mark.parametrize("placement", ["collocated", "disaggregated"])
def test_frozen_vision_matches_reference(ray_cluster, demo_overrides_module, placement):
    frozen = ["vision.trainable=false", "merger.trainable=false"]
    ref = run(demo_overrides_module + SGD + frozen, "local")
    got = run(demo_overrides_module + SGD + frozen + ["vision.parallel.dp=2", f"runtime.placement={placement}"],
              "ray")
    stats, state, _ = got
    assert [s.loss for s in stats] == pytest.approx([s.loss for s in ref[0]], rel=1e-5)
    assert max((state[k] - ref[1][k]).abs().max().item() for k in state) < 1e-5
    assert all(torch.equal(state[k], ref[2][k]) for k in state if k.startswith("visual."))  # untouched
    assert all(s.timings.get("vision_backward", 0.0) == 0.0 for s in stats)  # no backward at all


def test_adamw_losses_match_reference(ray_cluster, demo_overrides_module):
    adam = ["train.optimizer=adamw", "train.lr=1e-3"]
    ref = run(demo_overrides_module + adam, "local")
    got = run(demo_overrides_module + adam + ["vision.parallel.dp=2", "text.parallel.dp=2"], "ray")
    assert [s.loss for s in got[0]] == pytest.approx([s.loss for s in ref[0]], rel=1e-5)
