"""``GcPolicy`` (``runtime.gc_freeze``, ``runtime.gc_every_steps``): what it does to this process's collector."""

from __future__ import annotations

import gc

import pytest

from dhp.runtime.gc_policy import GcPolicy


@pytest.fixture
def collector():
    """Full collections run in the test (by ``gc.callbacks``), and the collector as it was afterwards."""
    full: list[int] = []

    def seen(phase: str, info: dict) -> None:
        if phase == "start" and info["generation"] == 2:
            full.append(1)

    was_enabled = gc.isenabled()
    gc.callbacks.append(seen)
    try:
        yield full
    finally:
        gc.callbacks.remove(seen)
        gc.unfreeze()
        (gc.enable if was_enabled else gc.disable)()


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_freeze_moves_start_ups_objects_out_of_every_collection(collector):
    gc.unfreeze()
    policy = GcPolicy(freeze=True, every_steps=0)
    kept = [_Cycle() for _ in range(1000)]  # start-up's objects: alive for the whole run
    policy.after_init()
    assert gc.get_freeze_count() >= 1000 and gc.isenabled()  # automatic collection stays on
    assert len(collector) == 1 and policy.collect_s > 0
    frozen = gc.get_freeze_count()
    made = [_Cycle() for _ in range(100)]  # the first step's (its optimizer state, caches)
    policy.after_step()
    assert gc.get_freeze_count() >= frozen + 100 and len(collector) == 2
    policy.after_step()  # later steps: nothing of the policy's own
    assert len(collector) == 2 and policy.steps == 2
    assert len(kept) == 1000 and len(made) == 100


def test_every_steps_collects_at_the_step_and_only_there(collector):
    gc.unfreeze()
    policy = GcPolicy(freeze=False, every_steps=3)
    policy.after_init()
    assert not gc.isenabled() and gc.get_freeze_count() == 0 and collector == []
    garbage = []
    for step in range(1, 8):
        garbage.append(_Cycle())  # a cycle: only a collection frees it
        policy.after_step()
        assert len(collector) == step // 3, step
    del garbage
    policy.close()
    assert gc.isenabled()


def test_no_freeze_no_schedule_leaves_python_alone(collector):
    gc.unfreeze()
    policy = GcPolicy(freeze=False, every_steps=0)
    policy.after_init()
    policy.after_step()
    assert gc.isenabled() and gc.get_freeze_count() == 0 and collector == [] and policy.collect_s == 0


def test_the_config_refuses_a_negative_schedule():
    from dhp.config import ConfigError, load_config

    assert load_config(None, ["runtime.gc_every_steps=5"]).runtime.gc_every_steps == 5
    with pytest.raises(ConfigError, match="runtime.gc_every_steps"):
        load_config(None, ["runtime.gc_every_steps=-1"])
