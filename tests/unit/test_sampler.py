"""The batch plan: deterministic, keyed by module, each module balancing its own cost."""

from __future__ import annotations

import pytest

from dhp.config import ConfigError
from dhp.data.sampler import BatchPlanner, Round, StepPlan, _balanced_split, plan_imbalance


def lengths(n=40):
    return [(i * 37) % 101 + 10 for i in range(n)]


def patches(n=40):
    """Vision cost: every third sample is text-only (0), a few are huge."""
    return [0 if i % 3 == 0 else (2000 if i % 11 == 1 else 20 + (i * 13) % 50) for i in range(n)]


def planner(gbs=12, mbs=2, text_dp=3, vision_dp=2, seed=0, n=40):
    return BatchPlanner(
        {"text": lengths(n), "vision": patches(n)}, {"text": text_dp, "vision": vision_dp}, gbs, mbs, seed=seed
    )


def test_deterministic_and_seeded():
    a, b, c = planner(seed=1), planner(seed=1), planner(seed=2)
    assert [a.plan(s) for s in range(7)] == [b.plan(s) for s in range(7)]
    assert a.plan(0).sample_ids != c.plan(0).sample_ids
    # a step's plan does not depend on which steps were planned before (resume)
    assert planner(seed=1).plan(5) == a.plan(5)


def test_epoch_covers_each_sample_once():
    p = planner(gbs=8, mbs=2, text_dp=2, vision_dp=3)
    ids = [i for s in range(p.steps_per_epoch) for i in p.plan(s).sample_ids]
    assert sorted(ids) == list(range(40))
    assert p.plan(p.steps_per_epoch).epoch == 1
    assert p.plan(p.steps_per_epoch).sample_ids != p.plan(0).sample_ids


def test_language_model_plan_unchanged_with_token_costs():
    """Costs = token counts give the language model the same batches as the planner before modules."""
    p = BatchPlanner({"text": lengths(), "vision": patches()}, {"text": 3, "vision": 2}, 12, 2, seed=3)
    expected = {  # recorded from the previous BatchPlanner(lengths(), 12, 2, text_dp=3, vision_dp=2, seed=3)
        0: [((28, 30), (8, 17), (6, 38)), ((23, 29), (24, 31), (5, 20))],
        1: [((22, 27), (16, 33), (0, 13)), ((26, 37), (1, 10), (2, 15))],
        4: [((19, 25), (33, 38), (5, 22)), ((10, 17), (12, 21), (2, 15))],
    }
    for step, text in expected.items():
        assert [r.replicas("text") for r in p.plan(step).rounds] == text


def test_every_id_once_per_module_that_carries_it():
    p = BatchPlanner(
        {"text": lengths(), "vision": patches(), "audio": [i % 2 * (i + 1) for i in range(40)]},
        {"text": 2, "vision": 3, "audio": 2}, 8, 2,
    )
    vis, aud = patches(), [i % 2 * (i + 1) for i in range(40)]
    for s in range(p.steps_per_epoch):
        plan = p.plan(s)
        assert len(plan.rounds) == 2  # 8 / (2 x 2)
        for r in plan.rounds:
            assert [len(part) for part in r.replicas("text")] == [2, 2]  # exact micro-batches
            assert len(r.replicas("vision")) == 3 and len(r.replicas("audio")) == 2  # one entry per replica
            ids = r.sample_ids
            assert len(set(ids)) == len(ids) == 4
            got_v = sorted(i for part in r.replicas("vision") for i in part)
            got_a = sorted(i for part in r.replicas("audio") for i in part)
            assert got_v == sorted(i for i in ids if vis[i] > 0)
            assert got_a == sorted(i for i in ids if aud[i] > 0)
            assert all(vis[i] > 0 for i in got_v) and all(aud[i] > 0 for i in got_a)
            for module in r.modules:
                assert all(list(part) == sorted(part) for part in r.replicas(module))
        assert len(set(plan.sample_ids)) == 8


def test_text_only_samples_never_reach_the_encoder():
    costs = {"text": [5.0] * 8, "vision": [0.0] * 8}
    plan = BatchPlanner(costs, {"text": 1, "vision": 2}, 4, 2).plan(0)
    for r in plan.rounds:
        assert r.replicas("vision") == ((), ())
    assert plan.imbalance({"vision": costs["vision"]}) == {"vision": 1.0}


def test_worked_example():
    """One round of 6 samples, text dp 2 by tokens, vision dp 2 by its own cost.

    text: by tokens 60,50,40,30,20,10 (ids 0..5), 3 each: 0->r0, 1->r1, 2->r1 (50<60), 3->r0 (60<90),
          4->r0 (90==90, lowest index), 5->r1 -> r0 = {0,3,4} (110), r1 = {1,2,5} (100).
    vision: ids 1 and 3 text-only; costs 0:100, 2:900, 4:300, 5:500 -> 2->v0, 5->v1, 4->v1, 0->v1:
            v0 = {2} (900), v1 = {0,4,5} (900).
    """
    costs = {"text": [60, 50, 40, 30, 20, 10], "vision": [100, 0, 900, 0, 300, 500]}
    p = BatchPlanner(costs, {"text": 2, "vision": 2}, 6, 3)
    (r,) = p.plan(0).rounds
    assert r.replicas("text") == ((0, 3, 4), (1, 2, 5))
    assert r.replicas("vision") == ((2,), (0, 4, 5))
    assert r.sample_ids == [0, 3, 4, 1, 2, 5]
    assert p.plan(0).imbalance(costs) == pytest.approx({"text": 110 / 105, "vision": 1.0})
    # balanced by tokens instead (the old behaviour: every sample, token counts), vision is 400 vs 1400
    by_tokens = _balanced_split(range(6), costs["text"], 2, None)
    assert by_tokens == [[0, 3, 4], [1, 2, 5]]
    old = StepPlan(0, 0, (Round({"text": r.replicas("text"), "vision": tuple(map(tuple, by_tokens))}),))
    assert plan_imbalance(old, {"vision": costs["vision"]}) == pytest.approx({"vision": 1400 / 900})


