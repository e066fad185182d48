"""The collective byte counter (what the runtime reports per group and step) against closed forms."""

from __future__ import annotations

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
