"""The collective byte counter (what the runtime reports per group and step) against closed forms."""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed as dist

from dhp.parallel.comm import CommCounter
from tests.dist_utils import run_distributed


def _ulysses(rank: int, world: int) -> dict:
    from dhp.models.qwen2_5_vl.config import tiny
    from dhp.models.qwen2_5_vl.sequence_parallel import parallelize_vision_sp, shard_vision, sp_forward
    from dhp.models.qwen2_5_vl.vision import VisionTransformer, init_weights, vision_layout

    cfg = tiny().vision
    torch.manual_seed(0)
    model = VisionTransformer(cfg)
    init_weights(model, 0.02)
    parallelize_vision_sp(model, dist.group.WORLD)
    grid = torch.tensor([[1, 12, 20], [1, 8, 8]])
    pixels = torch.randn(int(grid.prod(-1).sum()), cfg.patch_dim, generator=torch.Generator().manual_seed(1))
    shards = shard_vision(vision_layout(grid, cfg), world)
    counter = CommCounter()
    with counter:
        out = sp_forward(model, pixels, shards[rank], dist.group.WORLD)
    forward, forward_sent = dict(counter.bytes), dict(counter.sent)
    with counter:
        out.square().sum().backward()
    return {"forward": forward, "total": dict(counter.bytes), "calls": dict(counter.calls),
            "forward_sent": forward_sent, "total_sent": dict(counter.sent), "split_sizes": shards[rank].split_sizes}


