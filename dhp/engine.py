"""Module engines: one module of the model, its optimizer and schedule, driven by sample ids.

The single-process reference trainer and every Ray worker run these same
classes; a layout only adds collectives (gradient all-reduce over the ranks that
hold partial gradients). That is what makes "every layout equals the reference"
a property of the code rather than a coincidence of two implementations.

Per micro-batch the driver calls::

    embeds = vision.forward(key, sample_ids)            # {sample_id: [n_img_tokens, D]}
    loss_sum, n, grads = text.forward_backward(ids, embeds)
    vision.backward(key, grads, sample_ids)

and per step: ``finish_gradients(1 / N_global)``, ``grad_norm_sq`` on both, one
global norm, ``step(clip_coef)`` on both. The loss is a global token mean:
micro-batches backpropagate summed losses, and the accumulated gradients are
scaled once by the supervised-token count of the whole global batch (never a
mean of micro-batch means).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import nn

from dhp.config import Config
from dhp.data.batch import Sample, pack
from dhp.models.qwen2_5_vl import Qwen2_5_VLConfig
from dhp.models.qwen2_5_vl.text import TextModel
from dhp.models.qwen2_5_vl.vision import VisionTransformer, init_weights

SampleLoader = Callable[..., Sample]  # (sample_id, pixels: bool) -> Sample


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


def make_optimizer(groups: list[dict], cfg: Config) -> torch.optim.Optimizer:
    t = cfg.train
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum)
    return torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps)


def _groups(named: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> list[dict]:
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
    """One module, its optimizer and LR schedule, and the process group of its data-parallel ranks."""

    role: str

    def __init__(self, module: nn.Module, cfg: Config, groups: list[dict], dp_group: dist.ProcessGroup | None):
        self.module = module
        self.cfg = cfg
        self.dp_group = dp_group
        self.trainable = [p for g in groups for p in g["params"]]
        self.optimizer = make_optimizer(groups, cfg) if self.trainable else None
        self.scheduler = (
            torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg)) if self.optimizer else None
        )
        self.device = next(module.parameters()).device
        self.amp = cfg.train.dtype == "bfloat16"

    # ---- autocast for mixed precision (float32 master weights) -------------------------
    def autocast(self):
        if not self.amp:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=torch.bfloat16)

    # ---- step ------------------------------------------------------------------------------
    def finish_gradients(self, scale: float) -> None:
        """Turn accumulated gradients of summed losses into gradients of the global token mean.

        ``scale`` is 1 / (supervised tokens of the whole global batch). Data-parallel ranks each
        hold a partial sum, so their gradients are then summed, never averaged.
        """
        for p in self.trainable:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad.mul_(scale)
        if self.dp_group is None or dist.get_world_size(self.dp_group) == 1:
            return
        for p in self.trainable:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM, group=self.dp_group)

    def grad_norm_sq(self) -> float:
        """This module's squared gradient norm, each parameter counted once (after reduction)."""
        total = torch.zeros((), dtype=torch.float64)
        for p in self.trainable:
            if p.grad is not None:
                total += p.grad.detach().double().pow(2).sum().cpu()
        return float(total)

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
        return {k: v.detach().to("cpu", copy=True) for k, v in self.module.state_dict().items()}


class VisionEngine(ModuleEngine):
    """Vision encoder + merger. Keeps each micro-batch's graph until its gradient comes back."""

    role = "vision"

    def __init__(self, model_cfg: Qwen2_5_VLConfig, cfg: Config, load: SampleLoader,
                 dp_group: dist.ProcessGroup | None = None, device: str = "cpu",
                 state: dict[str, torch.Tensor] | None = None):
        module = build_vision(model_cfg, cfg.train.seed, device, state)
        v, m = cfg.vision, cfg.merger
        lr = cfg.train.lr
        for name, p in module.named_parameters():
            p.requires_grad_(m.trainable if name.startswith("merger.") else v.trainable)
        blocks = [(n, p) for n, p in module.named_parameters() if not n.startswith("merger.")]
        merger = [(n, p) for n, p in module.named_parameters() if n.startswith("merger.")]
        groups = _groups(blocks, lr * v.lr_scale, cfg.train.weight_decay)
        groups += _groups(merger, lr * m.lr_scale, cfg.train.weight_decay)
        super().__init__(module, cfg, groups, dp_group)
        self.load = load
        self.pending: dict[object, tuple[torch.Tensor, list[int]]] = {}

    @property
    def needs_backward(self) -> bool:
        return bool(self.trainable)

    def forward(self, key: object, sample_ids: list[int]) -> dict[int, torch.Tensor]:
        """Image embeddings of each sample that has images: {sample_id: [n_img_tokens, D]} (detached)."""
        samples = [self.load(i) for i in sample_ids]
        with_images = [s for s in samples if s.image_grid_thw.shape[0]]
        if not with_images:
            return {}
        pixels = torch.cat([s.pixel_values for s in with_images]).to(self.device)
        grid = torch.cat([s.image_grid_thw for s in with_images])
        grad_ctx = nullcontext() if self.needs_backward else torch.no_grad()
        with grad_ctx, self.autocast():
            embeds = self.module(pixels, grid).float()  # [sum n_img_tokens, D]
        sizes = [s.num_image_tokens for s in with_images]
        if self.needs_backward:
            self.pending[key] = (embeds, sizes)
        pieces = embeds.detach().split(sizes)
        return {s.index: piece for s, piece in zip(with_images, pieces, strict=True)}

    def backward(self, key: object, grads: dict[int, torch.Tensor], sample_ids: list[int]) -> None:
        """Backpropagate the loss gradient w.r.t. the embeddings this engine produced for ``key``."""
        if not self.needs_backward or key not in self.pending:
            return
        embeds, _ = self.pending.pop(key)
        ordered = [grads[i] for i in sample_ids if i in grads]
        embeds.backward(torch.cat(ordered).to(embeds.device))


class TextEngine(ModuleEngine):
    """Language model + lm_head: forward and backward of a micro-batch in one call."""

    role = "text"

    def __init__(self, model_cfg: Qwen2_5_VLConfig, cfg: Config, load: SampleLoader,
                 dp_group: dist.ProcessGroup | None = None, device: str = "cpu",
                 state: dict[str, torch.Tensor] | None = None):
        module = build_text(model_cfg, cfg.train.seed, device, state)
        for p in module.parameters():
            p.requires_grad_(cfg.text.trainable)
        named = list({id(p): (n, p) for n, p in module.named_parameters()}.values())  # tied weights once
        groups = _groups(named, cfg.train.lr * cfg.text.lr_scale, cfg.train.weight_decay)
        super().__init__(module, cfg, groups, dp_group)
        self.load = load
        self.embeds_need_grad = cfg.vision.trainable or cfg.merger.trainable

    def forward_backward(
        self, sample_ids: list[int], embeds: dict[int, torch.Tensor]
    ) -> tuple[float, int, dict[int, torch.Tensor]]:
        """Summed loss, supervised tokens, and d(summed loss)/d(embeds) per sample."""
        samples = [self.load(i, pixels=False) for i in sample_ids]  # image grids only: no pixel decoding
        batch = pack(samples)
        with_images = [s.index for s in samples if s.image_grid_thw.shape[0]]
        leaves = {i: embeds[i].to(self.device).requires_grad_(self.embeds_need_grad) for i in with_images}
        image_embeds = torch.cat([leaves[i] for i in with_images]) if with_images else None
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
