"""The step's schedule as data (``dhp.data.sampler.schedule_turns``) and the encoder window of the batch plan."""

from __future__ import annotations

import pytest

from dhp.config import ConfigError
from dhp.data.sampler import BatchPlanner, Turn, encoder_window, schedule_turns


def kinds(turns: tuple[Turn, ...]) -> str:
    return " ".join(f"{t.kind[0]}{t.round}" for t in turns)


def test_schedule_turns() -> None:
    assert kinds(schedule_turns(3)) == "e0 t0 e1 t1 e2 t2"  # collocated, no window: take turns
    assert kinds(schedule_turns(3, ahead=1)) == "e0 e1 t0 e2 t1 t2"  # disaggregated: one round ahead
    assert kinds(schedule_turns(4, window=4)) == "e0 e1 e2 e3 t0 t1 t2 t3"  # the window's rounds at once
    assert kinds(schedule_turns(5, window=2)) == "e0 e1 t0 t1 e2 e3 t2 t3 e4 t4"
    assert kinds(schedule_turns(4, window=2, ahead=2)) == "e0 e1 e2 t0 e3 t1 t2 t3"
    with pytest.raises(ValueError, match="window must be >= 1"):
        schedule_turns(2, window=0)


def test_encoder_window_auto() -> None:
    assert encoder_window(0, "collocated", [4], 1, 8) == 4  # one sample per round, four replicas
    assert encoder_window(0, "collocated", [4, 2], 2, 8) == 2
    assert encoder_window(0, "collocated", [4], 1, 2) == 2  # never more than the step's rounds
    assert encoder_window(0, "collocated", [1], 2, 8) == 1
    assert encoder_window(0, "disaggregated", [4], 1, 8) == 1  # the encoders run ahead on their own devices
    assert encoder_window(3, "disaggregated", [4], 1, 8) == 3  # a number is used as given


def test_window_spreads_a_windows_samples_over_the_replicas() -> None:
    costs = {"text": [10.0, 9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0], "vision": [5.0, 4.0, 0.0, 3.0, 2.0, 1.0, 1.0, 1.0]}
    plain = BatchPlanner(costs, {"text": 1, "vision": 4}, 8, 1).plan(0)
    windowed = BatchPlanner(costs, {"text": 1, "vision": 4}, 8, 1, encoder_window=4).plan(0)
    assert [r.replicas("text") for r in plain.rounds] == [r.replicas("text") for r in windowed.rounds]
    # without a window replica 0 encodes every round's one sample; with it each window's samples spread out
    assert all(not any(r.replicas("vision")[1:]) for r in plain.rounds)
    for w in (windowed.rounds[:4], windowed.rounds[4:]):
        ids = sorted(i for r in w for i in r.sample_ids if costs["vision"][i] > 0)
        used = [q for r in w for q, part in enumerate(r.replicas("vision")) if part]
        assert len(used) == len(ids) == len(set(used))  # one replica per sample, none twice
        for r in w:  # a replica encodes only its own round's samples in that round
            assert sorted(i for part in r.replicas("vision") for i in part) == sorted(
                i for i in r.sample_ids if costs["vision"][i] > 0)
    assert windowed.window == 4
    assert windowed.imbalance(costs)["vision"] < plain.imbalance(costs)["vision"]
    with pytest.raises(ConfigError, match="encoder window"):
        BatchPlanner(costs, {"text": 1, "vision": 4}, 8, 1, encoder_window=0)


def test_an_encoder_dp_the_batch_cannot_feed_is_refused() -> None:
    from dhp.backends.ray_backend import check_encoders_fed
    from dhp.config import load_config

    check_encoders_fed(load_config(None, ["vision.parallel.dp=4", "train.global_batch_size=4",
                                          "runtime.backend=ray"]), ["vision"])
    cfg = load_config(None, ["vision.parallel.dp=4", "train.global_batch_size=2", "train.micro_batch_size=1",
                             "runtime.backend=ray"])
    with pytest.raises(ConfigError, match=r"vision.parallel.dp=4 exceeds train.global_batch_size=2"):
        check_encoders_fed(cfg, ["vision"])
