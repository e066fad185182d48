"""Tensor-parallel helpers: divisibility checks, a vocab-parallel cross entropy, a placement-aware grad norm.

Why these exist beside ``torch.distributed.tensor.parallel``:

- ``vocab_parallel_cross_entropy_sum``: with a vocab-parallel ``lm_head`` the
  logits ``[T, V]`` stay sharded on V (every rank holds ``[T, V/tp]``).
  PyTorch's ``loss_parallel()`` computes the same loss, but its backward only
  works while the context manager is still open (checked on torch 2.13:
  ``loss.backward()`` outside it fails with "aten.nll_loss_backward got mixed
  torch.Tensor and DTensor"). Our workers return the loss from ``loss_sum``
  and call ``backward`` later, elsewhere, so the loss is a plain autograd
  function here (Megatron's formulation: all-reduce of the row max, of the
  sum of exponentials and of the target logit; the softmax never leaves its
  shard). It returns a plain replicated float32 scalar.
- ``grad_norm_sq``: a module after TP/FSDP holds any mix of plain tensors and
  DTensors (the result stays on the device: the step reads it once, for
  clipping and the log). Each shard must be counted once and each replica once; the
  squared norm of a DTensor's local shard is summed over exactly the mesh
  dimensions on which it is sharded, so the answer is right for TP
  (``Shard``), FSDP2 (``Shard(0)`` over dp) and replicated parameters alike.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

IGNORE_INDEX = -100


def heads_problem(key: str, size: int, heads: int, what: str) -> str | None:
    """The one rule of head-parallel layouts (tensor parallelism, Ulysses SP): every rank holds whole heads, so
    ``size`` must divide ``heads``. The problem in words (``key`` names the setting), or None. Families'
    ``check_layout`` (before any worker starts) and the parallelize functions (``check_tp``) both use it."""
    if size < 1:
        return f"{key}={size} must be >= 1"
    if heads % size:
        return f"{key}={size} must divide the {what} ({heads})"
    return None


def check_tp(num_kv_heads: int, tp: int, what: str = "text") -> None:
    """Raise ValueError unless ``tp`` divides the number of KV heads (each rank must own whole KV heads)."""
    problem = heads_problem(f"{what}.parallel.tp", tp, num_kv_heads, "key/value heads")
    if problem:
        raise ValueError(problem)


def check_vision_tp(num_heads: int, tp: int) -> None:
    """Raise ValueError unless ``tp`` divides the vision attention heads."""
    problem = heads_problem("vision.parallel.tp", tp, num_heads, "vision heads")
    if problem:
        raise ValueError(problem)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local shard (sharing its storage); any other tensor as it is."""
    return t.to_local() if isinstance(t, DTensor) else t


