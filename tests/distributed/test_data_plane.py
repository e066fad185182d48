"""The point-to-point data plane between groups (``dhp.runtime.data_plane``), on real Ray actors over gloo.

The parity tests (test_ray_parity.py and the others) prove that disaggregated layouts, which take this data
plane by default, equal the reference. Here: the bytes. Each encoder rank gets back the gradients of its own
rows only (under vision SP, not the whole samples: that would be sp times the bytes); under text TP with
Megatron sequence parallelism each text rank receives only the rows of its sequence slice (each row crosses
once, not tp times), and the run still equals the reference on every rank; under ``train.dtype=bfloat16`` the
rows travel in bfloat16, half the bytes of float32, with the same losses as the single-process reference in
bfloat16. And the loader runs ahead (``dhp.data.loader``): on every encoder rank the ``load`` span of round k+1
starts before round k's forward ends. The slices' routing and placement are also checked without Ray.
"""

from __future__ import annotations

import pytest
import torch

from dhp.backends import make_backend
from dhp.config import load_config
from dhp.engine import assemble_slice, sequence_slice, slot_positions
from dhp.inputs import prepare
from dhp.runtime.cluster import resolve_data_plane
from dhp.runtime.data_plane import Incoming, rows_by_receiver

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


def test_router_bytes_own_rows_slices_and_bfloat16(ray_cluster, base) -> None:
    """Vision SP 2 -> text TP 2 with Megatron SP: every row crosses once each way (each SP rank sends each text
    rank the rows of that rank's sequence slice, 1/tp of the replica's rows on average, and gets back their
    gradients from there), and the run equals the reference, losses and every rank's weights."""
    layout = ["runtime.placement=disaggregated", "vision.parallel.sp=2", "text.parallel.tp=2",
              "text.parallel.sequence_parallel=true"]
    f32, f32_states, plans = run_with_states(base + layout, "ray")
    ref, ref_states, _ = run_with_states(base, "local")
    bf16, _ = run_steps(base + layout + ["train.dtype=bfloat16"], "ray")
    ref_bf16, _ = run_steps(base + ["train.dtype=bfloat16"], "local")
    run_ = prepare(load_config(None, base))
    width, image_tokens = run_.inputs.model_cfg.text.hidden_size, placeholders_per_sample(run_)
    for step, plan in zip(f32, plans, strict=True):
        fwd, bwd = step.router_bytes_by_direction["forward"], step.router_bytes_by_direction["backward"]
        rows = (fwd - bwd) // INDEX_BYTES  # embeddings carry an index per row, their gradients do not
        # the step's image tokens, each received by one text rank only (all of them by each would be tp x)
        assert rows == sum(image_tokens[i] for i in plan.sample_ids) > 0
        assert fwd == rows * (4 * width + INDEX_BYTES)
        # each SP rank gets back exactly the gradients of the rows it sent: sp x fewer bytes than whole samples
        assert bwd == rows * 4 * width
        assert step.router_bytes == fwd + bwd
    assert [s.loss for s in f32] == pytest.approx([s.loss for s in ref], rel=1e-5)
    assert [s.grad_norm for s in f32] == pytest.approx([s.grad_norm for s in ref], rel=1e-4)
    for m, per_rank in f32_states.items():  # every rank of every group
        for state in per_rank:
            assert max((state[k] - ref_states[m][0][k]).abs().max().item() for k in state) < 1e-5, m
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


def placeholders_per_sample(run_) -> dict[int, int]:
    """Sample id -> its vision placeholder tokens (what crosses the router for it), from the data set's index."""
    token_ids = run_.inputs.family.module("vision").placeholder_ids(run_.inputs.model_cfg)
    return {i: sum(run_.dataset.info(i).token_counts.get(t, 0) for t in token_ids) for i in range(len(run_.dataset))}


# ---- Megatron SP slices, without Ray -------------------------------------------------------------------------

