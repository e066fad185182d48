"""Module engines: one module of the model, its parallel layout, optimizer and schedule, driven by sample ids.

The single-process reference trainer and every Ray worker run these same
classes; a layout only adds collectives. That is what makes "every layout
equals the reference" a property of the code rather than a coincidence of two
implementations.

Per micro-batch the driver calls::

    pieces = vision.forward(key, sample_ids)     # {sample_id: (token_index [n], embeddings [n, D])}
    loss_sum, n, grads = text.forward_backward(ids, pieces)   # grads: {sample_id: [n_img_tokens, D]}
    vision.backward(key, grads)

and per step: ``finish_gradients(1 / N_global)``, ``grad_norm_sq`` on both, one
global norm, ``step(clip_coef)`` on both. The loss is a global token mean:
micro-batches backpropagate summed losses, and the accumulated gradients are
scaled once by the supervised-token count of the whole global batch (never a
mean of micro-batch means), then summed over the ranks that hold partial sums.

A piece is (token_index, embeddings): which of the sample's image tokens (in the
order the language model places them) this rank computed. Without sequence
parallelism a rank computes them all; under Ulysses SP each rank holds a slice.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from dhp.config import Config, ParallelConfig
from dhp.data.batch import Sample, pack
from dhp.models.qwen2_5_vl import Qwen2_5_VLConfig
from dhp.models.qwen2_5_vl.text import TextModel
from dhp.models.qwen2_5_vl.vision import VisionTransformer, init_weights, vision_layout

SampleLoader = Callable[..., Sample]  # (sample_id, pixels: bool) -> Sample
Piece = tuple[torch.Tensor, torch.Tensor]  # (token index [n] into the sample's image tokens, embeddings [n, D])


@dataclass
class Parallel:
    """What one rank knows of its module's layout: a (dp, inner) mesh; inner is sp or tp.

    ``dp_group`` spans the data-parallel replicas at this inner position, ``inner_group``
    the ranks of this replica, ``module_group`` all ranks of the module; ``mesh`` is the
    2D DeviceMesh ("dp", inner) over them. The single-process reference has none.
    """

    spec: ParallelConfig
    inner_kind: str = "none"  # "sp" | "tp" | "none"
    dp_rank: int = 0
    inner_rank: int = 0
    dp_group: Any = None
    inner_group: Any = None
    module_group: Any = None
    mesh: Any = None

    @property
    def inner(self) -> int:
        return self.spec.sp if self.inner_kind == "sp" else self.spec.tp

    @property
    def distributed(self) -> bool:
        return self.module_group is not None and dist.get_world_size(self.module_group) > 1


def single_process(spec: ParallelConfig | None = None) -> Parallel:
    return Parallel(spec or ParallelConfig())


def lr_lambda(cfg: Config) -> Callable[[int], float]:
    """Linear warmup to 1, then cosine down to ``min_lr_ratio`` at ``train.steps``."""
    t = cfg.train

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / t.warmup_steps
        span = max(1, t.steps - t.warmup_steps)
        progress = min(1.0, (step - t.warmup_steps) / span)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


def optimizer_factory(cfg: Config) -> Callable[[list[dict]], torch.optim.Optimizer]:
    t = cfg.train
    if t.optimizer == "sgd":
        return lambda groups: torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum)
    return lambda groups: torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps)


def param_groups(named: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and norm weights (1-D parameters)."""
    decay, no_decay = [], []
    for _, p in named:
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    return [
        {"params": ps, "lr": lr, "weight_decay": wd}
        for ps, wd in ((decay, weight_decay), (no_decay, 0.0))
        if ps
    ]


