"""Qwen2.5-Omni's thinker trains in three Ray groups (vision, audio, text) and equals the single-process
reference: per-step losses, and the weights of every rank of every group.

Three layouts, each against the same reference run:

* disaggregated, equal sizes: vision Ulysses sp 2, audio dp 2, text tp 2 (six workers);
* collocated, unequal sizes: vision dp 1, audio sequence parallel 2 (whole attention chunks per rank),
  text tp 2 with ZeRO-1 off (two workers hold all three groups);
* audio sp 2 with ZeRO-3 and activation checkpointing, disaggregated.
"""

from __future__ import annotations

import pytest

from dhp.backends import make_backend
from dhp.config import load_config
from dhp.inputs import prepare

STEPS = 3


def run(overrides: list[str]):
    run_ = prepare(load_config(None, overrides))
    backend = make_backend(run_.inputs, run_.dataset, run_.spec)
    try:
        initial = backend.rank_state_dicts()
        stats = [backend.run_step(run_.planner.plan(s)) for s in range(STEPS)]
        return stats, backend.rank_state_dicts(), initial
    finally:
        backend.shutdown()


@pytest.fixture(scope="module")
def omni_run(omni_demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("omni")
    common = [f"data.path={omni_demo_data.train}", f"data.tokenizer={omni_demo_data.tokenizer}",
              "data.max_pixels=9408", "model.family=qwen2_5_omni", "model.preset=omni-tiny",
              "train.global_batch_size=8", "train.micro_batch_size=2", "train.optimizer=sgd", "train.lr=0.05",
              "train.momentum=0.9", "train.warmup_steps=1", "train.clip_grad_norm=1.0", f"output.dir={out / 'run'}",
              "runtime.cpus_per_worker=0.5"]
    return common, run(common + ["runtime.backend=local"])


def _assert_same(stats, state, reference) -> None:
    ref_stats, ref_state, initial = reference
    assert [s.loss for s in stats] == pytest.approx([s.loss for s in ref_stats], rel=1e-5)
    assert [s.supervised_tokens for s in stats] == [s.supervised_tokens for s in ref_stats]
    assert set(stats[0].imbalance) == {"vision", "audio", "text"}
    for module, ranks in state.items():
        want, start = ref_state[module][0], initial[module][0]
        moved = max((want[k] - start[k]).abs().max().item() for k in want)
        assert moved > 1e-4, module  # every module trained, so equal weights mean something
        for rank, got in enumerate(ranks):  # every replica / rank of every group
            assert got.keys() == want.keys()
            worst = max((got[k] - want[k]).abs().max().item() for k in want)
            assert worst < 1e-5, (module, rank, worst)


def test_three_groups_disaggregated(ray_cluster, omni_run):
    common, reference = omni_run
    stats, state, _ = run(common + ["runtime.backend=ray", "runtime.placement=disaggregated",
                                    "vision.parallel.sp=2", "audio.parallel.dp=2", "text.parallel.tp=2"])
    _assert_same(stats, state, reference)
    assert [len(state[m]) for m in ("vision", "audio", "text")] == [2, 2, 2]
    assert stats[0].timings["audio_forward"] > 0 and stats[0].timings["audio_backward"] > 0
    assert stats[0].comm_bytes["audio_all_reduce"] > 0  # the two audio replicas summed their gradients


def test_three_groups_collocated_with_audio_sequence_parallel(ray_cluster, omni_run):
    common, reference = omni_run
    stats, state, _ = run(common + ["runtime.backend=ray", "runtime.placement=collocated",
                                    "vision.parallel.dp=1", "audio.parallel.sp=2", "text.parallel.tp=2"])
    _assert_same(stats, state, reference)
    assert [len(state[m]) for m in ("vision", "audio", "text")] == [1, 2, 2]
    assert stats[0].comm_bytes["audio_all_reduce"] > 0  # the SP ranks' partial gradients were summed
    assert "audio_all_to_all" not in stats[0].comm_bytes  # chunk-local attention: no all-to-all at all


def test_audio_sequence_parallel_with_fsdp_and_checkpointing(ray_cluster, omni_run):
    """Audio SP 2 with ZeRO-3 (FSDP2 over the SP ranks, which gather in lockstep even on a rank with no chunk)
    and activation checkpointing: the same losses and weights."""
    common, reference = omni_run
    stats, state, _ = run(common + ["runtime.backend=ray", "runtime.placement=disaggregated", "vision.parallel.dp=1",
                                    "audio.parallel.sp=2", "audio.parallel.zero=3",
                                    "audio.activation_checkpointing=true", "text.parallel.dp=1"])
    _assert_same(stats, state, reference)
    assert stats[0].comm_bytes["audio_all_gather"] > 0  # FSDP2 gathered the sharded audio weights
