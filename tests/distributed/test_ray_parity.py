"""The Ray runtime equals the single-process reference trainer (CPU, gloo, real Ray actors).

Weights are compared under SGD with momentum: its update is linear in the gradient, so
the float rounding of the summation order stays rounding. (Adam divides by the square
root of the second moment; on its first steps a near-zero gradient's rounding becomes a
learning-rate-sized weight difference, which says nothing about correctness.) One layout
also runs AdamW and compares its losses.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dhp import checkpoint
from dhp.backends import make_backend
from dhp.config import load_config
from dhp.inputs import prepare

STEPS = 3
SGD = ["train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9"]


def run(overrides, backend_name, export_to: Path | None = None):
    """(step stats, every rank's weights, the initial weights on the local backend). ``export_to``: also save a
    checkpoint after the last step (every group its own shards) and export it there as an HF directory."""
    cfg = load_config(None, overrides + [f"runtime.backend={backend_name}", "runtime.cpus_per_worker=0.5"])
    run_ = prepare(cfg)
    planner = run_.planner
    backend = make_backend(run_.inputs, run_.dataset, run_.spec)
    try:
        initial = backend.state_dict() if backend_name == "local" else None
        stats = [backend.run_step(planner.plan(s)) for s in range(STEPS)]
        if export_to is not None:
            ckpt = export_to / "checkpoint"
            backend.save_checkpoint(ckpt)
            checkpoint.finish(ckpt, {"step": STEPS})
            checkpoint.export_hf(ckpt, export_to / "hf", run_.inputs.family, run_.inputs.model_cfg)
        return stats, backend.rank_state_dicts(), initial
    finally:
        backend.shutdown()


def prefixed(ranks: dict[str, list[dict]], rank: int = 0) -> dict[str, torch.Tensor]:
    """One rank of every module as a whole-model state dict (our names)."""
    prefix = {"vision": "visual", "text": "language", "audio": "audio"}
    return {f"{prefix.get(m, m)}.{k}": v for m, states in ranks.items() for k, v in states[rank].items()}


def worst_rank_difference(ranks: dict[str, list[dict]], ref: dict[str, list[dict]]) -> float:
    """Largest weight difference from the reference over EVERY rank of EVERY module group (replicas drift apart
    when a reduction is wrong, and rank 0 alone would not show it)."""
    assert ranks.keys() == ref.keys()
    worst = 0.0
    for m, states in ranks.items():
        want = ref[m][0]
        for state in states:
            assert state.keys() == want.keys(), m
            worst = max(worst, max((state[k] - want[k]).abs().max().item() for k in want))
    return worst


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
        assert worst_rank_difference(state, ref_state) < 1e-5
        ref_full = prefixed(ref_state)
        for prefix in ("visual.", "language."):  # both modules trained: the comparison is not of untouched weights
            moved = max((ref_full[k] - initial[k]).abs().max().item() for k in ref_full if k.startswith(prefix))
            assert moved > 10 * 1e-5, prefix  # ten times the tolerance


# every data-parallel size of each group under each placement (the pairs, not their whole product: each run
# sets both groups and the placement)
LAYOUTS = [(1, 1, "disaggregated"), (2, 1, "collocated"), (1, 2, "disaggregated"), (2, 2, "collocated")]


@pytest.mark.parametrize("vision_dp, text_dp, placement", LAYOUTS)
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
    assert worst_rank_difference(state, ref[1]) < 1e-5
    for rank_state in state["vision"]:  # untouched, on every rank
        assert all(torch.equal(v, ref[2][f"visual.{k}"]) for k, v in rank_state.items())
    assert all(s.timings.get("vision_backward", 0.0) == 0.0 for s in stats)  # no backward at all


def test_adamw_losses_match_reference(ray_cluster, demo_overrides_module):
    adam = ["train.optimizer=adamw", "train.lr=1e-3"]
    ref = run(demo_overrides_module + adam, "local")
    got = run(demo_overrides_module + adam + ["vision.parallel.dp=2", "text.parallel.dp=2"], "ray")
    assert [s.loss for s in got[0]] == pytest.approx([s.loss for s in ref[0]], rel=1e-5)
    assert all(s.comm_bytes == {} for s in got[0])  # a plain step: the comm counter (a dispatch mode) is off


# ---- per-module parallelism (Ulysses SP, TP, ZeRO) and the uniform baselines -------------------------------

# Each run sets a vision layout and a text layout at once (the groups are independent: one run checks both), so
# every feature below is checked against the reference in 9 runs rather than one run per feature.
HYBRID = {
    "vision_sp2__text_tp2_sequence_parallel": ["vision.parallel.sp=2", "text.parallel.tp=2",
                                               "text.parallel.sequence_parallel=true"],
    "vision_sp2_dp2__text_tp2_dp2": ["vision.parallel.sp=2", "vision.parallel.dp=2", "text.parallel.tp=2",
                                     "text.parallel.dp=2"],
    "sp2_tp2_collocated": ["vision.parallel.sp=2", "text.parallel.tp=2", "runtime.placement=collocated"],
    "uniform_tp2_dp2_zero1": ["vision.parallel.tp=2", "vision.parallel.dp=2", "vision.parallel.zero=1",
                              "text.parallel.tp=2", "text.parallel.dp=2", "text.parallel.zero=1"],
    # a replica's whole samples against the text's sequence slices: a sample's rows go to, and their gradients
    # come back from, both text ranks where it straddles the slices' boundary (ZeRO-1 over text dp: the next run)
    "vision_dp2_zero1__text_tp2_sequence_parallel": ["vision.parallel.dp=2", "vision.parallel.zero=1",
                                                     "text.parallel.tp=2", "text.parallel.sequence_parallel=true"],
    "vision_sp2_dp2_zero1__text_tp2_dp2_zero1": ["vision.parallel.sp=2", "vision.parallel.dp=2",
                                                 "vision.parallel.zero=1", "text.parallel.tp=2",
                                                 "text.parallel.dp=2", "text.parallel.zero=1"],  # ZeRO-1 x SP, x TP
    # the loss a few tokens at a time (dhp.models.loss) under FSDP2, against the reference's whole logits
    "zero3_everywhere_chunked_loss": ["vision.parallel.dp=2", "vision.parallel.zero=3", "text.parallel.dp=2",
                                      "text.parallel.zero=3", "train.loss_chunk_tokens=7"],
    "vision_sp2_dp2_zero3__text_tp2_dp2_zero3": ["vision.parallel.sp=2", "vision.parallel.dp=2",
                                                 "vision.parallel.zero=3", "text.parallel.tp=2",
                                                 "text.parallel.dp=2", "text.parallel.zero=3"],  # FSDP2 x SP, 2D x TP
    "activation_checkpointing": ["vision.parallel.sp=2", "vision.activation_checkpointing=true",
                                 "text.activation_checkpointing=true"],
}


@pytest.mark.parametrize("name", sorted(HYBRID))
def test_hybrid_layouts_match_reference(ray_cluster, reference, demo_overrides_module, name):
    over = demo_overrides_module + SGD + ["runtime.placement=disaggregated"] + HYBRID[name]
    assert_same(run(over, "ray"), reference)


def test_text_tp2_matches_reference_and_exports_hf_q_k_v(ray_cluster, reference, demo_overrides_module, tmp_path):
    """Text TP 2 (each rank its own q, k and v heads of the fused GQA qkv_proj) equals the reference, and the HF
    export of its checkpoint holds q_proj, k_proj and v_proj (weights and biases) equal to the reference's."""
    from dhp.models.qwen2_5_vl import read_hf_config
    from dhp.models.qwen2_5_vl.text import text_qkv_sizes

    result = run(demo_overrides_module + SGD + ["text.parallel.tp=2"], "ray", export_to=tmp_path)
    assert_same(result, reference)
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    ref = prefixed(reference[1])
    cfg = read_hf_config(tmp_path / "hf")
    sizes = list(text_qkv_sizes(cfg.text))
    layers = 0
    for key, fused in ref.items():
        if ".self_attn.qkv_proj." not in key:
            continue
        hf = key.replace("language.", "model.", 1).replace("qkv_proj", "{}_proj")
        for part, want in zip("qkv", fused.split(sizes), strict=True):
            assert (exported[hf.format(part)] - want).abs().max().item() < 1e-5, hf.format(part)
        layers += 1
    assert layers == 2 * cfg.text.num_hidden_layers  # weight and bias of every layer
    assert not any("qkv_proj" in k for k in exported)


@pytest.fixture(scope="module")
def mixed_reference(ray_cluster, mixed_data, demo_overrides_module):
    over = [o for o in demo_overrides_module if not o.startswith("data.path=")] + SGD + [f"data.path={mixed_data}"]
    return over, run(over, "local")


@pytest.mark.parametrize("zero", [0, 3])
def test_text_only_samples_mixed_in_under_sp(ray_cluster, mixed_reference, zero):
    """Replicas whose micro-batch has no image at all run, and the result equals the reference. vision dp=2:
    with 2 text-only samples of 4 per round, some replica gets none with images. zero=0: it skips the vision
    forward; zero=3: FSDP2 needs every rank in its collectives, so it runs the encoder on zero tokens (and
    must produce the same set of gradients as its peers)."""
    over, ref = mixed_reference
    got = run(over + ["vision.parallel.sp=2", "vision.parallel.dp=2", "train.micro_batch_size=4",
                      f"vision.parallel.zero={zero}"], "ray")
    assert_same(got, ref)


@pytest.fixture(scope="module")
def mixed_data(demo_data, tmp_path_factory):
    """The demo's image samples interleaved with text-only ones (half of each batch)."""
    import json

    rows = [json.loads(line) for line in demo_data.train.read_text().splitlines()]
    images = [r for r in rows if "image" in r][:16]
    out = []
    for i, r in enumerate(images):
        r = dict(r)
        r["image"] = [str(demo_data.root / p) for p in ([r["image"]] if isinstance(r["image"], str) else r["image"])]
        out.append(r)
        q = {"conversations": [{"from": "human", "value": f"What comes after {i % 9}?"},
                               {"from": "gpt", "value": str(i % 9 + 1)}]}
        out.append(q)
    path = tmp_path_factory.mktemp("mixed") / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def test_comm_counter_per_group(ray_cluster, demo_overrides_module):
    """Per-step collective bytes per group: Ulysses all-to-all only in the vision group (full-attention blocks),
    TP all-reduces in the text group, and gradient all-reduces where ranks hold partial sums."""
    over = demo_overrides_module + SGD + ["vision.parallel.sp=2", "text.parallel.tp=2",
                                          "runtime.count_collectives=true"]  # as dhp bench asks
    stats, _, _ = run(over, "ray")
    comm = stats[0].comm_bytes
    assert comm["vision_all_to_all"] > 0 and "text_all_to_all" not in comm
    assert comm["text_all_reduce"] > 0 and comm["vision_all_reduce"] > 0


def test_uniform_baselines_set_both_modules_alike():
    """A "uniform" baseline runs one layout over the whole model: its vision and text keys must agree
    (uniform_tp2_dp2_zero1 once set only vision keys, leaving its text module at dp 1 x tp 1)."""
    for name, over in HYBRID.items():
        if not name.startswith("uniform"):
            continue
        vision = sorted(o.removeprefix("vision.") for o in over if o.startswith("vision."))
        text = sorted(o.removeprefix("text.") for o in over if o.startswith("text."))
        assert vision == text, name
