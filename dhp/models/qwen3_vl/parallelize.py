"""Tensor-parallel plans for Qwen3-VL: the language model (TP with Megatron SP) and the vision encoder (a baseline).

What is Qwen2.5-VL's and reused as it is (``dhp.models.qwen2_5_vl.parallelize``): the decoder plan (fused qkv
and gate/up ``FusedColwise``, o/down ``RowwiseParallel``), the vocab-parallel embedding and head, Megatron SP
(norms on a sequence shard, the sequence padded to a multiple of tp). Qwen3-VL adds three things:

q/k RMSNorm under TP
    ``q_norm``/``k_norm`` normalise each head over ``head_dim`` with one weight shared by all heads. With the
    heads sharded the norm is local (a rank normalises its own heads), but the weight's gradient is a sum
    over all heads, so each rank holds only its heads' part: ``HeadNormTP`` sums it over the TP ranks in the
    backward (one all-reduce of ``head_dim`` floats per norm and micro-batch), so the parameter stays a plain
    tensor with an ordinary gradient, equal on every rank (optimizers, clipping, FSDP2 and checkpoints see a
    replicated weight). It is summed in autograd, not in a gradient hook: gradient accumulation over
    micro-batches then adds already-reduced gradients.
DeepStack under sequence parallelism
    after layer i < K feature i is added at the vision positions. Under SP ``x`` between layers is this rank's
    contiguous shard ``[start, start + S)`` of the padded sequence, so each rank adds only the rows in its slice
    (``text.add_to_sequence_shard``): rows that arrive as a sequence slice (the data plane sends each text rank its
    slice's rows, positions with them) go straight in; whole features (every rank holds all rows) are placed
    in a full-length delta cut to the shard through DTensor, whose backward all-gathers: their gradient comes
    out whole and equal on every rank, as the main embeddings' does.
vision, per block (the uniform-TP baseline)
    attn.qkv        FusedColwise((C, C, C)): the fused [3C, C] weight (and bias) re-laid so rank r holds the q,
                    k and v rows of heads [r H/tp, (r+1) H/tp) (``rows_to_rank_order``); the attention reads the
                    local head count off the local width
    attn.proj       RowwiseParallel (bias added once, after the reduction)
    mlp.linear_fc1  ColwiseParallel (weight and bias rows);  mlp.linear_fc2 RowwiseParallel
    4 all-reduces per block and step (2 forward, 2 backward). patch_embed, the position table, the norms, the
    merger and the DeepStack mergers stay replicated: their inputs are whole on every rank (the mergers read the
    block outputs, which the row-parallel layers all-reduce), so their gradients are equal without a collective.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from dhp.models.layers import RMSNorm, autocast_on, compute_dtype
from dhp.models.qwen2_5_vl.parallelize import FusedColwise
from dhp.models.qwen2_5_vl.parallelize import parallelize_text as parallelize_qwen2_5_text
from dhp.models.qwen3_vl.text import TextModel
from dhp.models.qwen3_vl.vision import VisionTransformer
from dhp.parallel.lora import lora_plan
from dhp.parallel.tensor import check_vision_tp


# ---- language model -----------------------------------------------------------------------------------------
class _SumGrad(torch.autograd.Function):
    """Identity forward; backward sums the gradient over ``group`` (Megatron's copy-to-parallel-region)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class HeadNormTP(RMSNorm):
    """``RMSNorm`` over each head of a TP rank's local heads: the same output, and the weight's gradient summed
    over the TP ranks (each rank's heads contribute a part of it). ``group``: the TP process group."""

    group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = _SumGrad.apply(self.weight, self.group)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if autocast_on(x):
            out = compute_dtype(x)
            return weight.to(out) * x32.to(out)
        return weight * x32.to(dtype)


def parallelize_text(model: TextModel, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard the Qwen3-VL language model in place over ``tp_mesh`` (1-D): Qwen2.5-VL's plan (same module
    names), the q/k norms' gradients summed over the ranks (``HeadNormTP``) and, under ``sequence_parallel``,
    the DeepStack rows added on each rank's sequence shard (``TextModel.sequence_mesh``). Inputs and outputs as
    Qwen2.5-VL's ``parallelize_text`` says; ``media`` values may also be a slice's ``(rows, positions)``."""
    parallelize_qwen2_5_text(model, tp_mesh, sequence_parallel)
    group = tp_mesh.get_group()
    for layer in model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.__class__ = HeadNormTP
            norm.group = group
    model.sequence_mesh = tp_mesh if sequence_parallel else None


# ---- vision encoder (uniform-TP baseline) -----------------------------------------------------------------------
def vision_block_plan(hidden_size: int) -> dict[str, ParallelStyle]:
    """Per block: 2 all-reduces forward (proj, fc2) and 2 backward (the fused qkv's input, fc1's)."""
    return {
        "attn.qkv": FusedColwise((hidden_size,) * 3),  # [q; k; v]: each rank q, k and v of its own heads
        "attn.proj": RowwiseParallel(),
        "mlp.linear_fc1": ColwiseParallel(),
        "mlp.linear_fc2": RowwiseParallel(),
    }


def parallelize_vision_tp(model: VisionTransformer, tp_mesh: DeviceMesh) -> None:
    """Uniform-TP baseline: shard every vision block over ``tp_mesh`` (1-D); the rest stays replicated. Inputs
    and the outputs (the named ``[N/4, D]`` tensors: main embeddings and DeepStack features) are full and equal
    on every rank."""
    if tp_mesh.ndim != 1:
        raise ValueError(f"tensor parallelism expects a 1-D mesh (the TP dimension), got {tp_mesh.ndim}-D")
    cfg, tp = model.cfg, tp_mesh.size()
    check_vision_tp(cfg.num_heads, tp)
    if cfg.intermediate_size % tp:
        raise ValueError(f"vision.parallel.tp={tp} must divide the vision MLP width ({cfg.intermediate_size})")
    for block in model.blocks:
        parallelize_module(block, tp_mesh, lora_plan(block, vision_block_plan(cfg.hidden_size)))  # LoRA: Megatron's