def test_balanced_split_deterministic_ties():
    assert _balanced_split([3, 1, 2, 0], [1, 1, 1, 1], 2, None) == [[0, 2], [1, 3]]
    assert _balanced_split([0, 1, 2], [5, 5, 5], 4, None) == [[0], [1], [2], []]
    assert _balanced_split([0, 1, 2, 3], [9, 1, 1, 1], 2, 2) == [[0, 3], [1, 2]]


def skewed(n=256, seed=0):
    """A few huge images among many small ones and text-only samples; tokens include image tokens."""
    import random

    rng = random.Random(seed)
    vis = [2048] * 6 + [rng.randint(64, 256) for _ in range(150)] + [0] * (n - 156)
    rng.shuffle(vis)
    text = [rng.randint(40, 400) + v // 4 for v in vis]
    vcost = [v * 32 + 4 * v * v / 64 for v in vis]  # linear term + quadratic full-attention term
    return text, vcost


def test_own_cost_balances_the_encoder_better_than_tokens():
    text, vcost = skewed()
    dp = {"text": 2, "vision": 4}
    new = BatchPlanner({"text": text, "vision": vcost}, dp, 32, 4, seed=0)
    old = BatchPlanner({"text": text, "vision": text}, dp, 32, 4, seed=0)  # old: all samples, by tokens
    new_imb = old_imb = 0.0
    for s in range(8):
        a, b = new.plan(s), old.plan(s)
        assert a.sample_ids == b.sample_ids  # same batches, only the encoder split differs
        ia, ib = a.imbalance({"vision": vcost})["vision"], b.imbalance({"vision": vcost})["vision"]
        assert ia <= ib + 1e-9
        new_imb, old_imb = new_imb + ia, old_imb + ib
    assert new_imb < old_imb  # strictly better on the whole


def test_imbalance_definition():
    r1 = Round({"text": ((0,), (1,)), "vision": ((0, 1), ())})
    r2 = Round({"text": ((2,), (3,)), "vision": ((2,), (3,))})
    plan = StepPlan(0, 0, (r1, r2))
    costs = {"text": [1, 3, 2, 2], "vision": [1, 1, 2, 2]}
    # text: (3 + 2) / (2 + 2); vision: (2 + 2) / (1 + 2)
    assert plan.imbalance(costs) == pytest.approx({"text": 5 / 4, "vision": 4 / 3})
    assert plan_imbalance(plan, costs) == plan.imbalance(costs)
    assert plan.sample_ids == [0, 1, 2, 3]


def test_round_unknown_module_names_it():
    r = Round({"text": ((0,),), "vision": ((0,),)})
    with pytest.raises(KeyError, match=r"'audio'.*\['text', 'vision'\]"):
        r.replicas("audio")


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match=r"multiple of train.micro_batch_size x text.parallel.dp \(4 x 1 = 4\)"):
        BatchPlanner({"text": lengths()}, {"text": 1}, 10, 4)
    with pytest.raises(ConfigError, match="x lm.parallel.dp"):
        BatchPlanner({"lm": lengths()}, {"lm": 3}, 8, 2, language="lm")
    with pytest.raises(ConfigError, match="fewer than train.global_batch_size"):
        BatchPlanner({"text": lengths(5)}, {"text": 1}, 8, 2)
    with pytest.raises(ConfigError, match="vision.parallel.dp"):
        BatchPlanner({"text": lengths(), "vision": patches()}, {"text": 1}, 8, 2)
    with pytest.raises(ConfigError, match="audio.parallel.dp must be at least 1"):
        BatchPlanner({"text": lengths(), "audio": patches()}, {"text": 1, "audio": 0}, 8, 2)
    with pytest.raises(ConfigError, match="language model 'text'"):
        BatchPlanner({"vision": patches()}, {"vision": 1}, 8, 2)
    with pytest.raises(ConfigError, match="'vision' cover 39 samples"):
        BatchPlanner({"text": lengths(), "vision": patches(39)}, {"text": 1, "vision": 1}, 8, 2)
    with pytest.raises(ConfigError, match="cost the language model"):
        BatchPlanner({"text": [0] + lengths(39)}, {"text": 1}, 8, 2)
    with pytest.raises(ConfigError, match="'vision' must not be negative"):
        BatchPlanner({"text": lengths(), "vision": [-1] + patches(39)}, {"text": 1, "vision": 1}, 8, 2)