def test_sequence_slices_route_each_row_to_the_rank_that_keeps_it() -> None:
    """An encoder rank's rows go, per text TP rank, to the rank whose sequence slice holds their placeholder."""
    assert [sequence_slice(10, 4, r) for r in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 12)]  # padded to 12
    assert sequence_slice(8, 1, 0) == (0, 8)
    with pytest.raises(ValueError, match="rank 2 of tp 2"):
        sequence_slice(8, 2, 2)
    pad, a, b = 7, 9, 8  # placeholder ids; two samples packed [s0 (10 tokens), s1 (6 tokens)]: 16 tokens
    s0 = torch.tensor([1, a, a, 2, a, b, b, 3, a, 4])  # token index order: the a's (1, 2, 4, 8), then b's (5, 6)
    s1 = torch.tensor([a, a, 5, pad, pad, a])
    slots = {0: slot_positions(s0, (a, b)), 1: slot_positions(s1, (a, b))}
    assert slots[0].tolist() == [1, 2, 4, 8, 5, 6] and slots[1].tolist() == [0, 1, 5]
    # this rank (e.g. one of two vision SP ranks) holds tokens 0, 3, 5 of s0 and 1, 2 of s1
    pieces = {0: (torch.tensor([0, 3, 5]), {"embeds": torch.arange(3.0)[:, None].repeat(1, 2)}),
              1: (torch.tensor([1, 2]), {"embeds": 10 + torch.arange(2.0)[:, None].repeat(1, 2)})}
    receivers = [(40 + t, *sequence_slice(16, 2, t)) for t in range(2)]  # slices [0, 8), [8, 16)
    got = rows_by_receiver(pieces, [0, 1], {0: 0, 1: 10}, slots, receivers, torch.device("cpu"))
    # flat positions: s0 tokens 0, 3, 5 -> 1, 8, 6; s1 tokens 1, 2 -> 11, 15
    (r0, c0, i0, x0), (r1, c1, i1, x1) = got
    assert (r0, c0, i0.tolist(), x0["embeds"][:, 0].tolist()) == (40, ((0, 2),), [0, 5], [0.0, 2.0])
    assert (r1, c1, i1.tolist(), x1["embeds"][:, 0].tolist()) == (41, ((0, 1), (1, 2)), [3, 1, 2], [1.0, 10.0, 11.0])
    inc = Incoming("vision", 3, ((0, 3), (1, 2)), (("embeds", 2, "float32"),), parts=((40, c0), (41, c1)))
    assert inc.sliced and inc.for_receiver(41).rows == c1 and inc.for_receiver(42) is None
    assert not Incoming("vision", 3, ((0, 3),), (("embeds", 2, "float32"),)).sliced


def test_a_slice_is_assembled_in_token_order_and_checked() -> None:
    mine = torch.tensor([1, 2, 5])  # this rank's token indices of a 6-token sample
    pieces = [(torch.tensor([5, 1]), {"embeds": torch.tensor([[5.0], [1.0]])}),
              (torch.tensor([2]), {"embeds": torch.tensor([[2.0]])})]
    rows, token_rows = assemble_slice(pieces, mine, 6, 0, "vision", torch.device("cpu"))
    assert rows["embeds"][:, 0].tolist() == [1.0, 2.0, 5.0] and token_rows[torch.tensor([5, 2])].tolist() == [2, 1]
    with pytest.raises(RuntimeError, match="sample 0: 1 vision embeddings arrived for the 3 slots"):
        assemble_slice(pieces[1:], mine, 6, 0, "vision", torch.device("cpu"))


def test_embed_places_a_slice_as_the_whole_placement_does() -> None:
    """``TextModel.embed`` given a rank's slice rows: the same residual stream in that slice as with every row,
    and the same gradients of the embedding table and of those rows (other placeholder slots zeroed)."""
    from dhp.models.qwen2_5_vl.config import tiny
    from dhp.models.qwen2_5_vl.text import TextModel

    torch.manual_seed(0)
    cfg = tiny()
    pad = 7
    model = TextModel(cfg.text, pad)
    ids = torch.tensor([[1, pad, pad, 2, pad, pad, 3, 4, pad, 5, 6]])  # 11 tokens: tp 2 slices [0, 6), [6, 12)
    slots = (ids.reshape(-1) == pad).nonzero().flatten()
    media = torch.randn(len(slots), cfg.text.hidden_size)
    weight = torch.randn(1, ids.shape[1], cfg.text.hidden_size)

    def grads(x: torch.Tensor, lo: int, hi: int, leaf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad()
        (x[:, lo:hi] * weight[:, lo:hi]).sum().backward()
        return model.embed_tokens.weight.grad.clone(), leaf.grad

    for lo, hi in (sequence_slice(11, 2, r) for r in range(2)):
        whole = media.clone().requires_grad_()
        x = model.embed(ids, {pad: whole}, {pad: slots})
        mine = ((slots >= lo) & (slots < hi)).nonzero().flatten()
        part = media[mine].clone().requires_grad_()
        y = model.embed(ids, {pad: (part, slots[mine])}, {pad: slots})
        assert torch.equal(x[:, lo:hi], y[:, lo:hi])
        others = slots[(slots < lo) | (slots >= hi)]
        assert torch.count_nonzero(y.reshape(-1, y.shape[-1])[others]) == 0
        table, rows = grads(x, lo, hi, whole)
        table_y, rows_y = grads(y, lo, hi, part)
        assert torch.equal(table, table_y) and torch.equal(rows[mine], rows_y)
    with pytest.raises(ValueError, match="2 placeholder tokens .id 7. in the input but 1 embeddings"):
        model.embed(ids, {pad: (media[:1], slots[:2])}, {pad: slots})


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
