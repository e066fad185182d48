"""Memory sharding per module: ZeRO-1, ZeRO-3 (FSDP2), activation checkpointing, mixed precision.

Why per module: the vision encoder's memory is activations (long image sequences), the language
model's is weights and optimizer state. Each module engine therefore picks its own ``zero`` level
and checkpointing, over its own data-parallel process group, and the rules of the project still
hold for every choice:

* gradients of *summed* losses accumulate over micro-batches, are scaled once by
  1 / (supervised tokens of the global batch) and **summed** (never averaged) over the
  data-parallel ranks;
* the global gradient norm counts each shard once and each replica once;
* the result equals the single-process run up to float rounding.

Everything here is PyTorch's own machinery (``ZeroRedundancyOptimizer``, ``fully_shard``,
``torch.utils.checkpoint``); this file only pins the settings that make it obey those rules:

``zero: 1``  ``make_zero1_optimizer``. Gradients stay whole on every rank (``finish_gradients``
             all-reduces them as for plain DP, so norm and clipping are unchanged); each rank keeps
             optimizer state for and steps only the parameters it owns, then broadcasts them.
             Under TP the "parameters" it partitions are each rank's local shards (see
             ``make_zero1_optimizer``).
``zero: 3``  ``apply_fsdp``. Parameters and gradients are DTensors sharded over the dp mesh;
             FSDP2 reduce-scatters every micro-batch's gradient as a SUM (its default is a mean),
             accumulating into the sharded gradient. ``finish_gradients`` must then only scale
             (no all-reduce); the norm of the sharded gradients is ``dhp.parallel.tensor.grad_norm_sq``
             (local squares, all-reduced over each mesh dimension the gradient is sharded on).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.utils.checkpoint import checkpoint

from dhp.optim import BF16AdamW
from dhp.parallel.tensor import local_tensor

OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]


# ---- ZeRO-1 ------------------------------------------------------------------------------------
def make_zero1_optimizer(
    param_groups: list[dict], optimizer_factory: OptimizerFactory, dp_group: dist.ProcessGroup | None
) -> torch.optim.Optimizer:
    """An optimizer whose state is sharded over ``dp_group``: ``torch``'s ``ZeroRedundancyOptimizer``.

    ``param_groups`` are ordinary groups (``params``, ``lr``, ``weight_decay``, ...); each rank gets a
    balanced subset of every group (same hyperparameters) and ``optimizer_factory(groups)`` builds
    its local optimizer, so optimizer defaults (betas, eps, momentum) come from the factory exactly
    as without sharding. The result is a ``torch.optim.Optimizer``: ``LambdaLR`` drives its
    ``param_groups[i]["lr"]`` (synchronised into the local optimizer before every step),
    ``zero_grad`` clears every parameter's gradient. ``step()`` expects the gradients already
    summed over ``dp_group`` (``finish_gradients`` does it) and leaves every rank with the same,
    fully updated parameters. No ``state_dict`` without ``consolidate_state_dict`` first.

    Tensor-parallel (DTensor) parameters: ``ZeroRedundancyOptimizer`` broadcasts with plain
    ``torch.distributed`` calls, which DTensors do not take, so it is given each rank's local shard
    instead (``_LocalShardZero``). That is exact for the element-wise optimizers the trainer builds
    (AdamW, SGD): the update of a shard is the shard of the update, and the dp peers of a TP rank
    hold the same shard, so the owner's broadcast is what each of them would have computed.
    """
    groups = [dict(g) for g in param_groups]
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for g in groups for p in g["params"]):
        zero = _LocalShardZero(groups, _factory_class(optimizer_factory), dp_group)
        if not isinstance(zero.optim, _ELEMENTWISE):
            raise ValueError(f"zero=1 with tensor parallelism steps each TP shard on its own, which is exact only "
                             f"for element-wise optimizers ({', '.join(c.__name__ for c in _ELEMENTWISE)}), "
                             f"not {type(zero.optim).__name__}")
        return zero
    return ZeroRedundancyOptimizer(groups, optimizer_class=_factory_class(optimizer_factory), process_group=dp_group)


_ELEMENTWISE = (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD, BF16AdamW)  # BF16AdamW: train.precision=bf16


class _LocalShardZero(ZeroRedundancyOptimizer):
    """ZeRO-1 over the local shards of DTensor parameters (see ``make_zero1_optimizer``).

    Each parameter is stood in for by a plain tensor sharing its local storage (``to_local().detach()``
    for a DTensor, ``detach()`` for a replicated plain tensor). ``step`` lends the stand-ins the local gradients,
    lets ``ZeroRedundancyOptimizer`` step its partition and broadcast every stand-in from its owner
    (in place, so the DTensor parameters change with them), and takes the gradients back;
    ``zero_grad`` clears the parameters' own gradients.
    """

    def __init__(self, param_groups: list[dict], optimizer_class: Callable[..., torch.optim.Optimizer],
                 dp_group: dist.ProcessGroup | None) -> None:
        self._pairs: list[tuple[torch.Tensor, torch.Tensor]] = []  # (parameter, its local stand-in)
        for g in param_groups:
            stand_ins = [local_tensor(p).detach() for p in g["params"]]
            self._pairs += zip(g["params"], stand_ins, strict=True)
            g["params"] = stand_ins
        super().__init__(param_groups, optimizer_class=optimizer_class, process_group=dp_group)

    def step(self, closure: Callable[[], float] | None = None, **kwargs: Any) -> float | None:
        for p, local in self._pairs:
            local.grad = None if p.grad is None else local_tensor(_placed_like(p.grad, p))
        try:
            return super().step(closure, **kwargs)
        finally:
            for _, local in self._pairs:
                local.grad = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, local in self._pairs:
            local.grad = None
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()


def _placed_like(grad: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``grad`` laid out as ``param`` (an uneven vocab-parallel table's gradient comes back replicated)."""
    from torch.distributed.tensor import DTensor

    if isinstance(grad, DTensor) and isinstance(param, DTensor) and grad.placements != param.placements:
        return grad.redistribute(param.device_mesh, param.placements)
    return grad


