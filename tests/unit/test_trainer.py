"""The reference trainer: global token-mean loss under accumulation, freezing, schedule, clipping."""

from __future__ import annotations

import math

import pytest
import torch

from dhp.backends.base import clip_coefficient
from dhp.backends.local import LocalBackend
from dhp.config import load_config
from dhp.data.batch import shifted_targets
from dhp.engine import lr_lambda
from dhp.inputs import dataset_spec, module_costs, open_dataset, resolve_inputs


def make(overrides):
    cfg = load_config(None, overrides)
    inputs = resolve_inputs(cfg)
    ds = open_dataset(dataset_spec(inputs, inputs.train_path))
    return cfg, inputs, ds


def run_steps(overrides, steps=2):
    from dhp.data.sampler import BatchPlanner

    cfg, inputs, ds = make(overrides)
    backend = LocalBackend(inputs, ds)
    costs = module_costs(inputs.family, inputs.model_cfg, ds)
    planner = BatchPlanner(costs, {m: 1 for m in costs}, cfg.train.global_batch_size, cfg.train.micro_batch_size)
    losses = [backend.run_step(planner.plan(s)).loss for s in range(steps)]
    return losses, backend.state_dict(), planner, ds, inputs


@pytest.mark.parametrize("micro", [2, 4])
def test_accumulation_gives_the_same_update(demo_overrides, micro):
    """1, 2 and 4 micro-batches per global batch of 8: same losses, same weights (SGD, so the update is
    linear in the gradient and float rounding stays rounding)."""
    base = demo_overrides + ["train.optimizer=sgd", "train.lr=0.05"]
    ref_losses, ref_state, *_ = run_steps(base + ["train.micro_batch_size=8"])
    losses, state, *_ = run_steps(base + [f"train.micro_batch_size={micro}"])
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    for k, v in ref_state.items():
        assert (state[k] - v).abs().max().item() < 1e-5, k


def test_loss_is_the_global_token_mean(demo_overrides):
    """Step 1's loss equals the token mean over the 8 samples computed by hand with the same weights."""
    from dhp.engine import build_module

    losses, _, planner, ds, inputs = run_steps(demo_overrides + ["train.micro_batch_size=2"], steps=1)
    vision = build_module(inputs.family.module("vision"), inputs.model_cfg, 0, "cpu", None)
    text = build_module(inputs.family.language, inputs.model_cfg, 0, "cpu", None)
    total, n = 0.0, 0
    with torch.no_grad():
        for i in planner.plan(0).sample_ids:
            s = ds[i]
            emb = vision(s.pixel_values, s.image_grid_thw) if s.image_grid_thw.shape[0] else None
            t = shifted_targets(s.labels)
            total += float(text.loss_sum(s.input_ids[None], s.position_ids[:, None], t[None], emb))
            n += int((t != -100).sum())
    assert losses[0] == pytest.approx(total / n, rel=1e-5)


def test_frozen_vision_keeps_its_weights(demo_overrides):
    _, state0, *_ = run_steps(demo_overrides + ["vision.trainable=false", "merger.trainable=false"], steps=0)
    _, state, *_ = run_steps(demo_overrides + ["vision.trainable=false", "merger.trainable=false"], steps=2)
    assert all(torch.equal(state[k], state0[k]) for k in state if k.startswith("visual."))
    assert not torch.equal(state["language.norm.weight"], state0["language.norm.weight"])


def test_frozen_blocks_train_only_the_merger(demo_overrides):
    over = demo_overrides + ["vision.trainable=false"]
    _, state0, *_ = run_steps(over, steps=0)
    _, state, *_ = run_steps(over, steps=2)
    assert torch.equal(state["visual.blocks.0.attn.qkv.weight"], state0["visual.blocks.0.attn.qkv.weight"])
    assert not torch.equal(state["visual.merger.mlp.0.weight"], state0["visual.merger.mlp.0.weight"])


def test_lr_schedule_warmup_then_cosine():
    cfg = load_config(None, ["train.steps=110", "train.warmup_steps=10", "train.min_lr_ratio=0.1"])
    f = lr_lambda(cfg)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(0.1 + 0.9 * 0.5)
    assert f(110) == pytest.approx(0.1)


def test_clip_coefficient_matches_torch():
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.full((4,), 3.0)
    norm = float(torch.nn.utils.clip_grad_norm_([p], 1.5))
    assert clip_coefficient(norm, 1.5) * 3.0 == pytest.approx(float(p.grad[0]))
    assert clip_coefficient(0.5, 1.0) == 1.0
    assert clip_coefficient(math.inf, 0.0) == 1.0
