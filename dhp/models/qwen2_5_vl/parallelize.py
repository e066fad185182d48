"""Tensor-parallel plans for Qwen2.5-VL: the language model (the plan dhp uses) and the vision encoder (a baseline).

Why TP for the text side: the language model's memory is weights and optimizer
state (7B-72B), so each rank keeps 1/tp of every projection. Why TP for vision
at all: the published comparison is against *uniform* TP (one strategy for the
whole model); ``parallelize_vision_tp`` is that baseline, not what dhp
recommends for the encoder (Ulysses SP, see ``dhp.parallel.ulysses``).

Plans are data, ``{module path: ParallelStyle}``, applied with PyTorch's
``parallelize_module`` (DTensor) by short functions, as in torchtitan:

text, per decoder layer
    qkv            FusedColwise((H*hd, KV*hd, KV*hd)): the fused [(H + 2 KV) hd, D] weight is [q; k; v] on its
                   rows (unequal parts: GQA); its rows are re-ordered so that rank r holds [its q heads; its k
                   heads; its v heads] (Megatron's layout), not a slice across the concatenation
    gate_up        FusedColwise((I, I)): the fused [2I, D] weight [gate; up], rank r holding [its gate rows; its
                   up rows]
    o/down         RowwiseParallel          (all-reduce back to a full activation)
    each fused projection reduces its one input gradient: 4 all-reduces per layer and step (2 forward, 2
    backward), not 7 as with q, k, v, gate and up apart
text, top level
    embed_tokens   VocabParallelEmbedding: the [V, D] table sharded on the vocabulary (Shard(0)), each rank looks
                   up its own rows on the local shard and one all-reduce (forward only) makes the output a full
                   plain tensor, so ``TextModel.embed`` can ``masked_scatter`` image embeddings into it; the
                   weight's gradient is this rank's shard only (a Shard(0) DTensor laid out like the weight)
    lm_head        ColwiseParallel(output Shard(-1), DTensor out): logits stay sharded on the vocabulary and
                   ``TextModel.loss_sum`` takes a vocab-parallel cross entropy (``dhp.parallel.tensor``)
vision, per block
    attn.qkv       FusedColwise((C, C, C)): the fused [3C, C] weight is [q; k; v] on its rows; its rows are
                   re-ordered so that rank r holds q, k and v of heads [r*H/tp, (r+1)*H/tp)
    attn.proj      RowwiseParallel;   mlp gate_up FusedColwise (as in text), down Rowwise:
                   4 all-reduces per block and step (2 forward, 2 backward)
    uneven MLP     the MLP width need not divide tp (3420 at tp 8; the heads must): each half is cut as torch.chunk
                   cuts it (ceil(I/tp) rows on the first ranks, fewer on the last) and padded with zero rows to
                   tp * ceil(I/tp), so gate/up is an even Shard(0) (FusedColwise(uneven=True)); down_proj is
                   DTensor's own uneven Shard(1) of [C, I], its input cut to the real columns (UnevenRowwise).
                   Every rank computes ceil(I/tp) rows: the largest shard sets the step
    patch_embed, norms, merger: replicated (plain tensors)

Tied embeddings (``tie_word_embeddings``, the 3B preset) are supported: embed_tokens and lm_head both shard
their [V, D] weight on the vocabulary (``Shard(0)``), so after the plan they share one DTensor again.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from dhp.models.layers import compute_dtype
from dhp.models.qwen2_5_vl.config import TextConfig, VisionConfig
from dhp.models.qwen2_5_vl.text import TextModel, text_qkv_sizes
from dhp.models.qwen2_5_vl.vision import VisionTransformer
from dhp.ops.attention import Segments
from dhp.parallel.lora import lora_plan
from dhp.parallel.tensor import check_tp, check_vision_tp, shard_range


def _tp_size(mesh: DeviceMesh) -> int:
    if mesh.ndim != 1:
        raise ValueError(f"tensor parallelism expects a 1-D mesh (the TP dimension), got {mesh.ndim}-D: {mesh}")
    return mesh.size()


# ---- language model -----------------------------------------------------------------------------------------
class _VocabParallelEmbedding(nn.Embedding):
    """``nn.Embedding`` whose weight is a ``Shard(0)`` DTensor (vocabulary rows), looked up on the local shard.

    ``RowwiseParallel`` would run the lookup through DTensor, which has no ``Shard(0)`` strategy for
    ``embedding_dense_backward``: the gradient came out ``Replicate``, the whole [V, D] table on every rank.
    Here each rank looks up the ids in its own range ``[start, end)`` (others read row 0 and are zeroed), the
    ``[..., D]`` partial sums are all-reduced in forward (``Partial -> Replicate``, identity backward), and the
    gradient flows into ``weight.to_local()``: the parameter's ``.grad`` is a ``Shard(0)`` DTensor of this
    rank's rows only. Uneven shards (V not divisible by tp, even empty ones) follow DTensor's ``torch.chunk``
    cut (``shard_range``). The mesh is the weight's own (under FSDP2 + TP: the TP mesh of the unsharded
    parameter)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 (nn.Embedding's name)
        weight = self.weight
        if not isinstance(weight, DTensor):  # not (or no longer) sharded
            return super().forward(input)
        if isinstance(input, DTensor):
            input = input.full_tensor()  # noqa: A001
        mesh = weight.device_mesh
        start, end = shard_range(weight.shape[0], mesh)
        local = weight.to_local()
        outside = (input < start) | (input >= end)
        ids = torch.where(outside, torch.zeros_like(input), input - start)
        if local.shape[0] == 0:  # an empty shard (uneven cut): one zero row to look the masked ids up in
            local = F.pad(local, (0, 0, 0, 1))
        out = F.embedding(ids, local).masked_fill(outside.unsqueeze(-1), 0)
        out = out.to(compute_dtype(out))  # the all-reduce carries the compute dtype (bf16 under autocast)
        out = DTensor.from_local(out, mesh, [Partial()], run_check=False)
        return out.redistribute(mesh, [Replicate()]).to_local()


class VocabParallelEmbedding(ParallelStyle):
    """Vocabulary-parallel ``nn.Embedding``: weight ``Shard(0)``, input full (plain) ids, output a full plain
    tensor equal on every rank (see ``_VocabParallelEmbedding``). One all-reduce of ``[..., D]`` forward, none
    backward; the weight's gradient is the rank's shard only."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if type(module) is not nn.Embedding and not isinstance(module, _VocabParallelEmbedding):
            raise NotImplementedError(f"VocabParallelEmbedding shards an nn.Embedding, got {type(module).__name__}")
        if module.padding_idx is not None or module.max_norm is not None or module.sparse:
            raise NotImplementedError("VocabParallelEmbedding: padding_idx, max_norm and sparse are not supported")
        weight = module.weight
        if not isinstance(weight, DTensor):
            weight = nn.Parameter(
                distribute_tensor(weight.detach(), device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=weight.requires_grad,
            )
            module.register_parameter("weight", weight)
        elif weight.device_mesh != device_mesh or weight.placements != (Shard(0),):
            raise ValueError(f"VocabParallelEmbedding: weight already a DTensor as {weight.placements}")
        module.__class__ = _VocabParallelEmbedding
        return module


def text_top_plan() -> dict[str, ParallelStyle]:
    return {
        "embed_tokens": VocabParallelEmbedding(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def text_layer_plan(cfg: TextConfig) -> dict[str, ParallelStyle]:
    """Per decoder layer: 2 all-reduces forward (o, down) and 2 backward (the fused qkv's input, the fused
    gate/up's)."""
    return {
        "self_attn.qkv_proj": FusedColwise(text_qkv_sizes(cfg)),  # one matmul, one input gradient
        "self_attn.o_proj": RowwiseParallel(),
        "mlp.gate_up_proj": FusedColwise((cfg.intermediate_size, cfg.intermediate_size)),  # one input gradient
        "mlp.down_proj": RowwiseParallel(),
    }


def text_sp_top_plan() -> dict[str, ParallelStyle]:
    """Sequence parallel: the final norm sees a sequence shard; lm_head gathers the sequence, shards the vocab."""
    return {
        "embed_tokens": VocabParallelEmbedding(),
        "norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }


def text_sp_layer_plan(cfg: TextConfig) -> dict[str, ParallelStyle]:
    """Megatron SP: norms (and the residual stream) on a sequence shard, attention/MLP on the whole sequence."""
    return {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(
            input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
        ),
        "self_attn.qkv_proj": FusedColwise(text_qkv_sizes(cfg)),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_up_proj": FusedColwise((cfg.intermediate_size, cfg.intermediate_size)),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    }


class _SequencePadding:
    """Forward hooks that make a packed ``[1, T, D]`` sequence shardable: pad T to a multiple of tp, and cut.

    Before every decoder layer the rotary tables and ``cu_seqlens`` (computed by ``hidden_states`` for the
    true length T) get ``p = -T % tp`` more positions, the padding being one extra segment of its own, so no
    real token attends to it. Before the first layer the full embedding ``[1, T, D]`` (replicated: image
    embeddings are scattered into it) is padded and cut to this rank's shard, through DTensor so that the
    backward all-gathers its gradient. After ``lm_head`` the logits lose the padding again: callers see
    ``[1, T, V]``."""

    def __init__(self, mesh: DeviceMesh) -> None:
        self.mesh = mesh
        self.tp = mesh.size()
        self.length = 0  # true T of the current forward

    def _pad(self, seq: int) -> int:
        return -seq % self.tp

    def first_layer(self, module: nn.Module, args: tuple) -> tuple:
        x, rope, cu_seqlens = args
        if x.shape[0] != 1:
            raise ValueError(
                f"sequence_parallel needs packed sequences of batch size 1 ([1, T, D]); got batch {x.shape[0]}"
            )
        self.length = x.shape[1]
        x = F.pad(x, (0, 0, 0, self._pad(self.length)))
        x = DTensor.from_local(x, self.mesh, [Replicate()], run_check=False).redistribute(placements=[Shard(1)])
        return self.every_layer(module, (x.to_local(), rope, cu_seqlens))

    def every_layer(self, module: nn.Module, args: tuple) -> tuple:
        x, (cos, sin), cu_seqlens = args
        p = self._pad(cos.shape[1])
        if p:
            cos, sin = (F.pad(r, (0, 0, 0, p)) for r in (cos, sin))
            cu_seqlens = Segments.of(cu_seqlens).padded(p)  # host metadata; made once, shared by every layer
        return x, (cos, sin), cu_seqlens

    def unpad_logits(self, module: nn.Module, args: tuple, logits: torch.Tensor) -> torch.Tensor:
        return logits[:, : self.length] if logits.shape[1] != self.length else logits


def parallelize_text(model: TextModel, tp_mesh: DeviceMesh, sequence_parallel: bool = False) -> None:
    """Shard ``model`` in place over ``tp_mesh`` (1-D). Afterwards ``model(...)`` returns logits as a DTensor
    sharded on the vocabulary (``.full_tensor()`` gathers them) and ``model.loss_sum`` the summed CE as a plain
    float32 scalar, equal on every rank. Inputs (ids, positions, image embeddings) are full and equal on every
    rank; the gradient of ``image_embeds`` comes out full and equal on every rank.

    ``sequence_parallel``: Megatron-style SP; between blocks each rank keeps ``T/tp`` tokens of the residual
    stream (activation memory / tp); inputs must be packed ``[1, T]`` and T is padded to a multiple of tp
    internally (outputs are unpadded). The norm weights become ``Replicate`` DTensors whose gradients are
    all-reduced by a hook after each backward."""
    tp = _tp_size(tp_mesh)
    check_tp(model.cfg.num_key_value_heads, tp)
    tied = model.lm_head.weight is model.embed_tokens.weight
    if sequence_parallel:
        top, layer_plan = text_sp_top_plan(), text_sp_layer_plan(model.cfg)
    else:
        top, layer_plan = text_top_plan(), text_layer_plan(model.cfg)
    parallelize_module(model, tp_mesh, lora_plan(model, top))
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, lora_plan(layer, layer_plan))  # LoRA adapters laid out as Megatron's
    if tied:  # both halves were sharded Shard(0) on the vocabulary: share one DTensor again
        model.lm_head.weight = model.embed_tokens.weight
    if sequence_parallel:
        padding = _SequencePadding(tp_mesh)
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(padding.first_layer if i == 0 else padding.every_layer, prepend=True)
        model.lm_head.register_forward_hook(padding.unpad_logits)
        for param in model.parameters():  # the norm weights: their grads come out Partial (a sum per shard)
            if isinstance(param, DTensor) and param.placements == (Replicate(),):
                param.register_post_accumulate_grad_hook(_reduce_partial_grad)


def _reduce_partial_grad(param: torch.Tensor) -> None:
    """Sum a replicated parameter's Partial gradient over the TP ranks once per backward (Megatron's all-reduce
    of SP norm grads), so optimizers, clipping and checkpoints see an ordinary Replicate gradient."""
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=[Replicate()])


# ---- fused projections (text qkv and gate/up, vision qkv and gate/up) -------------------------------------------
def chunk_rows(n: int, tp: int) -> int:
    """Rows of an ``n``-row part per TP rank in the rank order: ``ceil(n / tp)``, ``torch.chunk``'s piece.

    Rank r's real rows of the part are ``[r c, min((r + 1) c, n))`` (c rows on the first ranks, fewer or none
    on the last: DTensor's own uneven ``Shard``, so the row-parallel projection that reads them shards its input
    columns exactly so, ``UnevenRowwise``); where ``tp`` does not divide ``n`` the part is padded at its end with
    ``c tp - n`` zero rows, so that every rank holds c rows of it."""
    return -(-n // tp)


def rows_to_rank_order(t: torch.Tensor, sizes: Sequence[int], tp: int) -> torch.Tensor:
    """Rows of a fused weight/bias ``[part 0; part 1; ...]`` (``sizes`` rows each, unequal allowed) to rank order
    ``[rank 0: its rows of part 0; of part 1; ...][rank 1: ...]``: what each TP rank's contiguous ``Shard(0)``
    must hold (Megatron's interleaved layout). A part that ``tp`` does not divide is first padded with zero rows
    at its end to ``chunk_rows(n, tp) * tp`` (``chunk_rows``): the result then has more rows than ``t``."""
    rest = t.shape[1:]
    if t.shape[0] != sum(sizes):
        raise ValueError(f"a fused tensor of {t.shape[0]} rows is not made of parts of {list(sizes)} rows")
    out = []
    for part, n in zip(t.split(list(sizes)), sizes, strict=True):
        c = chunk_rows(n, tp)
        if c * tp != n:
            part = torch.cat([part, part.new_zeros(c * tp - n, *rest)])
        out.append(part.reshape(tp, c, *rest))
    return torch.cat(out, dim=1).reshape(-1, *rest)


def rows_from_rank_order(t: torch.Tensor, sizes: Sequence[int], tp: int) -> torch.Tensor:
    """Inverse of ``rows_to_rank_order`` (for a gathered weight or gradient, e.g. to save a checkpoint): the
    padding rows are dropped, and they must be zero (a non-zero one is a layout bug, not data to lose)."""
    rest = t.shape[1:]
    chunks = [chunk_rows(n, tp) for n in sizes]
    if t.shape[0] != tp * sum(chunks):
        raise ValueError(f"a rank-ordered tensor of {t.shape[0]} rows does not hold parts of {list(sizes)} rows "
                         f"over tp={tp} ({tp} x {sum(chunks)} rows)")
    by_rank = t.reshape(tp, sum(chunks), *rest)
    parts = [p.reshape(-1, *rest) for p in by_rank.split(chunks, dim=1)]
    if not t.is_meta and any(p[n:].any() for p, n in zip(parts, sizes, strict=True) if p.shape[0] > n):
        raise ValueError(f"the padding rows of a rank-ordered fused tensor (parts {list(sizes)}, tp={tp}) are not "
                         "zero: the tensor was not laid out by rows_to_rank_order")
    return torch.cat([p[:n] for p, n in zip(parts, sizes, strict=True)])


class FusedColwise(ColwiseParallel):
    """ColwiseParallel for a Linear whose output rows are several projections concatenated (``sizes`` rows each:
    gate/up, GQA's q/k/v). Plain ``Shard(0)`` would cut across the concatenation (rank 0: all the gate rows);
    the rows are first re-ordered by ``rows_to_rank_order``, so each rank's contiguous shard is its own rows of
    every part, in order, and the module cuts its local output exactly as the unsharded one (in proportion).
    The DTensor's *global* row order is therefore the rank order (undo with ``rows_from_rank_order``; the
    family's ``layout_transforms`` say so to checkpoints and init).

    ``uneven``: parts that ``tp`` does not divide are allowed (a gate/up whose width is not a multiple of tp,
    never a q/k/v: heads are whole on a rank). Each part is cut as ``torch.chunk`` cuts it and padded at its end
    to ``chunk_rows(n, tp) * tp`` zero rows (``chunk_rows``): the DTensor is an even ``Shard(0)`` of
    ``[tp * sum(chunk_rows), in]``, every rank ``chunk_rows`` rows of every part, the last ranks' tails zero.
    Why padding, not a ``from_local`` of unequal shards: the concatenation's per-rank sizes (``2 chunk_r(n)``)
    are not DTensor's chunk pattern of ``2n`` (3420 over 8: 856 x 7 + 848 against 855 x 8), and every generic
    path (``full_tensor``, ``distribute_tensor``, FSDP2, checkpoints, init) assumes that pattern. The padding
    rows stay zero in training (their output is dropped by the row-parallel projection after them,
    ``UnevenRowwise``, so their gradient is zero) and are dropped on the way to a checkpoint."""

    def __init__(self, sizes: Sequence[int], uneven: bool = False) -> None:
        super().__init__()
        self.sizes = tuple(sizes)
        self.uneven = uneven

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        tp = device_mesh.size()
        if any(n % tp for n in self.sizes):
            if not self.uneven:
                raise ValueError(f"tensor parallelism tp={tp} must divide every part of the fused "
                                 f"{name or 'Linear'} (rows {list(self.sizes)})")
            if len(set(self.sizes)) != 1:  # the local output is cut in proportion to the parts: equal ones only
                raise ValueError(f"uneven tensor parallelism (tp={tp}) of the fused {name or 'Linear'} needs parts "
                                 f"of equal rows (gate/up), got {list(self.sizes)}")
        for pname, param in module.named_parameters(recurse=False):
            data = rows_to_rank_order(param.detach(), self.sizes, tp)
            dist_param = nn.Parameter(
                distribute_tensor(data, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank),
                requires_grad=param.requires_grad,
            )
            module.register_parameter(pname, dist_param)


class UnevenRowwise(RowwiseParallel):
    """RowwiseParallel after an uneven ``FusedColwise`` (the MLP's down projection after its gate/up).

    The local input is the rank's padded ``chunk_rows(n, tp)`` columns, of which the first ``chunk_r(n)`` are
    real (``torch.chunk``'s cut); the weight is DTensor's own (uneven) ``Shard(1)`` of ``[out, n]``, the same cut.
    The input hook drops the padding columns and makes the DTensor with its true global width ``n`` (``from_local``
    would take ``tp`` times the local width), so the local matmul is ``[.., chunk_r(n)] @ [chunk_r(n), out]``
    and the padding gets a zero gradient. Where tp divides ``n`` it is ``RowwiseParallel`` exactly."""

    @staticmethod
    def _prepare_uneven_input(mod: nn.Module, inputs: tuple, device_mesh: DeviceMesh) -> DTensor:
        x = inputs[0]
        if isinstance(x, DTensor):
            raise ValueError(f"UnevenRowwise takes the local output of a FusedColwise, got a DTensor {x.placements}")
        start, end = shard_range(mod.in_features, device_mesh)
        if x.shape[-1] < end - start:
            raise ValueError(f"UnevenRowwise: a local input of {x.shape[-1]} columns, but this rank's shard of "
                             f"{mod.in_features} input features is {end - start} wide")
        x = x[..., : end - start]
        shape = (*x.shape[:-1], mod.in_features)
        stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
        return DTensor.from_local(x, device_mesh, [Shard(x.dim() - 1)], run_check=False, shape=shape,
                                  stride=stride)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise NotImplementedError(f"UnevenRowwise shards an nn.Linear, got {type(module).__name__}")
        return distribute_module(module, device_mesh, self._partition_linear_fn, self._prepare_uneven_input,
                                 functools.partial(self._prepare_output_fn, self.output_layouts,
                                                   self.use_local_output))


# ---- vision encoder (uniform-TP baseline) -----------------------------------------------------------------------
def vision_block_plan(cfg: VisionConfig) -> dict[str, ParallelStyle]:
    """Per block: 2 all-reduces forward (proj, down) and 2 backward (the fused qkv's input, the fused gate/up's)."""
    return {
        "attn.qkv": FusedColwise((cfg.hidden_size,) * 3),  # [q; k; v]: each rank q, k and v of its own heads
        "attn.proj": RowwiseParallel(),
        # a width tp does not divide (3420 at tp 8): each half cut as torch.chunk cuts it, padded (FusedColwise)
        "mlp.gate_up_proj": FusedColwise((cfg.intermediate_size, cfg.intermediate_size), uneven=True),
        "mlp.down_proj": UnevenRowwise(),
    }


def parallelize_vision_tp(model: VisionTransformer, tp_mesh: DeviceMesh) -> None:
    """Uniform-TP baseline: shard every vision block over ``tp_mesh`` (1-D); patch_embed, norms and merger stay
    replicated. Inputs and the output (image embeddings) are full and equal on every rank."""
    tp = _tp_size(tp_mesh)
    heads = model.cfg.num_heads
    check_vision_tp(heads, tp)
    for block in model.blocks:
        parallelize_module(block, tp_mesh, lora_plan(block, vision_block_plan(model.cfg)))
        block.attn.num_heads = heads // tp  # the attention views the local qkv output with the local head count