def _factory_class(factory: OptimizerFactory) -> Callable[..., torch.optim.Optimizer]:
    """``ZeroRedundancyOptimizer`` calls ``optimizer_class(groups, **defaults)``; we give no defaults."""

    def build(groups: list[dict], **defaults: Any) -> torch.optim.Optimizer:
        if defaults:
            raise TypeError(f"unexpected optimizer defaults {sorted(defaults)}: put them in the factory")
        return factory(groups)

    return build


def zero1_local_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters whose optimizer state lives on this rank (all of them for a plain optimizer)."""
    local = optimizer.optim if isinstance(optimizer, ZeroRedundancyOptimizer) else optimizer
    return [p for g in local.param_groups for p in g["params"]]


# ---- ZeRO-3 / FSDP2 ------------------------------------------------------------------------------
def mixed_precision_policy(dtype: torch.dtype | None = torch.bfloat16) -> Any:
    """FSDP2 policy: parameters gathered and computed in ``dtype``, gradients reduced in float32.

    The sharded master weights and the optimizer state stay float32 (FSDP2 keeps the sharded
    parameters in their original dtype). ``dtype=None`` is full float32.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def apply_fsdp(
    module: nn.Module,
    dp_mesh: Any,
    blocks: Sequence[nn.Module],
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    forward_methods: Iterable[str] = (),
    prefetch: int = 1,
) -> nn.Module:
    """Shard ``module`` ZeRO-3 style over ``dp_mesh`` (a 1-D ``DeviceMesh``): each block, then the root.

    Call after ``requires_grad`` is set and *before* building optimizer parameter groups:
    ``fully_shard`` replaces every parameter by a DTensor parameter. Each block is one unit
    (gathered for its forward and backward, freed after, if ``reshard_after_forward``); the root
    unit holds the rest (embeddings, final norm, head, merger). ``forward_methods`` names root
    methods called instead of ``__call__`` (``TextModel.loss_sum``): they must gather the root's
    parameters too.

    Gradient reduction is a SUM over the dp ranks (FSDP2's default is a mean): every micro-batch's
    backward reduce-scatters its gradient and adds it into the sharded ``.grad``, so gradient
    accumulation over micro-batches (and forward(mb0), forward(mb1), backward(mb0), backward(mb1))
    gives the sum. Apply ``apply_activation_checkpointing`` to the blocks first, if wanted.

    Prefetching (``prefetch`` blocks ahead, explicit, as in torchtitan): ``blocks`` are in forward order, and
    block i issues the all-gather of blocks i+1..i+prefetch when its forward starts and of blocks
    i-1..i-prefetch when its backward starts. FSDP2's implicit prefetching only overlaps an all-gather with
    compute when the CPU runs ahead of the device; with tensor parallelism's DTensor dispatch the CPU is often
    the slower side, and the explicit order issues each all-gather a whole block early regardless. (Under
    activation checkpointing, the recomputed forward does not prefetch: FSDP2 skips it in backward.) Costs the
    memory of ``prefetch`` more gathered blocks; ``prefetch=0`` leaves FSDP2's implicit prefetching.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    policy = mp_policy if mp_policy is not None else MixedPrecisionPolicy()
    for block in blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    if prefetch > 0:
        units = list(blocks)
        for i, block in enumerate(units):
            block.set_modules_to_forward_prefetch(units[i + 1 : i + 1 + prefetch])
            if i > 0:  # block 0 keeps FSDP2's default (nothing earlier to gather)
                block.set_modules_to_backward_prefetch(units[max(0, i - prefetch) : i][::-1])
    for name in forward_methods:
        register_fsdp_forward_method(module, name)
    for m in module.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # per unit, not recursive
            m.set_force_sum_reduction_for_comms(True)  # plain ReduceOp.SUM: gloo has no PREMUL_SUM/AVG
    return module


def is_fsdp(module: nn.Module) -> bool:
    """True when ``apply_fsdp`` sharded ``module`` (gradients are then already summed over dp)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


# ---- activation checkpointing ---------------------------------------------------------------------
def apply_activation_checkpointing(blocks: Iterable[nn.Module]) -> None:
    """Recompute each block's activations in backward instead of keeping them (non-reentrant).

    Wraps ``block.forward`` in place (torchtitan's per-block ``checkpoint_wrapper``, without
    renaming the block's parameters or state-dict keys), so outputs and gradients are identical to
    the unwrapped model; only the block's input is saved. Apply before ``apply_fsdp``.
    """
    for block in blocks:
        if getattr(block, "_dhp_checkpointed", False):
            continue
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args: Any, _inner: Callable = inner, **kwargs: Any) -> Any:
            return checkpoint(_inner, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

        block.forward = forward
        block._dhp_checkpointed = True