def test_ulysses_all_to_all_bytes_match_closed_form():
    """Per full-attention block, rank r with S_r of S patches, H heads of hd, 4-byte floats:
    forward sends qkv [S_r, 3H, hd] and the heads-sharded output [S, H/sp, hd]; backward the reverses.
    Window blocks send nothing. Of that payload, what goes to other ranks is ``expected_alltoall_bytes``."""
    from dhp.models.qwen2_5_vl.config import tiny
    from dhp.parallel.ulysses import expected_alltoall_bytes

    cfg = tiny().vision
    sp, hd, heads = 2, cfg.head_dim, cfg.num_heads
    n_full = len(cfg.fullatt_block_indexes)
    for rank, res in enumerate(run_distributed(_ulysses, sp)):
        s_r, s = res["split_sizes"][rank], sum(res["split_sizes"])
        fwd = n_full * 4 * hd * (3 * s_r * heads + s * heads // sp)
        bwd = n_full * 4 * hd * (s_r * heads + 3 * s * heads // sp)
        assert res["forward"] == {"all_to_all": fwd}
        assert res["total"] == {"all_to_all": fwd + bwd}
        assert res["calls"] == {"all_to_all": 4 * n_full}
        closed = [expected_alltoall_bytes(res["split_sizes"], rank, heads, hd, 4, n_full, backward=b)
                  for b in (False, True)]
        assert 0 < closed[0] < fwd
        assert res["forward_sent"] == {"all_to_all": closed[0]}
        assert res["total_sent"] == {"all_to_all": closed[1]}


def _all_to_all_uneven(rank: int, world: int) -> dict:
    """Rank r sends rows_to[r][j] rows of 3 floats to rank j; then one equal-split all-to-all of 6 rows of 2."""
    import torch.distributed._functional_collectives as fc

    rows_to = [[1, 2, 3], [4, 0, 5], [0, 0, 6]]
    send = rows_to[rank]
    counter = CommCounter()
    with counter:
        out = torch.empty(sum(rows_to[j][rank] for j in range(world)), 3)
        dist.all_to_all_single(out, torch.full((sum(send), 3), float(rank)), output_split_sizes=[
            rows_to[j][rank] for j in range(world)], input_split_sizes=send)
        dist.all_to_all_single(torch.empty(6, 2), torch.ones(6, 2))
        functional = fc.all_to_all_single(torch.ones(sum(send), 3), [rows_to[j][rank] for j in range(world)],
                                          send, dist.group.WORLD)
        fc.wait_tensor(functional)
        dist.all_reduce(torch.ones(7))
    return {"bytes": dict(counter.bytes), "sent": dict(counter.sent), "calls": dict(counter.calls),
            "out": out[:, 0].tolist()}


def test_all_to_all_sent_leaves_out_the_own_chunk():
    """``sent`` is the input less the rows a rank addresses to itself (uneven splits, equal splits, the functional
    op); all-reduce traffic depends on the algorithm and is left out of it, ``bytes`` counts whole inputs."""
    rows_to = [[1, 2, 3], [4, 0, 5], [0, 0, 6]]
    for rank, res in enumerate(run_distributed(_all_to_all_uneven, 3)):
        rows = sum(rows_to[rank])
        others = rows - rows_to[rank][rank]
        assert res["out"] == [float(j) for j in range(3) for _ in range(rows_to[j][rank])]  # the splits were real
        assert res["sent"] == {"all_to_all": 4 * (3 * others + 2 * 4 + 3 * others)}  # 4 of 6 equal rows leave
        assert res["bytes"] == {"all_to_all": 4 * (3 * rows + 2 * 6 + 3 * rows), "all_reduce": 4 * 7}
        assert res["calls"] == {"all_to_all": 3, "all_reduce": 1}


def _tp_linear(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    parallelize_module(mlp, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel(), "1": RowwiseParallel()})
    x = torch.randn(5, 8, requires_grad=True)
    counter = CommCounter()
    with counter:
        mlp(x).sum().backward()
        dist.all_reduce(torch.ones(10))
    return {"bytes": dict(counter.bytes), "calls": dict(counter.calls)}


def test_tensor_parallel_and_plain_all_reduce_bytes():
    """Megatron MLP: one all-reduce of the [5, 8] output forward, one of the input gradient backward; plus 10."""
    for res in run_distributed(_tp_linear, 2):
        assert res["bytes"] == {"all_reduce": 4 * (5 * 8 + 5 * 8 + 10)}
        assert res["calls"] == {"all_reduce": 3}


def _bf16_text_tp_sp(rank: int, world: int) -> dict:
    """One bf16 step of the tiny language model under TP 2 with Megatron SP: the decoder's forward and backward
    (float32 master weights under autocast, then pure bf16 parameters), and the vocab-parallel loss apart."""
    from torch.distributed.device_mesh import DeviceMesh

    from dhp.engine import cast_parameters
    from dhp.models.qwen2_5_vl import build_model
    from dhp.models.qwen2_5_vl.parallelize import parallelize_text
    from tests.unit.test_tensor_parallel import text_cfg, text_inputs

    out = {}
    for policy in ("fp32_master", "bf16"):
        cfg = text_cfg()
        text = build_model(cfg, seed=0).language
        if policy == "bf16":
            cast_parameters(text, torch.bfloat16)
        parallelize_text(text, DeviceMesh("cpu", list(range(world))), sequence_parallel=True)
        x = text_inputs(cfg)
        args = (x["input_ids"], x["position_ids"], x["image_embeds"], x["cu_seqlens"])
        decoder, loss = CommCounter(), CommCounter()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with decoder:
                hidden = text.hidden_states(*args)  # [1, T/tp, D]: this rank's sequence shard
                hidden.float().square().sum().backward()
            with loss:
                text.loss_sum(x["input_ids"], x["position_ids"], x["targets"], *args[2:]).backward()
        out[policy] = {"hidden": str(hidden.dtype), "decoder": dict(decoder.dtypes), "loss": dict(loss.dtypes),
                       "n_norms": sum(1 for n, _ in text.named_parameters() if "norm" in n)}
    return out


def test_bf16_text_tp_sp_collectives_carry_bf16():
    """Every collective of the decoder's forward and backward (the embedding's all-reduce, Megatron SP's
    all-gathers and reduce-scatters, activation gradients) carries bfloat16. What stays float32 is by design:
    the norms' gradient all-reduce when the master weights are float32 (one per norm weight), and the
    vocab-parallel loss's float32 log-sum-exp pieces. With pure bf16 parameters the gradients are bf16 too."""
    for res in run_distributed(_bf16_text_tp_sp, 2):
        master, pure = res["fp32_master"], res["bf16"]
        assert master["hidden"] == pure["hidden"] == "torch.bfloat16"
        kinds = {kind for kind, _ in master["decoder"]}
        assert {"all_reduce", "all_gather", "reduce_scatter"} <= kinds, master["decoder"]
        fp32 = {k: n for k, n in master["decoder"].items() if k[1] != "bfloat16"}
        assert fp32 == {("all_reduce", "float32"): master["n_norms"]}, master["decoder"]
        assert {dt for _, dt in pure["decoder"]} == {"bfloat16"}, pure["decoder"]
        assert sum(pure["decoder"].values()) == sum(master["decoder"].values())
        assert {dt for _, dt in master["loss"]} <= {"bfloat16", "float32", "int64"}, master["loss"]


def _worker_counting(rank: int, world: int) -> dict:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from dhp.backends.ray_workers import LanguageWorker
    from dhp.config import load_config

    seen = {}
    for flag in (False, True):
        worker = LanguageWorker()
        cfg = load_config(None, [f"runtime.count_collectives={str(flag).lower()}"])
        worker._set_counting(SimpleNamespace(cfg=cfg))  # the part of EngineInit it reads
        t = torch.ones(8)
        with worker.counting():
            mode = _get_current_dispatch_mode()
            dist.all_reduce(t)
            torch.nn.functional.linear(t, torch.eye(8))  # an op that is not a collective
        dist.all_reduce(t)  # outside the worker's call: not counted
        seen[flag] = (mode, worker.comm.snapshot() if worker.comm is not None else None)
    return seen


def test_workers_count_collectives_only_where_asked():
    """No worker runs a dispatch mode (every aten op would pass through Python), counting or not;
    ``runtime.count_collectives=true`` (``dhp bench`` sets it) puts the counter around the worker's calls, and
    only the collectives run inside them are counted."""
    from dhp.config import load_config

    for seen in run_distributed(_worker_counting, 2):
        assert seen[False] == (None, None)
        assert seen[True] == (None, {"all_reduce": 32})
    assert load_config(None, []).runtime.count_collectives is False  # off by default


def test_counters_nest_and_count_nothing_once_ended():
    """Nested counters both count; after the outer one ends, collectives of both paths (``c10d``, DTensor's
    functional all-reduce) still run, and no counter counts them."""
    for outer, inner, after, value in run_distributed(_nested_counters, 2):
        assert outer == {"all_reduce": 2, "broadcast": 1} and inner == {"broadcast": 1}
        assert after == {"all_reduce": 2, "broadcast": 1}  # unchanged by the calls after the block
        assert value == 2.0  # a functional all-reduce of ones over 2 ranks, run after the counters


def _nested_counters(rank: int, world: int) -> tuple:
    import torch.distributed._functional_collectives as funcol

    outer, inner = CommCounter(), CommCounter()
    t = torch.ones(4)
    with outer:
        dist.all_reduce(t)
        with inner:
            dist.broadcast(t, 0)
        dist.all_reduce(t)
    before = dict(outer.calls)
    dist.all_reduce(t)
    summed = funcol.wait_tensor(funcol.all_reduce(torch.ones(2), "sum", dist.group.WORLD))
    return before, dict(inner.calls), dict(outer.calls), float(summed[0])
