"""The batch plan: deterministic, balanced, covering each sample once per epoch."""

from __future__ import annotations

import pytest

from dhp.config import ConfigError
from dhp.data.sampler import BatchPlanner


def lengths(n=40):
    return [(i * 37) % 101 + 10 for i in range(n)]


def test_deterministic_and_seeded():
    a = BatchPlanner(lengths(), 8, 2, text_dp=2, vision_dp=2, seed=1)
    b = BatchPlanner(lengths(), 8, 2, text_dp=2, vision_dp=2, seed=1)
    c = BatchPlanner(lengths(), 8, 2, text_dp=2, vision_dp=2, seed=2)
    assert [a.plan(s) for s in range(7)] == [b.plan(s) for s in range(7)]
    assert a.plan(0).sample_ids != c.plan(0).sample_ids


def test_epoch_covers_each_sample_once():
    p = BatchPlanner(lengths(), 8, 2, text_dp=2, vision_dp=3)
    ids = [i for s in range(p.steps_per_epoch) for i in p.plan(s).sample_ids]
    assert sorted(ids) == list(range(40))
    assert p.plan(p.steps_per_epoch).epoch == 1


def test_rounds_shapes_and_balance():
    lens = lengths()
    p = BatchPlanner(lens, 12, 2, text_dp=3, vision_dp=2)
    plan = p.plan(0)
    assert len(plan.rounds) == 2  # 12 / (2 x 3)
    for r in plan.rounds:
        assert [len(part) for part in r.text] == [2, 2, 2]
        assert sorted(i for part in r.vision for i in part) == sorted(r.sample_ids)
    # the per-replica token loads of a step differ by less than the longest sample
    loads = [sum(lens[i] for r in plan.rounds for i in r.text[k]) for k in range(3)]
    assert max(loads) - min(loads) <= max(lens)


def test_batch_that_does_not_divide():
    with pytest.raises(ConfigError, match="multiple of train.micro_batch_size x text.parallel.dp"):
        BatchPlanner(lengths(), 10, 4, text_dp=1)
    with pytest.raises(ConfigError, match="fewer than train.global_batch_size"):
        BatchPlanner(lengths(5), 8, 2)