class ModuleEngine:
    """One module, its optimizer and LR schedule, and the process groups of its layout."""

    role: str

    def __init__(self, module: nn.Module, cfg: Config, par: Parallel, blocks: list[nn.Module],
                 group_of: Callable[[str], tuple[float, bool]], forward_methods: tuple[str, ...] = (),
                 fsdp_units: list[nn.Module] | None = None) -> None:
        """``group_of(param_name) -> (lr_scale, trainable)``. Parallelism is applied in a fixed order:
        1. tensor or sequence parallelism (by the subclass, before this),
        2. activation checkpointing of the blocks,
        3. ZeRO-3 (FSDP2) over the ranks that hold partial gradients,
        4. the optimizer (ZeRO-1: its state sharded over those ranks)."""
        self.module, self.cfg, self.par = module, cfg, par
        self.device = next(module.parameters()).device
        self.amp = cfg.train.dtype == "bfloat16"
        spec = par.spec
        for name, p in module.named_parameters():
            p.requires_grad_(group_of(name)[1])
        if getattr(cfg, self.role).activation_checkpointing:
            from dhp.parallel.sharding import apply_activation_checkpointing

            apply_activation_checkpointing(blocks)
        self.fsdp = spec.zero == 3 and par.distributed
        if self.fsdp:
            from dhp.parallel.sharding import apply_fsdp, mixed_precision_policy

            policy = mixed_precision_policy(torch.bfloat16) if self.amp and self.device.type == "cuda" else None
            if policy is not None:
                self.amp = False  # FSDP2 casts parameters and compute itself
            apply_fsdp(module, self.reduce_mesh(), fsdp_units or blocks, mp_policy=policy,
                       forward_methods=forward_methods)
        named = list({id(p): (n, p) for n, p in module.named_parameters()}.values())  # tied weights once
        groups = []
        for scale in sorted({group_of(n)[0] for n, _ in named}):
            chosen = [(n, p) for n, p in named if group_of(n)[0] == scale]
            groups += param_groups(chosen, cfg.train.lr * scale, cfg.train.weight_decay)
        self.trainable = [p for g in groups for p in g["params"]]
        self.optimizer = self._optimizer(groups) if self.trainable else None
        self.scheduler = (
            torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg)) if self.optimizer else None
        )

    # ---- layout ----------------------------------------------------------------------------
    def reduce_group(self):
        """The ranks whose gradients are partial sums of the same parameters: dp replicas, and SP ranks."""
        return self.par.module_group if self.par.inner_kind == "sp" else self.par.dp_group

    def reduce_mesh(self):
        """A 1D DeviceMesh over ``reduce_group`` (FSDP2 shards over it)."""
        if self.par.inner_kind == "tp":
            return self.par.mesh["dp"]
        from torch.distributed.device_mesh import DeviceMesh

        group = self.reduce_group()
        ranks = dist.get_process_group_ranks(group)
        return DeviceMesh.from_group(group, self.device.type, mesh=torch.tensor(ranks), mesh_dim_names=("dp",))

    def _optimizer(self, groups: list[dict]) -> torch.optim.Optimizer:
        factory = optimizer_factory(self.cfg)
        if self.par.spec.zero == 1 and self.par.distributed and dist.get_world_size(self.reduce_group()) > 1:
            from dhp.parallel.sharding import make_zero1_optimizer

            return make_zero1_optimizer(groups, factory, self.reduce_group())
        return factory(groups)

    def autocast(self):
        """Mixed precision (``train.dtype=bfloat16``): bfloat16 compute, float32 master weights."""
        if not self.amp:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # ---- step ------------------------------------------------------------------------------
    def finish_gradients(self, scale: float) -> None:
        """Turn accumulated gradients of summed losses into gradients of the global token mean.

        ``scale`` is 1 / (supervised tokens of the whole global batch). Ranks holding partial sums
        (data-parallel replicas, sequence-parallel ranks) then sum them, never average; under FSDP2
        the sum already happened in its reduce-scatter.
        """
        for p in self.trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.mul_(scale)
        group = self.reduce_group()
        if self.fsdp or group is None or dist.get_world_size(group) == 1:
            return
        from dhp.parallel.tensor import local_tensor

        for p in self.trainable:  # TP-sharded gradients: each rank sums its own shard with its dp peers'
            dist.all_reduce(local_tensor(p.grad), op=dist.ReduceOp.SUM, group=group)

    def grad_norm_sq(self) -> float:
        """This module replica's squared gradient norm, each shard counted once (collective under TP/FSDP)."""
        from dhp.parallel.tensor import grad_norm_sq

        return grad_norm_sq(self.trainable)

    def step(self, clip_coef: float) -> None:
        if self.optimizer is None:
            return
        if clip_coef < 1.0:
            for p in self.trainable:
                if p.grad is not None:
                    p.grad.mul_(clip_coef)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0] if self.scheduler else 0.0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on the CPU; collective when parameters are DTensors."""
        from torch.distributed.tensor import DTensor

        out = {}
        for k, v in self.module.state_dict().items():
            v = v.full_tensor() if isinstance(v, DTensor) else v
            out[_unwrapped(k)] = v.detach().to("cpu", copy=True)
        return out


def _unwrapped(key: str) -> str:
    """State-dict key without activation-checkpoint wrapper prefixes."""
    return key.replace("._checkpoint_wrapped_module", "")


class VisionEngine(ModuleEngine):
    """Vision encoder + merger. Keeps each micro-batch's graph until its gradient comes back."""

    role = "vision"

    def __init__(self, model_cfg: Qwen2_5_VLConfig, cfg: Config, load: SampleLoader,
                 par: Parallel | None = None, device: str = "cpu",
                 state: dict[str, torch.Tensor] | None = None):
        par = par or single_process(cfg.vision.parallel)
        module = build_vision(model_cfg, cfg.train.seed, device, state)
        if par.inner_kind == "tp":  # the uniform-TP baseline
            from dhp.models.qwen2_5_vl.parallelize import parallelize_vision_tp

            parallelize_vision_tp(module, par.mesh["tp"])
        elif par.inner_kind == "sp":
            from dhp.parallel.ulysses import parallelize_vision_sp

            parallelize_vision_sp(module, par.inner_group)
        v, m = cfg.vision, cfg.merger

        def group_of(name: str) -> tuple[float, bool]:
            return (m.lr_scale, m.trainable) if name.startswith("merger.") else (v.lr_scale, v.trainable)

        super().__init__(module, cfg, par, list(module.blocks), group_of, forward_methods=("encode_rows",),
                         fsdp_units=[module.patch_embed, *module.blocks, module.merger])
        self.load = load
        self.pending: dict[object, tuple[torch.Tensor, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}

    @property
    def needs_backward(self) -> bool:
        return bool(self.trainable)

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = super().state_dict()
        if self.par.inner_kind == "tp":  # the TP plan keeps fused qkv rows grouped by rank: undo it
            from dhp.models.qwen2_5_vl.parallelize import qkv_rows_from_rank_order

            for k in [k for k in out if k.endswith(("attn.qkv.weight", "attn.qkv.bias"))]:
                out[k] = qkv_rows_from_rank_order(out[k], self.module.cfg.num_heads, self.par.spec.tp)
        return out

    def forward(self, key: object, sample_ids: list[int]) -> dict[int, Piece]:
        """This rank's image embeddings of each sample that has images (detached)."""
        samples = [self.load(i) for i in sample_ids]
        with_images = [s for s in samples if s.image_grid_thw.shape[0]]
        if not with_images and not self.fsdp:
            return {}
        # FSDP2 ranks gather and reduce in lockstep: a replica without images still runs (on zero tokens)
        patch_dim = self.module.cfg.patch_dim
        pixels = torch.cat([torch.zeros(0, patch_dim)] + [s.pixel_values for s in with_images]).to(self.device)
        grid = torch.cat([torch.zeros(0, 3, dtype=torch.long)] + [s.image_grid_thw for s in with_images])
        grad_ctx = nullcontext() if self.needs_backward else torch.no_grad()
        with grad_ctx, self.autocast():
            embeds, merged_index = self._encode(pixels, grid)  # [n_local, D], image-order token index [n_local]
            embeds = embeds.float()
        pieces, rows = {}, {}
        start = 0
        for s in with_images:
            end = start + s.num_image_tokens
            mine = ((merged_index >= start) & (merged_index < end)).nonzero().flatten()  # local rows
            if len(mine):
                token_index = merged_index[mine] - start  # which of the sample's image tokens
                rows[s.index] = (mine, token_index)
                pieces[s.index] = (token_index, embeds.detach()[mine])
            start = end
        if self.needs_backward:
            self.pending[key] = (embeds, rows)
        return pieces

    def _encode(self, pixels: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (embeddings of this rank's merged tokens, their image-order index in the batch)."""
        if self.par.inner_kind != "sp":
            out = self.module(pixels, grid)  # image order
            return out, torch.arange(out.shape[0], device=out.device)
        from dhp.parallel.ulysses import shard_vision, sp_forward

        shard = shard_vision(vision_layout(grid.cpu(), self.module.cfg), self.par.spec.sp)[self.par.inner_rank]
        out = sp_forward(self.module, pixels, shard, self.par.inner_group)
        return out, shard.merged_index.to(out.device)

    def backward(self, key: object, grads: dict[int, torch.Tensor]) -> None:
        """Backpropagate the loss gradient w.r.t. the embeddings this rank produced for ``key``.

        ``grads`` holds each sample's whole gradient [n_img_tokens, D]; this rank takes its rows."""
        if not self.needs_backward or key not in self.pending:
            return
        embeds, rows = self.pending.pop(key)
        grad = torch.zeros_like(embeds)
        for sid, (local_rows, token_index) in rows.items():
            grad[local_rows] = grads[sid].to(grad.device)[token_index.to(grad.device)]
        embeds.backward(grad)


class TextEngine(ModuleEngine):
    """Language model + lm_head: forward and backward of a micro-batch in one call."""

    role = "text"

    def __init__(self, model_cfg: Qwen2_5_VLConfig, cfg: Config, load: SampleLoader,
                 par: Parallel | None = None, device: str = "cpu",
                 state: dict[str, torch.Tensor] | None = None):
        par = par or single_process(cfg.text.parallel)
        module = build_text(model_cfg, cfg.train.seed, device, state)
        if par.inner_kind == "tp":
            from dhp.models.qwen2_5_vl.parallelize import parallelize_text

            parallelize_text(module, par.mesh["tp"], cfg.text.parallel.sequence_parallel)
        t = cfg.text
        super().__init__(module, cfg, par, list(module.layers), lambda name: (t.lr_scale, t.trainable),
                         forward_methods=("loss_sum",))
        self.load = load
        self.embeds_need_grad = cfg.vision.trainable or cfg.merger.trainable

    def forward_backward(
        self, sample_ids: list[int], pieces: dict[int, list[Piece]]
    ) -> tuple[float, int, dict[int, torch.Tensor]]:
        """Summed loss, supervised tokens, and d(summed loss)/d(image embeddings) per sample."""
        samples = [self.load(i, pixels=False) for i in sample_ids]  # image grids only: no pixel decoding
        batch = pack(samples)
        with_images = [s for s in samples if s.image_grid_thw.shape[0]]
        leaves = {s.index: assemble(pieces.get(s.index, []), s.num_image_tokens, s.index).to(self.device)
                  .requires_grad_(self.embeds_need_grad) for s in with_images}
        image_embeds = torch.cat([leaves[s.index] for s in with_images]) if with_images else None
        with self.autocast():
            loss = self.module.loss_sum(
                batch.input_ids.to(self.device),
                batch.position_ids.to(self.device),
                batch.targets.to(self.device),
                image_embeds,
                batch.cu_seqlens,
            )
        if loss.requires_grad:
            loss.backward()
        grads = {}
        if self.embeds_need_grad:
            grads = {i: leaf.grad for i, leaf in leaves.items()}
        return float(loss.detach()), batch.num_supervised, grads


def assemble(pieces: list[Piece], n_tokens: int, sample_id: int) -> torch.Tensor:
    """A sample's image embeddings [n_tokens, D] from the pieces the vision ranks computed."""
    if not pieces:
        raise RuntimeError(f"sample {sample_id}: no image embeddings arrived from the vision group")
    out = pieces[0][1].new_zeros(n_tokens, pieces[0][1].shape[-1])
    seen = 0
    for index, emb in pieces:
        out[index] = emb
        seen += len(index)
    if seen != n_tokens:
        raise RuntimeError(f"sample {sample_id}: {seen} of {n_tokens} image embeddings arrived")
    return out


def build_vision(model_cfg: Qwen2_5_VLConfig, seed: int, device: str,
                 state: dict[str, torch.Tensor] | None) -> VisionTransformer:
    """The vision module initialised exactly as ``build_model(cfg, seed=seed).visual`` (or from ``state``)."""
    module = VisionTransformer(model_cfg.vision)
    _init_or_load(module, seed, state)
    return module.to(device)


def build_text(model_cfg: Qwen2_5_VLConfig, seed: int, device: str,
               state: dict[str, torch.Tensor] | None) -> TextModel:
    module = TextModel(model_cfg.text, model_cfg.image_token_id)
    _init_or_load(module, seed + 1, state)
    return module.to(device)


def _init_or_load(module: nn.Module, seed: int, state: dict[str, torch.Tensor] | None) -> None:
    if state is None:
        torch.manual_seed(seed)
        init_weights(module, std=0.02)
        return
    missing, unexpected = module.load_state_dict(state, strict=False)  # copies into float32 master weights
    tied_ok = {"lm_head.weight"} if getattr(getattr(module, "cfg", None), "tie_word_embeddings", False) else set()
    missing = [k for k in missing if k not in tied_ok]
    if missing or unexpected:
        raise KeyError(f"weights do not fit the {type(module).__name__}: missing {missing}, unknown {unexpected}")