def shard_range(size: int, mesh: DeviceMesh, mesh_dim: int = 0) -> tuple[int, int]:
    """[start, end) of this rank's piece of a dimension of ``size`` under ``Shard`` on ``mesh_dim``.

    DTensor cuts a dimension as ``torch.chunk`` does (pieces of ceil(size/n), the last ones shorter or empty).
    """
    n, rank = mesh.size(mesh_dim), mesh.get_local_rank(mesh_dim)
    step = -(-size // n)
    start = min(rank * step, size)
    return start, min(start + step, size)


class _VocabParallelCE(torch.autograd.Function):
    """Summed CE over local logit shards ``[N, V_local]`` (float32) whose columns are ``[start, end)`` of V."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx, logits: torch.Tensor, targets: torch.Tensor, start: int, end: int, group: dist.ProcessGroup
    ) -> torch.Tensor:
        row_max = logits.max(dim=-1).values if logits.shape[-1] else logits.new_full(logits.shape[:1], -torch.inf)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - row_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        dist.all_reduce(sum_exp, group=group)

        valid = targets != IGNORE_INDEX
        local = (targets >= start) & (targets < end) & valid
        local_idx = torch.where(local, targets - start, torch.zeros_like(targets))
        if logits.shape[-1]:
            target_logit = shifted.gather(-1, local_idx.unsqueeze(-1)).squeeze(-1) * local
        else:  # more ranks than vocabulary pieces: this rank holds no column
            target_logit = logits.new_zeros(logits.shape[:1])
        dist.all_reduce(target_logit, group=group)

        per_token = (sum_exp.log() - target_logit) * valid
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_idx, local, valid)
        return per_token.sum()

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):  # type: ignore[override]
        softmax, local_idx, local, valid = ctx.saved_tensors
        # d(sum CE)/d logits = softmax - onehot(target), on supervised rows only; in place on the saved softmax
        # (no second copy of [N, V/tp]), so this backward runs once (no retain_graph)
        grad = softmax
        if grad.shape[-1]:
            grad.scatter_add_(-1, local_idx.unsqueeze(-1), -local.to(grad.dtype).unsqueeze(-1))
        grad.mul_(valid.to(grad.dtype).unsqueeze(-1) * grad_loss)
        return grad, None, None, None, None


def vocab_parallel_cross_entropy_sum(logits: DTensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed CE (float32, ignore_index=-100) of logits ``[..., V]`` sharded on V, without gathering them.

    ``logits``: a DTensor on a 1-D TP mesh with placement ``Shard(-1)`` (the lm_head's output); ``targets``
    the same leading shape, a plain tensor equal on every rank. Returns a plain scalar, equal on every rank,
    whose backward gives every rank the gradient of its own logit shard.
    """
    if not isinstance(logits, DTensor):
        raise TypeError("vocab_parallel_cross_entropy_sum expects DTensor logits sharded on the vocabulary")
    mesh = logits.device_mesh
    ndim = logits.ndim
    if mesh.ndim != 1 or len(logits.placements) != 1 or logits.placements[0] not in (Shard(-1), Shard(ndim - 1)):
        raise ValueError(f"logits must be Shard(-1) on a 1-D mesh, got {logits.placements} on {mesh}")
    vocab = logits.shape[-1]
    start, end = shard_range(vocab, mesh)
    local = logits.to_local()
    local = local.reshape(-1, local.shape[-1]).float()
    return _VocabParallelCE.apply(local, targets.reshape(-1).to(local.device), start, end, mesh.get_group())


def grad_norm_sq(params: Iterable[torch.Tensor], device: torch.device | str | None = None) -> torch.Tensor:
    """Squared L2 norm of the gradients of ``params`` (plain tensors and DTensors in any mix), as a float64
    scalar on the device: no host read (the caller reads it once per step, where it needs the number).

    Plain tensors are counted as they are (they are replicas, equal on every rank of a mesh). A DTensor's local
    shard is squared and summed, then all-reduced over each mesh dimension that splits it (``Shard``, or the
    ``_StridedShard`` of FSDP2 over TP): a shard is counted once and a ``Replicate`` dimension once, not ``n``
    times. ``Partial`` gradients are reduced first. One ``torch._foreach_norm`` per group of tensors (the plain
    ones; the shards of each mesh and placement) and one all-reduce per mesh dimension, whatever the number of
    parameters. ``device``: where the result lives (default: the gradients').
    Collective: every rank holding DTensor grads on a mesh must call it with the same parameters, in the same
    order. Returns the same value on every rank. Shared parameters (tied weights) are counted once.
    """
    plain: list[torch.Tensor] = []
    by_mesh: dict[tuple[int, tuple[int, ...]], tuple[DeviceMesh, list[torch.Tensor]]] = {}
    seen: set[int] = set()
    for p in params:
        if id(p) in seen or p.grad is None:
            continue
        seen.add(id(p))
        g = p.grad
        if not isinstance(g, DTensor):
            plain.append(g.detach())
            continue
        if any(pl.is_partial() for pl in g.placements):
            g = g.redistribute(placements=[Replicate() if pl.is_partial() else pl for pl in g.placements])
        # every mesh dim that splits the tensor: Shard, and FSDP2's _StridedShard (dp over tp), which is no Shard
        dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
        key = (id(g.device_mesh), dims)
        by_mesh.setdefault(key, (g.device_mesh, []))[1].append(g.to_local().detach())
    first = plain[0] if plain else next((ts[0] for _, ts in by_mesh.values()), None)
    out_device = torch.device(device) if device is not None else (first.device if first is not None else "cpu")
    total = _sum_of_squares(plain, out_device)
    for (_, dims), (mesh, shards) in by_mesh.items():
        acc = _sum_of_squares(shards, shards[0].device)
        for d in dims:
            dist.all_reduce(acc, group=mesh.get_group(d))
        total = total + acc.to(out_device)
    return total


def _sum_of_squares(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """sum_i ||t_i||^2 in float64 on ``device``: one fused norm over the list, one sum."""
    if not tensors:
        return torch.zeros((), dtype=torch.float64, device=device)
    norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
    return torch.stack([n.to(device) for n in norms]).square().sum()


def scale_grads(grads: list[torch.Tensor], coef: float | torch.Tensor) -> None:
    """Multiply gradients (plain or DTensor: their local shards) in place by ``coef`` (a host float, or a scalar
    on the gradients' device): one fused ``torch._foreach_mul_`` per device, no host read."""
    local = [local_tensor(g) for g in grads]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in local:
        by_device.setdefault(t.device, []).append(t)
    for dev, ts in by_device.items():
        c = coef.to(dev) if isinstance(coef, torch.Tensor) else coef
        torch._foreach_mul_(ts, c)
