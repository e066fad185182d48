"""The point-to-point data plane between groups (``dhp.runtime.data_plane``), on real Ray actors over gloo.

The parity tests (test_ray_parity.py and the others) prove that disaggregated layouts, which take this data
plane by default, equal the reference. Here: the bytes. Each encoder rank gets back the gradients of its own
rows only (under vision SP, not the whole samples: that would be sp times the bytes), and under
``train.dtype=bfloat16`` the rows travel in bfloat16, half the bytes of float32, with the same losses as the
single-process reference in bfloat16. And the loader runs ahead (``dhp.data.loader``): on every encoder rank the
``load`` span of round k+1 starts before round k's forward ends.
"""

from __future__ import annotations

import pytest

from dhp.backends import make_backend
from dhp.config import load_config
from dhp.inputs import prepare
from dhp.runtime.cluster import resolve_data_plane

INDEX_BYTES = 8  # each row's token index travels with it (int64)


def run_steps(overrides: list[str], backend_name: str, steps: int = 2):
    cfg = load_config(None, overrides + [f"runtime.backend={backend_name}", "runtime.cpus_per_worker=0.5"])
    run_ = prepare(cfg)
    backend = make_backend(run_.inputs, run_.dataset, run_.spec)
    try:
        return [backend.run_step(run_.planner.plan(s)) for s in range(steps)], run_.inputs.model_cfg
    finally:
        backend.shutdown()


@pytest.fixture(scope="module")
def base(demo_data, tmp_path_factory) -> list[str]:
    return [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1",
            f"output.dir={tmp_path_factory.mktemp('run')}", "train.optimizer=sgd", "train.lr=0.05"]


def test_data_plane_choice() -> None:
    assert resolve_data_plane("auto", "disaggregated", "gloo", 0.0) == "p2p"  # CI runs the GPU data plane
    assert resolve_data_plane("auto", "disaggregated", "nccl", 1.0) == "p2p"
    assert resolve_data_plane("auto", "collocated", "nccl", 0.5) == "cuda_ipc"  # one GPU: no host copy
    assert resolve_data_plane("auto", "disaggregated", "nccl", 0.5) == "cuda_ipc"  # fractional GPUs share one
    assert resolve_data_plane("auto", "collocated", "gloo", 0.0) == "ray"  # CPU workers taking turns
    assert resolve_data_plane("p2p", "collocated", "gloo", 0.0) == "p2p"
    assert resolve_data_plane("direct", "disaggregated", "nccl", 1.0) == "ray"
    assert resolve_data_plane("object_store", "disaggregated", "gloo", 0.0) == "ray"
    with pytest.raises(ValueError, match="cuda_ipc needs workers on CUDA"):
        resolve_data_plane("cuda_ipc", "collocated", "gloo", 0.0)
    with pytest.raises(ValueError, match="NCCL cannot join two ranks of one GPU"):
        resolve_data_plane("p2p", "collocated", "nccl", 0.5)
    with pytest.raises(ValueError, match="runtime.transport must be one of"):
        resolve_data_plane("carrier_pigeon", "collocated", "gloo", 0.0)


