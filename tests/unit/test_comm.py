"""The collective byte counter (what the runtime reports per group and step) against closed forms."""

from __future__ import annotations

import torch
import torch.distributed as dist

from dhp.parallel.comm import CommCounter
from tests.dist_utils import run_distributed


def _ulysses(rank: int, world: int) -> dict:
    from dhp.models.qwen2_5_vl.config import tiny
    from dhp.models.qwen2_5_vl.vision import VisionTransformer, init_weights, vision_layout
    from dhp.parallel.ulysses import parallelize_vision_sp, shard_vision, sp_forward

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
    forward = dict(counter.bytes)
    with counter:
        out.square().sum().backward()
    return {"forward": forward, "total": dict(counter.bytes), "calls": dict(counter.calls),
            "split_sizes": shards[rank].split_sizes}


def test_ulysses_all_to_all_bytes_match_closed_form():
    """Per full-attention block, rank r with S_r of S patches, H heads of hd, 4-byte floats:
    forward sends qkv [S_r, 3H, hd] and the heads-sharded output [S, H/sp, hd]; backward the reverses.
    Window blocks send nothing."""
    from dhp.models.qwen2_5_vl.config import tiny

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
