"""AdamW for pure bfloat16 training: bf16 parameters and bf16 state, updated with stochastic rounding.

Why: float32 master weights and AdamW state cost 16 bytes per parameter (``docs/memory.md``); the published
Qwen2.5-VL-32B result trained with bf16 parameters, bf16 master weights and bf16 AdamW state (8 bytes). Plain
bf16 updates lose most small steps: bf16 keeps 8 significant bits, so an update smaller than half a unit in the
last place of a weight (about ``|w| / 512``) rounds back to the old weight, every step, and training stalls at
small learning rates. Stochastic rounding rounds up with probability equal to the remainder, so each rounded
value equals the float32 one *in expectation* and the small updates add up over steps (the compensation of
torchao's ``AdamW(bf16_stochastic_round=True)``; torchao 0.18 keeps that optimizer private and compiles it per
parameter shape, so dhp carries this small element-wise version: the maths in float32, one rounding per write).

Determinism across ranks: a replicated parameter must stay bit-identical on every rank that holds it (data
parallel replicas, the TP ranks' norm weights). The random bits of parameter ``i`` at step ``t`` come from a
generator seeded by ``(seed, t, i)`` alone, so every rank that steps the same parameter in the same position
draws the same bits, whatever the sizes of the other (sharded) parameters it holds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

__all__ = ["BF16AdamW", "stochastic_round_bf16"]

_LOW16 = (1 << 16) - 1


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """``x`` (float32) rounded to bfloat16 stochastically: up with probability (remainder / unit in the last place).

    bfloat16 is the top 16 bits of a float32. Adding 16 uniform random bits to the low half of the bit pattern and
    truncating rounds the magnitude up exactly when the random bits exceed the discarded ones (the sign bit is
    untouched, so negative values round symmetrically); infinities stay infinite."""
    if x.dtype != torch.float32:
        raise TypeError(f"stochastic_round_bf16 takes float32, got {x.dtype}")
    bits = x.contiguous().view(torch.int32)
    noise = torch.randint(0, _LOW16 + 1, x.shape, dtype=torch.int32, device=x.device, generator=generator)
    rounded = torch.bitwise_and(bits + noise, ~_LOW16)
    return rounded.view(torch.float32).to(torch.bfloat16)  # exact: the low 16 bits are zero


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the update is element-wise), else the tensor itself."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _step_count(step: torch.Tensor) -> int:
    """The step a (CPU, float32) ``state["step"]`` holds; 1 in a shape-only run (the planner's fake tensors)."""
    from torch._subclasses.fake_tensor import is_fake

    return 1 if is_fake(step) else int(step)


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected moments, as ``torch.optim.AdamW``) whose parameters and
    ``exp_avg`` / ``exp_avg_sq`` are bfloat16, each written back with stochastic rounding.

    The step reads each bf16 tensor into float32, does the update there, and writes it back once with
    ``stochastic_round_bf16``. Float32 parameters (a mixed module) are updated in float32 without rounding.
    Parameters may be DTensors (TP, FSDP2): the update runs on the local shard."""

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01, seed: int = 0) -> None:
        if lr < 0 or eps < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"BF16AdamW: invalid lr={lr}, eps={eps} or betas={betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.seed = seed

    def _generator(self, device: torch.device, step: int, index: int) -> torch.Generator:
        g = torch.Generator(device=device)
        g.manual_seed((self.seed * 1_000_003 + step) * 1_000_033 + index)
        return g

    def _write(self, dst: torch.Tensor, value: torch.Tensor, step: int, index: int, which: int) -> None:
        if dst.dtype == torch.bfloat16:
            dst.copy_(stochastic_round_bf16(value, self._generator(value.device, step, 3 * index + which)))
        else:
            dst.copy_(value)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:  # noqa: D102 (torch.optim.Optimizer's contract)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                local, grad = _local(p), _local(p.grad).float()
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    # laid out like the parameter (a DTensor for a DTensor), as torch's AdamW keeps it: the
                    # distributed checkpoint reshards optimizer state by the parameter's placements
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                t = _step_count(state["step"])
                exp_avg, exp_avg_sq = _local(state["exp_avg"]), _local(state["exp_avg_sq"])
                m = exp_avg.float().lerp_(grad, 1 - beta1)
                v = exp_avg_sq.float().mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v / (1 - beta2**t)).sqrt_().add_(eps)
                w = local.float().mul_(1 - lr * wd).addcdiv_(m, denom, value=-lr / (1 - beta1**t))
                self._write(local, w, t, index, 0)
                self._write(exp_avg, m, t, index, 1)
                self._write(exp_avg_sq, v, t, index, 2)
        return loss
