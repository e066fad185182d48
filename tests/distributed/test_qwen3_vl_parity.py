"""Qwen3-VL trains on real Ray actors (gloo) and equals the single-process reference: per-step losses, and the
weights of every rank of every group, the DeepStack mergers' included.

DeepStack is what is new here: the vision group sends each vision token's merged embedding and its K DeepStack
features as one ``[n, (1 + K) * D]`` tensor, and the text group sends one gradient of that width back. A wrong
cut of that tensor (under SP, across the router, or under FSDP2) leaves the main merger right and the DeepStack
mergers wrong, so the test checks that those moved and match on their own. Two layouts, one reference run:

* disaggregated: vision Ulysses sp 2 (an all-to-all in every full-attention block), text tp 2 with Megatron
  SP (four workers): each text rank receives only its sequence slice's rows of the packed tensor, adds each
  DeepStack level at the vision positions of its own sequence shard, and sends those rows' gradients back; the
  q/k norms' weights, shared by the sharded heads, get their gradient summed over the TP ranks;
* collocated: vision dp 2 and text dp 2, both with ZeRO-3 (FSDP2), on the same two workers.
"""

from __future__ import annotations

import pytest

from tests.parity import assert_matches_reference, run_steps

STEPS = 2


@pytest.fixture(scope="module")
def qwen3_vl_run(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("qwen3_vl")
    common = [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
              "model.family=qwen3_vl", "model.preset=qwen3-vl-tiny", "train.global_batch_size=4",
              "train.micro_batch_size=2", "train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9",
              "train.warmup_steps=1", "train.clip_grad_norm=1.0", f"output.dir={out / 'run'}",
              "runtime.cpus_per_worker=0.5"]
    return common, run_steps(common + ["runtime.backend=local"], steps=STEPS)


def _assert_deepstack_moved_and_matches(state, reference, atol: float = 1e-5) -> None:
    """The DeepStack mergers on their own: they moved, and every vision rank holds the reference's values."""
    _, ref_state, initial = reference
    want, start = ref_state["vision"][0], initial["vision"][0]
    keys = [k for k in want if "deepstack_merger_list" in k]
    levels = {k.split("deepstack_merger_list.")[1].split(".")[0] for k in keys}
    assert levels == {"0", "1"}, levels  # the tiny preset has two DeepStack levels
    for level in sorted(levels):
        mine = [k for k in keys if f"deepstack_merger_list.{level}." in k]
        assert max((want[k] - start[k]).abs().max().item() for k in mine) > 1e-4, level
        for rank, got in enumerate(state["vision"]):
            worst = max((got[k] - want[k]).abs().max().item() for k in mine)
            assert worst < atol, (level, rank, worst)


def test_vision_sp_text_tp_sequence_parallel_disaggregated(ray_cluster, qwen3_vl_run):
    common, reference = qwen3_vl_run
    stats, state, _ = run_steps(common + ["runtime.backend=ray", "runtime.placement=disaggregated",
                                          "runtime.count_collectives=true",  # it reads the all-to-all bytes
                                          "vision.parallel.sp=2", "text.parallel.tp=2",
                                          "text.parallel.sequence_parallel=true"], steps=STEPS)
    assert_matches_reference(stats, state, reference)
    _assert_deepstack_moved_and_matches(state, reference)
    assert [len(state[m]) for m in ("vision", "text")] == [2, 2]
    assert stats[0].comm_bytes["vision_all_to_all"] > 0  # the SP ranks exchanged heads in the blocks
    assert stats[0].comm_bytes["text_all_gather"] > 0  # Megatron SP gathered the sequence before each block


def test_data_parallel_zero3_collocated(ray_cluster, qwen3_vl_run):
    common, reference = qwen3_vl_run
    stats, state, _ = run_steps(common + ["runtime.backend=ray", "runtime.placement=collocated",
                                          "runtime.count_collectives=true",  # it reads the all-gather bytes
                                          "vision.parallel.dp=2", "vision.parallel.zero=3",
                                          "text.parallel.dp=2", "text.parallel.zero=3"], steps=STEPS)
    assert_matches_reference(stats, state, reference)
    _assert_deepstack_moved_and_matches(state, reference)
    assert [len(state[m]) for m in ("vision", "text")] == [2, 2]
    assert stats[0].comm_bytes["vision_all_gather"] > 0  # FSDP2 gathered the sharded vision weights
    assert stats[0].comm_bytes["text_all_gather"] > 0
