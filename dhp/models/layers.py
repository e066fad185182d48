"""Building blocks shared by model families: RMSNorm, rotary helpers, packed attention.

``packed_attention`` runs scaled-dot-product attention over a packed sequence
cut into independent segments (images, attention windows, samples) without
ever building a mask over the whole sequence: segments of equal length are
gathered into one batch and sent through ``F.scaled_dot_product_attention``.
Windows of Qwen2.5-VL are mostly of one size, so a window layer is a handful of
batched SDPA calls and its memory grows linearly with the number of tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn


@contextmanager
def host_metadata() -> Iterator[None]:
    """Compute host-side metadata (segment boundaries, window permutations: small integer tensors derived from
    shapes, never from activations) on real CPU tensors, even inside a ``FakeTensorMode`` (the planner's
    shape-only run, ``dhp plan``). Outside such a mode it does nothing."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        yield


def has_values(t: torch.Tensor) -> bool:
    """False for a tensor with a shape and no values (a fake or meta tensor): host reads of it are skipped."""
    from torch._subclasses.fake_tensor import is_fake

    return not (t.is_meta or is_fake(t))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x))."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., S, H, D]`` by ``cos/sin [..., S, D]`` (broadcast over heads), in float32."""
    dtype = x.dtype
    x32 = x.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return (x32 * cos + rotate_half(x32) * sin).to(dtype)


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, causal: bool
) -> torch.Tensor:
    """Attention within segments of a packed sequence.

    q: [S, Hq, D], k/v: [S, Hkv, D] (Hq a multiple of Hkv: grouped-query attention),
    cu_seqlens: [n_segments + 1] cumulative boundaries with cu_seqlens[-1] == S.
    Returns [S, Hq, D]. Tokens attend only within their own segment.
    """
    seq, n_heads, _ = q.shape
    bounds = cu_seqlens.tolist()
    if bounds[-1] != seq:
        raise ValueError(f"cu_seqlens ends at {bounds[-1]} but the sequence has {seq} tokens")
    if seq == 0:
        # Nothing to attend, but q, k and v stay in the graph: their projections then get a (zero) gradient
        # rather than none. Ranks with no tokens (an empty SP shard, a replica without images) must hand
        # FSDP2 the same gradients as their peers, or its reduce-scatters differ in size (gloo aborts, NCCL hangs).
        return q * 0 + (k.sum() + v.sum()) * 0
    out = q.new_empty(q.shape)
    # segments grouped by length on the host (the boundaries are host metadata): ascending lengths, each group's
    # segments in sequence order; no device read, so a fake (shape-only) run of the planner goes through too
    by_length: dict[int, list[int]] = {}
    for start, end in zip(bounds[:-1], bounds[1:], strict=True):
        if end > start:
            by_length.setdefault(end - start, []).append(start)
    gqa = k.shape[1] != n_heads
    for length in sorted(by_length):
        seg_starts = torch.tensor(by_length[length], dtype=torch.long, device=q.device)
        idx = (seg_starts[:, None] + torch.arange(length, device=q.device)).reshape(-1)  # [n * L]
        qs, ks, vs = (t.index_select(0, idx).view(len(seg_starts), length, t.shape[1], -1).transpose(1, 2)
                      for t in (q, k, v))  # [n, H, L, D]
        o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, enable_gqa=gqa)
        out.index_copy_(0, idx, o.transpose(1, 2).reshape(-1, n_heads, q.shape[-1]))
    return out