def test_router_bytes_own_rows_and_bfloat16(ray_cluster, base) -> None:
    layout = ["runtime.placement=disaggregated", "vision.parallel.sp=2"]
    f32, model_cfg = run_steps(base + layout, "ray")
    bf16, _ = run_steps(base + layout + ["train.dtype=bfloat16"], "ray")
    ref_bf16, _ = run_steps(base + ["train.dtype=bfloat16"], "local")
    width = model_cfg.text.hidden_size
    for step in f32:
        fwd, bwd = step.router_bytes_by_direction["forward"], step.router_bytes_by_direction["backward"]
        rows = (fwd - bwd) // INDEX_BYTES  # embeddings carry an index per row, their gradients do not
        assert rows > 0 and fwd == rows * (4 * width + INDEX_BYTES)
        # each SP rank gets back exactly the gradients of the rows it sent: sp x fewer bytes than whole samples
        assert bwd == rows * 4 * width
        assert step.router_bytes == fwd + bwd
    for a, b in zip(f32, bf16, strict=True):
        fa, ba = a.router_bytes_by_direction["forward"], a.router_bytes_by_direction["backward"]
        fb, bb = b.router_bytes_by_direction["forward"], b.router_bytes_by_direction["backward"]
        index = fa - ba  # the same rows, the same index bytes
        assert 2 * bb == ba  # gradients: bfloat16, half of float32
        assert 2 * (fb - index) == fa - index  # embeddings (index bytes aside): half
    assert [s.loss for s in bf16] == pytest.approx([s.loss for s in ref_bf16], rel=1e-3)
    for s in f32:  # the waits are reported per group: for the router, for the loader
        assert s.timings["text_router_wait"] >= 0.0 and s.timings["vision_router_wait"] >= 0.0
        assert 0.0 <= s.timings["vision_data_wait"] <= s.timings["vision_forward"]
    for step in f32:  # the loader runs ahead: round 1's load starts before round 0's forward ends, on each rank
        for rank in (0, 1):
            spans = [s for s in step.spans if s["module"] == "vision" and s["rank"] == rank]
            load = next(s for s in spans if s["phase"] == "load" and s["round"] == 1)
            forward = next(s for s in spans if s["phase"] == "forward" and s["round"] == 0)
            assert load["start"] < forward["end"] and load["end"] is not None


def test_collocated_encoder_replicas_work_at_once(ray_cluster, base) -> None:
    """Collocated vision DP 4 + text TP 2 x DP 1, micro-batch 1: each round holds one sample, so only an encoder
    window (``runtime.encoder_window``, auto: 4 rounds here) gives every vision replica one; the four replicas'
    forwards then all start before the first text round ends, and the run equals the reference.

    (Text TP 2: the tiny model's 2 key/value heads allow no more.)"""
    over = base + ["train.micro_batch_size=1", "train.momentum=0.9"]
    layout = ["runtime.placement=collocated", "vision.parallel.dp=4", "text.parallel.tp=2"]
    got, states, plans = run_with_states(over + layout, "ray")
    ref, ref_states, _ = run_with_states(over, "local")
    assert [s.loss for s in got] == pytest.approx([s.loss for s in ref], rel=1e-5)
    assert [s.grad_norm for s in got] == pytest.approx([s.grad_norm for s in ref], rel=1e-4)
    for m, per_rank in states.items():  # every rank of every group
        for state in per_rank:
            assert max((state[k] - ref_states[m][0][k]).abs().max().item() for k in state) < 1e-5, m
    for plan, step in zip(plans, got, strict=True):
        assert plan.window == 4 and all(len(r.replicas("text")[0]) == 1 for r in plan.rounds)
        own_round = {}  # vision replica q -> the round whose sample it encodes
        for j, rnd in enumerate(plan.rounds):
            for q, ids in enumerate(rnd.replicas("vision")):
                if ids:
                    own_round[q] = j
        assert sorted(own_round) == [0, 1, 2, 3]  # every replica has a sample (each in a different round)
        forwards = [next(s for s in step.spans if s["module"] == "vision" and s["rank"] == q
                         and s["phase"] == "forward" and s["round"] == j) for q, j in own_round.items()]
        # none waits for a text round: all four are in flight before the step's first text round is done (one
        # round at a time, replica q's forward would start after text round q-1 ended). Whether the four spans
        # also overlap each other depends on how the two shared cores are scheduled, so it is not asserted.
        first_text_end = min(s["end"] for s in step.spans if s["module"] == "text"
                             and s["phase"] == "forward_backward")
        assert all(s["start"] < first_text_end for s in forwards)


def run_with_states(overrides: list[str], backend_name: str, steps: int = 2):
    """Steps' stats, every rank's weights afterwards and the steps' plans."""
    cfg = load_config(None, overrides + [f"runtime.backend={backend_name}", "runtime.cpus_per_worker=0.5"])
    run_ = prepare(cfg)
    backend = make_backend(run_.inputs, run_.dataset, run_.spec)
    plans = [run_.planner.plan(s) for s in range(steps)]
    try:
        return [backend.run_step(p) for p in plans], backend.rank_state_dicts(), plans
    finally:
        backend.shutdown()
