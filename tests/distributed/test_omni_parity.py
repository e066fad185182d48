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

from tests.parity import assert_matches_reference, run_steps


@pytest.fixture(scope="module")
def omni_run(omni_demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("omni")
    common = [f"data.path={omni_demo_data.train}", f"data.tokenizer={omni_demo_data.tokenizer}",
              "data.max_pixels=9408", "model.family=qwen2_5_omni", "model.preset=omni-tiny",
              "train.global_batch_size=8", "train.micro_batch_size=2", "train.optimizer=sgd", "train.lr=0.05",
              "train.momentum=0.9", "train.warmup_steps=1", "train.clip_grad_norm=1.0", f"output.dir={out / 'run'}",
              "runtime.cpus_per_worker=0.5"]
    return common, run_steps(common + ["runtime.backend=local"])


COUNTED = ["runtime.count_collectives=true"]  # these tests read the collective bytes (off in a plain step)


def _assert_same(stats, state, reference) -> None:
    assert_matches_reference(stats, state, reference)
    assert set(stats[0].imbalance) == {"vision", "audio", "text"}


def test_three_groups_disaggregated(ray_cluster, omni_run):
    common, reference = omni_run
    stats, state, _ = run_steps(common + COUNTED + ["runtime.backend=ray", "runtime.placement=disaggregated",
                                          "vision.parallel.sp=2", "audio.parallel.dp=2", "text.parallel.tp=2"])
    _assert_same(stats, state, reference)
    assert [len(state[m]) for m in ("vision", "audio", "text")] == [2, 2, 2]
    assert stats[0].timings["audio_forward"] > 0 and stats[0].timings["audio_backward"] > 0
    assert stats[0].comm_bytes["audio_all_reduce"] > 0  # the two audio replicas summed their gradients


def test_three_groups_collocated_with_audio_sequence_parallel(ray_cluster, omni_run):
    common, reference = omni_run
    stats, state, _ = run_steps(common + COUNTED + ["runtime.backend=ray", "runtime.placement=collocated",
                                          "vision.parallel.dp=1", "audio.parallel.sp=2", "text.parallel.tp=2"])
    _assert_same(stats, state, reference)
    assert [len(state[m]) for m in ("vision", "audio", "text")] == [1, 2, 2]
    assert stats[0].comm_bytes["audio_all_reduce"] > 0  # the SP ranks' partial gradients were summed
    assert "audio_all_to_all" not in stats[0].comm_bytes  # chunk-local attention: no all-to-all at all


def test_audio_sequence_parallel_with_fsdp_and_checkpointing(ray_cluster, omni_run):
    """Audio SP 2 with ZeRO-3 (FSDP2 over the SP ranks, which gather in lockstep even on a rank with no chunk)
    and activation checkpointing: the same losses and weights."""
    common, reference = omni_run
    stats, state, _ = run_steps(common + COUNTED + ["runtime.backend=ray", "runtime.placement=disaggregated",
                                          "vision.parallel.dp=1", "audio.parallel.sp=2", "audio.parallel.zero=3",
                                          "audio.activation_checkpointing=true", "text.parallel.dp=1"])
    _assert_same(stats, state, reference)
    assert stats[0].comm_bytes["audio_all_gather"] > 0  # FSDP2 gathered the sharded audio weights
