"""Building blocks shared by model families: RMSNorm, SwiGLU, rotary helpers, the compute dtype.

Attention over packed sequences lives one layer down (``dhp.ops.attention``): the parallel layer needs it too.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def autocast_on(t: torch.Tensor) -> bool:
    """Whether autocast is on for ``t``'s device (never for the meta device, which has no autocast)."""
    device = t.device.type
    return device in ("cpu", "cuda") and torch.is_autocast_enabled(device)


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype activations of ``t``'s device carry: autocast's where autocast is on there, else ``t``'s own."""
    return torch.get_autocast_dtype(t.device.type) if autocast_on(t) else t.dtype


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 inside; the output is in the compute dtype.

    Outside autocast that is HF's ``weight * x32.to(x.dtype)``, exactly. Under autocast (bfloat16 compute over
    float32 master weights) the product is taken in the compute dtype too, so the norm's output, the residual
    stream after it and the sequence-parallel collectives around it carry bfloat16, not the float32 the
    weight's dtype would promote them to."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if autocast_on(x):  # the product in the compute dtype too
            out = compute_dtype(x)
            return self.weight.to(out) * x32.to(out)
        return self.weight * x32.to(dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused in one ``gate_up_proj`` Linear.

    Why fused: one GEMM of N = 2I instead of two of N = I (at TP 8 the halves are small GEMMs), and one input
    gradient. The rows are ``[gate; up]`` (HF's ``gate_proj`` then ``up_proj``, concatenated on dim 0); the weight
    adapters split them back to HF's names at export and fuse them at load. Under tensor parallelism each rank
    holds ``[its gate rows; its up rows]`` (the rows grouped by rank, ``FusedColwise``), so the local output is
    cut in two halves the same way."""

    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [..., S, H, D]`` by ``cos/sin [..., S, D]`` (broadcast over heads), in float32."""
    dtype = x.dtype
    x32 = x.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return (x32 * cos + rotate_half(x32) * sin).to(dtype)


