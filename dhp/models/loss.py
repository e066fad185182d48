"""Next-token cross entropy through the output projection, a chunk of tokens at a time.

Why: the whole-batch path builds logits ``[N, V]`` in the compute dtype, then a float32 copy for the loss,
then its float32 gradient: at N = 32k tokens and Qwen2.5's V = 152k that is 20 GB for the float32 logits
alone, more than the decoder's weights on a ZeRO-3 rank. ``chunked_linear_cross_entropy_sum`` never holds more
than ``chunk`` rows of logits: the forward keeps only each token's log-sum-exp ``[N]``; the backward makes
each chunk's logits again, turns them into ``softmax - onehot`` in place and multiplies them into the
gradients of the hidden states and of the weight. The cost is one more ``[chunk, D] x [D, V]`` matmul per
chunk (the head's forward, recomputed: about 1 % of a 32B step), which is recomputation, not model FLOPs.

The numbers are those of ``F.cross_entropy(F.linear(h, W).float(), ...)``: logits in the compute dtype
(autocast's, else the weight's), the loss and its gradient in float32 (whatever the model's dtype, as
transformers does), cast back to the compute dtype for the two matmuls of the backward; the weight's gradient
is summed over chunks in the weight's dtype (float32 master weights under autocast; FSDP2's bf16 copy, as the
whole path's gradient would be, under its mixed-precision policy).
A leaf: imports torch only.
"""

from __future__ import annotations

from typing import Any

import torch

IGNORE_INDEX = -100


def _compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on ``t`` runs in: autocast's where autocast is on for its device, else its own."""
    device = t.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                chunk: int) -> torch.Tensor:
        # hidden [N, D], weight [V, D], targets [N] (IGNORE_INDEX: not supervised) -> summed loss, float32 scalar
        dtype = _compute_dtype(hidden)
        acc = torch.float32  # the loss's dtype
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)  # [V, D]
            lse = torch.empty(hidden.shape[0], dtype=acc, device=hidden.device)  # [N]
            total = torch.zeros((), dtype=acc, device=hidden.device)
            for s in range(0, hidden.shape[0], chunk):
                logits = (hidden[s:s + chunk].to(dtype) @ w.t()).to(acc)  # [c, V]
                tgt = targets[s:s + chunk]
                lse[s:s + chunk] = torch.logsumexp(logits, dim=-1)
                picked = logits.gather(-1, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [c]
                total += torch.where(tgt != IGNORE_INDEX, lse[s:s + chunk] - picked, 0.0).sum()
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk, ctx.dtype = chunk, dtype
        return total

    @staticmethod
    def backward(ctx: Any, grad_total: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        chunk, dtype = ctx.chunk, ctx.dtype
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.empty_like(hidden) if want_h else None  # [N, D]
        acc = lse.dtype
        grad_w = torch.zeros_like(weight) if want_w else None  # [V, D], the weight's dtype (as autograd's would be)
        with torch.autocast(hidden.device.type, enabled=False):
            w = weight.to(dtype)
            for s in range(0, hidden.shape[0], chunk):
                h = hidden[s:s + chunk].to(dtype)  # [c, D]
                tgt = targets[s:s + chunk]
                valid = tgt != IGNORE_INDEX
                # d(sum CE)/d logits = softmax - onehot(target) on supervised rows, made in place on the logits
                grad = (h @ w.t()).to(acc).sub_(lse[s:s + chunk].unsqueeze(-1)).exp_()  # [c, V] softmax
                grad.scatter_add_(-1, tgt.clamp(min=0).unsqueeze(-1), -valid.to(grad.dtype).unsqueeze(-1))
                grad.mul_((valid.to(grad.dtype) * grad_total).unsqueeze(-1))
                grad = grad.to(dtype)
                if want_h:
                    grad_h[s:s + chunk] = (grad @ w).to(hidden.dtype)
                if want_w and grad_w.dtype == dtype:  # summed in place: no second [V, D] buffer (out=, not
                    torch.addmm(grad_w, grad.t(), h, out=grad_w)  # addmm_, which FlopCounterMode does not count)
                elif want_w:  # float32 weights under autocast: a bf16 product, summed in float32
                    grad_w += grad.t() @ h
        return grad_h, grad_w, None, None


def chunked_linear_cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                                     chunk: int) -> torch.Tensor:
    """Summed CE of ``hidden [..., D] @ weight[V, D].T`` against ``targets [...]`` (-100 ignored), float32,
    ``chunk`` tokens of logits at a time; the same value and gradients as the whole-batch path."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1 token, got {chunk}")
    flat = hidden.reshape(-1, hidden.shape[-1])
    return _ChunkedLinearCE.apply(flat, weight, targets.reshape(-1).to(flat.device), chunk)


__all__ = ["IGNORE_INDEX", "chunked_linear_cross_entropy_sum"]
