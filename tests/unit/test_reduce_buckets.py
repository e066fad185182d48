"""Gradient reduction in buckets (``dhp.parallel.grad_buckets``) sums exactly what one all-reduce per gradient
sums, on real gloo ranks: mixed dtypes, non-contiguous gradients, gradients larger than a bucket; and started from
the last backward's hooks, in bucket order on every rank, even when one rank's last backward does nothing."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tests.spawn import run_distributed


def _grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return [torch.randn(5, 3, generator=g), torch.randn(7, generator=g), torch.randn(4, 6, generator=g).t(),
            torch.randn(300, generator=g), torch.randn(3, generator=g).to(torch.bfloat16), torch.randn(2, generator=g)]


def _worker(rank: int, world_size: int) -> dict:
    from dhp.parallel.grad_buckets import reduce_in_buckets

    bucketed, single = _grads(rank), _grads(rank)
    reduce_in_buckets(bucketed, dist.group.WORLD, bucket_bytes=128)  # 300 floats: larger than a bucket
    for t in single:
        dist.all_reduce(t)
    return {"bucketed": bucketed, "single": single}


def test_buckets_sum_like_one_all_reduce_per_gradient() -> None:
    for out in run_distributed(_worker, 2):
        for b, s, before in zip(out["bucketed"], out["single"], _grads(0), strict=True):
            assert b.dtype == s.dtype and b.shape == s.shape
            assert torch.equal(b, s)
            assert not torch.equal(b, before)  # summed: not rank 0's own values


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1),
                         nn.Linear(3, 3))  # the last: used in step 2 only


def _micro_batches(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(10 + rank)
    return [torch.randn(4, 6, generator=g) for _ in range(3)]


def _loss(model: nn.Module, x: torch.Tensor, step: int) -> torch.Tensor:
    loss = model[:5](x).pow(2).sum()
    return loss + model[5](x[:, :3]).sum() if step == 1 else loss


def _reducer_worker(rank: int, world_size: int) -> dict:
    from dhp.parallel.grad_buckets import GradientReducer

    model = _model()
    params = list(model.parameters())
    reducer = GradientReducer(params, dist.group.WORLD, bucket_bytes=300)  # several buckets
    out = {"grads": [], "started": [], "buckets": len(reducer.buckets)}
    for step in range(2):
        batches = _micro_batches(rank)
        last = len(batches) - 1 if rank == 0 else len(batches) - 2  # rank 1: its last round has nothing to do
        for k, x in enumerate(batches[: last + 1]):
            if k == last:
                reducer.arm()
            _loss(model, x, step).backward()
        out["started"].append(len(reducer._launched))  # buckets started from the backward, before finish
        reducer.finish()
        out["grads"].append([p.grad.clone() for p in params])
        for p in params:
            p.grad = None
    return out


def _expected(step: int) -> list[torch.Tensor]:
    model = _model()
    for rank, n in ((0, 3), (1, 2)):
        for x in _micro_batches(rank)[:n]:
            _loss(model, x, step).backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def test_reducer_started_from_the_backward_sums_every_rank() -> None:
    """Step 1: the never-used layer holds its bucket back (nothing is known yet). Step 2: the buckets start
    from the backward, without it; it then gets a gradient after its bucket left, and that bucket is summed
    again on both ranks. Every step's sums equal the reference on every rank."""
    outs = run_distributed(_reducer_worker, 2)
    assert outs[0]["buckets"] > 2
    assert outs[0]["started"][0] == 0 and outs[0]["started"][1] > 0
    for step in range(2):
        want = _expected(step)
        for out in outs:
            for got, ref in zip(out["grads"][step], want, strict=True):
                torch.testing.assert_close(got, ref)
