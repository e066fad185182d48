"""Module engines: one module of the model, its parallel layout, optimizer and schedule, driven by sample ids.

The single-process reference trainer and every Ray worker run these same
classes; a layout only adds collectives. That is what makes "every layout
equals the reference" a property of the code rather than a coincidence of two
implementations. Nothing here knows a model family: the module, its
parallelization and its data hooks come from the family's ``Module`` objects (``dhp.models.spec``).

Per micro-batch the driver calls, for every encoder e (vision, audio, ...)::

    pieces[e] = encoder_e.forward(key, sample_ids)          # {sample_id: (token_index [n], {name: [n, D_name]})}
    loss_sum, n, grads = language.forward_backward(ids, pieces)   # grads: {e: {sample_id: {name: [n_e, D_name]}}}
    encoder_e.backward(key, grads[e])

and per step: ``finish_gradients(1 / N_global)``, ``grad_norm_sq`` on every module, one
global norm, ``step(clip_coef)`` on every module. The loss is a global token mean:
micro-batches backpropagate summed losses, and the accumulated gradients are
scaled once by the supervised-token count of the whole global batch (never a
mean of micro-batch means), then summed over the ranks that hold partial sums.

A piece is (token_index, named outputs): the encoder's outputs by name (``Encoder.outputs``: one,
``"embeds"``, for most encoders; an encoder may declare more, which the language model declares it takes,
``LanguageModel.inputs``), each of its own width and dtype, of the sample's placeholder tokens for that
encoder (in the order the language model places them) this rank computed.
Without sequence parallelism a rank computes them all; under Ulysses SP each rank
holds a slice.
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

from dhp.config import Config, ConfigError, ParallelConfig, TrainConfig, compute_dtype
from dhp.data.batch import Batch, PackedMeta, Sample, pack
from dhp.data.loader import pin_tensors, to_device
from dhp.models.spec import Encoder, Family, LanguageModel, Module, Named, ParallelizeOptions
from dhp.parallel.layout import Parallel

SampleLoader = Callable[..., Sample]  # (sample_id, pixels: bool) -> Sample
Piece = tuple[torch.Tensor, Named]  # (token index [n] into the sample's placeholder tokens, {output name: [n, D_name]})

__all__ = ["EncoderEngine", "LanguageEngine", "ModuleEngine", "Parallel", "Piece", "Precision", "assemble",
           "assemble_slice", "pack_language", "pack_multiple", "precision_of", "sequence_slice", "single_process",
           "slot_positions"]


def single_process(config: ParallelConfig | None = None) -> Parallel:
    return Parallel(config or ParallelConfig())


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


@dataclass(frozen=True)
class Precision:
    """What a module engine holds its weights in and computes in: ``train.dtype`` (resolved for the device) and
    ``train.precision`` (``docs/memory.md``).

    ``fp32_master``: float32 parameters, gradients and optimizer state; a bfloat16 compute dtype runs under
    autocast, or, under FSDP2 on CUDA, through FSDP2's ``MixedPrecisionPolicy`` (bf16 gathers, float32
    reduce-scatters; FSDP2 then casts itself and autocast is off). ``bf16`` / ``bf16_plain``: the parameters
    themselves are bfloat16 (so are their gradients, the gradient collectives and the AdamW state), the update
    stochastically rounded (``dhp.optim.BF16AdamW``) or rounded to nearest (``torch.optim.AdamW``)."""

    policy: str  # train.precision
    compute: torch.dtype  # the dtype the matmuls, the residual stream and the collectives carry
    params: torch.dtype  # the dtype parameters (and gradients, optimizer state) are held in
    autocast: bool  # forward under torch.autocast(compute)
    fsdp_bf16: bool  # FSDP2 gathers bf16 copies of float32 shards (MixedPrecisionPolicy)


def precision_of(train: TrainConfig, device_type: str, fsdp: bool) -> Precision:
    """The engine's ``Precision`` for ``train`` on a ``device_type`` device, with or without FSDP2 (ZeRO-3)."""
    compute = torch.bfloat16 if compute_dtype(train, device_type) == "bfloat16" else torch.float32
    if train.precision != "fp32_master":
        return Precision(train.precision, compute, torch.bfloat16, autocast=True, fsdp_bf16=False)
    amp = compute == torch.bfloat16
    fsdp_bf16 = amp and fsdp and device_type == "cuda"
    return Precision(train.precision, compute, torch.float32, autocast=amp and not fsdp_bf16, fsdp_bf16=fsdp_bf16)


def cast_parameters(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters of ``module`` to ``dtype`` in place (on the meta device: free), tied ones kept tied;
    buffers (rotary tables) keep their dtype."""
    done: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            setattr(m, name, done[id(p)])


def enable_tf32(device_type: str) -> None:
    """TF32 tensor cores for the float32 matmuls and convolutions left on CUDA (a float32 run, the loss's
    float32 pieces): 10 mantissa bits in the products, float32 accumulation. Nothing on the CPU."""
    if device_type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def compile_blocks(module: nn.Module) -> int:
    """``train.compile``: ``torch.compile`` the forward of every block (each element of the module's
    ``nn.ModuleList``s: decoder layers, vision and audio blocks), after the layout is applied.

    The block's ``forward`` is compiled, not its ``__call__``: the layout's hooks (FSDP2's gathers, TP's input
    preparation) stay eager around it, activation checkpointing (a wrapper of ``forward``) is compiled with it,
    and parameter names do not change. Host reads inside a block (segment boundaries) are graph breaks.
    Returns the number of blocks compiled."""
    n = 0
    for container in module.modules():
        if isinstance(container, nn.ModuleList):
            for block in container:
                block.forward = torch.compile(block.forward)
                n += 1
    return n


def optimizer_factory(cfg: Config, device_type: str = "cpu",
                      param_dtype: torch.dtype = torch.float32) -> Callable[[list[dict]], torch.optim.Optimizer]:
    """The optimizer ``train`` asks for: SGD, or AdamW (fused kernels on CUDA, ``foreach`` on the CPU); under
    ``train.precision=bf16`` (bfloat16 parameters) the stochastically rounded ``dhp.optim.BF16AdamW``."""
    t = cfg.train
    if t.optimizer == "sgd":
        return lambda groups: torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum)
    if t.precision == "bf16" and param_dtype == torch.bfloat16:
        from dhp.optim import BF16AdamW

        return lambda groups: BF16AdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps, seed=t.seed)
    kernel = {"fused": True} if device_type == "cuda" else {"foreach": True}
    return lambda groups: torch.optim.AdamW(groups, lr=t.lr, betas=t.betas, eps=t.eps, **kernel)


def param_groups(named: Iterable[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> list[dict]:
    """AdamW groups: no weight decay on biases and norm weights (1-D parameters).

    DTensor parameters (TP shards, FSDP2) and plain ones (replicated norms under TP) go in separate groups of the
    same hyperparameters: the ``foreach`` and fused AdamW kernels take one kind per call ("mixed torch.Tensor and
    DTensor" otherwise); the update of each element is the same either way."""
    from torch.distributed.tensor import DTensor

    buckets: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for _, p in named:
        if p.requires_grad:
            buckets.setdefault((p.ndim >= 2, isinstance(p, DTensor)), []).append(p)
    return [
        {"params": buckets[(decays, dt)], "lr": lr, "weight_decay": weight_decay if decays else 0.0}
        for decays in (True, False) for dt in (False, True) if buckets.get((decays, dt))
    ]


def build_module(definition: Module, model_cfg: Any, seed: int, device: str | torch.device,
                 state: dict[str, torch.Tensor] | None, hf_path: str | None = None,
                 family: Family | None = None) -> nn.Module:
    """The whole module on one device, unparallelized: built on the meta device, then ``materialize``."""
    with torch.device("meta"):
        module = definition.build(model_cfg)
    materialize(definition, module, model_cfg, device, seed, state, hf_path=hf_path, family=family)
    return module


def materialize(definition: Module, module: nn.Module, model_cfg: Any, device: str | torch.device, seed: int,
                state: dict[str, torch.Tensor] | None = None, par: Parallel | None = None,
                hf_path: str | None = None, family: Family | None = None) -> None:
    """Give a meta-device module (already parallelized, or not) its storage on ``device`` and its weights.

    ``to_empty`` allocates each rank's own shards only; the family's ``reset_buffers`` recomputes the
    non-persistent buffers; then every parameter is filled shard-locally: from ``state`` (full tensors, our
    module-local names) when given, else from the HF checkpoint at ``hf_path`` (this rank's slices only, read
    by the worker itself, names through ``family``'s weight adapter: by default the family of ``hf_path``'s
    model_type), else the family's deterministic init from ``seed + definition.seed_offset`` (the whole
    model's weights, in any layout). The layout's non-canonical parameters (``definition.layout_transforms``) are
    made whole in the canonical order, transformed, then sliced."""
    from dhp.errors import CheckpointError
    from dhp.parallel.lora import detached_adapters, init_adapters, is_adapter, load_adapters
    from dhp.parallel.materialize import to_empty

    to_empty(module, device)  # tied parameters stay tied
    definition.reset_buffers(module)
    transforms = definition.layout_transforms(module, par) if par is not None else {}
    with detached_adapters(module) as adapters:  # the base as the family knows it; LoRA adapters after it
        base_state = None if state is None else {k: v for k, v in state.items() if not is_adapter(k)}
        if base_state is not None:
            _load(module, base_state, transforms)
        elif hf_path:
            try:
                _load_hf(definition, module, model_cfg, hf_path, family, transforms)
            except CheckpointError as e:
                raise ConfigError(f"model.hf_path: {e}") from None
        else:
            definition.init(module, seed + definition.seed_offset, transforms or None)
    if state is not None and any(is_adapter(k) for k in state):
        load_adapters(adapters, state, transforms)
    else:
        init_adapters(adapters, seed + definition.seed_offset)


def _load_hf(definition: Module, module: nn.Module, model_cfg: Any, hf_path: str, family: Family | None,
             transforms: dict) -> None:
    """This rank's slices of ``module``'s tensors, straight from the checkpoint's safetensors files."""
    from dhp.parallel.materialize import SafetensorsSource, load_by_name

    if family is None:
        from dhp.models.registry import resolve_family

        family = resolve_family(None, hf_path)
    weights = family.weights  # the HF tensors of each of our keys (several for a fused q/k/v or gate/up)
    prefix = definition.weight_prefix + "."
    tied = {k[len(prefix):]: v[len(prefix):] for k, v in weights.tied(model_cfg).items()
            if k.startswith(prefix) and v.startswith(prefix)}
    load_by_name(module, SafetensorsSource(hf_path), key_of=lambda name: weights.hf_names(prefix + name), tied=tied,
                 transforms=transforms, what=f"{definition.name} module ({type(module).__name__})")


def _load(module: nn.Module, state: dict[str, torch.Tensor], transforms: dict | None = None) -> None:
    """Each rank's part of every parameter from full tensors ``state`` (module-local names, canonical layout)."""
    from dhp.parallel.materialize import DictSource, load_by_name

    load_by_name(module, DictSource(state), transforms=transforms, what=type(module).__name__, strict_unused=True)


class ModuleEngine:
    """One module, its optimizer and LR schedule, and the process groups of its layout."""

    def __init__(self, definition: Module, family: Family, model_cfg: Any, cfg: Config,
                 par: Parallel | None = None, device: str = "cpu") -> None:
        """Builds the module, then the family's ``parallelize`` applies, in this fixed order:
        1. tensor or sequence parallelism, 2. activation checkpointing, 3. ZeRO-3 (FSDP2) over the ranks
        that hold partial gradients; then 4. the optimizer (ZeRO-1: its state sharded over those ranks)."""
        self.definition, self.model_cfg, self.cfg = definition, model_cfg, cfg
        self.mcfg = cfg.module(definition.name)
        self.par = par or single_process(self.mcfg.parallel)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        with torch.device("meta"):  # no rank ever holds the whole module: parallelized on meta, then materialized
            self.module = definition.build(model_cfg)
        self._set_train_options()
        self.fsdp = self.mcfg.parallel.zero == 3 and self.par.distributed
        policy = self._set_precision()
        self.lora = self._apply_lora(family)  # {Linear name: (scale, target, r)}: wrapped on meta, before any layout
        self._set_trainable()
        self._hold_frozen_base()
        opts = ParallelizeOptions(activation_checkpointing=self.mcfg.activation_checkpointing,
                                  fsdp_mesh=self.reduce_mesh() if self.fsdp else None, mp_policy=policy,
                                  sequence_parallel=self.mcfg.parallel.sequence_parallel)
        definition.parallelize(self.module, self.par, opts)
        if cfg.train.compile:
            compile_blocks(self.module)
        self._set_trainable()  # TP and FSDP2 replace parameters: the flags hold on the new ones too
        materialize(definition, self.module, model_cfg, self.device, cfg.train.seed, None, self.par,
                    hf_path=cfg.model.hf_path, family=family)
        named = list({id(p): (n, p) for n, p in self.module.named_parameters()}.values())  # tied weights once
        groups = []
        for scale in sorted({self._group_of(n)[0] for n, _ in named}):
            chosen = [(n, p) for n, p in named if self._group_of(n)[0] == scale]
            groups += param_groups(chosen, cfg.train.lr * scale, cfg.train.weight_decay)
        self.trainable = [p for g in groups for p in g["params"]]
        self.optimizer = self._optimizer(groups) if self.trainable else None
        self.scheduler = (
            torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(cfg)) if self.optimizer else None
        )

    @property
    def name(self) -> str:
        return self.definition.name

    def _group_of(self, name: str) -> tuple[float, bool]:
        """(lr scale, trainable) of a parameter: the family's projector parameters follow the `merger` section;
        under ``<module>.lora`` the adapters train and the rest of the module is frozen."""
        from dhp.parallel.lora import is_adapter

        if self.mcfg.lora.enabled and is_adapter(name):
            return self.mcfg.lr_scale, self.mcfg.trainable
        if self.definition.projector_prefixes and _unwrapped(name).startswith(self.definition.projector_prefixes):
            return self.cfg.merger.lr_scale, self.cfg.merger.trainable
        return self.mcfg.lr_scale, self.mcfg.trainable and not self.mcfg.lora.enabled

    def _apply_lora(self, family: Family) -> dict[str, tuple[float, Any, int]]:
        """``<module>.lora``: LoRA adapters on the Linears its targets choose (checkpoint names, through the
        family's weight adapter), projectors trained whole (``merger.trainable``) left alone."""
        lora = self.mcfg.lora
        if not lora.enabled:
            return {}
        from dhp.parallel.lora import apply_lora, lora_modules, parts_by_weights

        skip = self.definition.projector_prefixes if self.cfg.merger.trainable else ()
        parts_of = parts_by_weights(family.weights, self.definition.weight_prefix, self.module, self.model_cfg)
        try:
            apply_lora(self.module, lora.r, lora.alpha, lora.dropout, lora.target_modules, parts_of, skip=skip,
                       dtype=self.precision.params)
        except ValueError as e:
            raise ConfigError(f"{self.name}.lora.target_modules: {e}") from None
        return {name: (m.scaling, m.target, m.r) for name, m in lora_modules(self.module)}

    def _hold_frozen_base(self) -> None:
        """A LoRA module's frozen base in the compute dtype (bfloat16 on CUDA): it is never stepped, so it needs
        no float32 master copy; the adapters keep the parameter dtype (their optimizer state with them)."""
        compute = self.precision.compute
        if not self.lora or compute == self.precision.params:
            return
        done: dict[int, nn.Parameter] = {}  # tied parameters stay tied
        for m in self.module.modules():
            for pname, p in list(m._parameters.items()):
                if p is not None and not p.requires_grad and p.is_floating_point() and p.dtype != compute:
                    if id(p) not in done:
                        done[id(p)] = nn.Parameter(p.detach().to(compute), requires_grad=False)
                    setattr(m, pname, done[id(p)])

    def _set_precision(self, device_type: str | None = None) -> Any:
        """``self.precision`` and ``self.amp`` from the config and the device (``device_type``: the one decisions
        follow, the engine's own by default; the planner passes the device it prices); bfloat16 parameters (a
        pure-bf16 policy) cast before any layout; TF32 on CUDA. Returns FSDP2's mixed-precision policy or None."""
        device_type = device_type or self.device.type
        self.precision = precision_of(self.cfg.train, device_type, self.fsdp)
        self.amp = self.precision.autocast
        if self.device.type == "cuda":
            enable_tf32(self.device.type)
        if self.precision.params != torch.float32:
            cast_parameters(self.module, self.precision.params)
        if not self.precision.fsdp_bf16:
            return None
        from dhp.parallel.sharding import mixed_precision_policy

        return mixed_precision_policy(torch.bfloat16)  # FSDP2 casts parameters and compute itself

    def _set_train_options(self) -> None:
        """The ``train`` settings a module's own code reads (``Module.set_train_options``: the attention kernel,
        the loss chunking)."""
        self.definition.set_train_options(self.module, self.cfg.train)

    def _set_trainable(self) -> None:
        for name, p in self.module.named_parameters():
            p.requires_grad_(self._group_of(name)[1])

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
        factory = optimizer_factory(self.cfg, self.device.type, self.precision.params)
        if self.par.config.zero == 1 and self.par.distributed and dist.get_world_size(self.reduce_group()) > 1:
            from dhp.parallel.sharding import make_zero1_optimizer

            return make_zero1_optimizer(groups, factory, self.reduce_group())
        return factory(groups)

    def autocast(self):
        """The compute dtype (``train.dtype=bfloat16``): autocast over float32 master weights (``fp32_master``),
        or over bfloat16 parameters (pure bf16: what float32 inputs meet)."""
        if not self.amp:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.precision.compute)

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
        reducer = self._gradient_reducer()
        if reducer is not None:  # TP-sharded gradients: each rank sums its own shard with its dp peers'
            reducer.finish()  # buckets, most already started by the last backward (arm_gradient_reduction)
        for p in self.trainable:
            p.grad.mul_(scale)

    def _gradient_reducer(self):
        """The bucketed reduction of this rank's replicated gradients (``dhp.parallel.grad_buckets``), or None
        where nothing is summed here (one rank; FSDP2 reduce-scatters itself; nothing trains)."""
        if getattr(self, "_reducer", None) is None:
            group = self.reduce_group()
            if self.fsdp or not self.trainable or group is None or dist.get_world_size(group) == 1:
                return None
            from dhp.parallel.grad_buckets import GradientReducer

            self._reducer = GradientReducer(self.trainable, group)
        return self._reducer

    def arm_gradient_reduction(self) -> None:
        """The next backward is this step's last on this rank: its gradient hooks start the all-reduces of the
        buckets they finish, overlapping the rest of the backward."""
        reducer = self._gradient_reducer()
        if reducer is not None:
            reducer.arm()

    def grad_norm_sq(self) -> torch.Tensor:
        """This module replica's squared gradient norm, each shard counted once (collective under TP/FSDP): a
        float64 scalar on the device (no host read here; the caller reads it once per step)."""
        from dhp.parallel.tensor import grad_norm_sq

        return grad_norm_sq(self.trainable, device=self.device)

    def step(self, clip_coef: float | torch.Tensor) -> None:
        """Clip (``clip_coef``: a host float, or a scalar on the device; 1: no clipping) and take the step."""
        if self.optimizer is None:
            return
        if isinstance(clip_coef, torch.Tensor) or clip_coef < 1.0:
            grads = [p.grad for p in self.trainable if p.grad is not None]
            if grads:  # one fused multiply per dtype and device, on the device
                from dhp.parallel.tensor import scale_grads

                scale_grads(grads, clip_coef)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0] if self.scheduler else 0.0

    def restore_schedule(self, step: int) -> None:
        """The learning rates and schedule position after ``step`` optimizer steps (for a resumed run)."""
        if self.scheduler is None:
            return
        f = lr_lambda(self.cfg)
        for group, base in zip(self.optimizer.param_groups, self.scheduler.base_lrs, strict=True):
            group["lr"] = base * f(step)
        self.scheduler.last_epoch = step
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Full (unsharded) weights on the CPU in the family's canonical layout; collective when sharded."""
        from torch.distributed.tensor import DTensor

        out = {}
        for k, v in self.module.state_dict().items():
            v = v.full_tensor() if isinstance(v, DTensor) else v
            out[_unwrapped(k)] = v.detach().to("cpu", copy=True)
        for name, t in self.layout_transforms().items():
            out[name] = t.to_canonical(out[name])
        return out

    def layout_transforms(self) -> dict:
        """Parameters whose global layout here is not the canonical one (the family says which)."""
        return self.definition.layout_transforms(self.module, self.par)


def _unwrapped(key: str) -> str:
    """State-dict key without activation-checkpoint wrapper prefixes."""
    return key.replace("._checkpoint_wrapped_module", "")


class EncoderEngine(ModuleEngine):
    """An encoder (and its projector). Keeps each micro-batch's graph until its gradient comes back."""

    definition: Encoder  # the family's description of the module this engine runs

    def __init__(self, definition: Encoder, family: Family, model_cfg: Any, cfg: Config, load: SampleLoader,
                 par: Parallel | None = None, device: str = "cpu") -> None:
        super().__init__(definition, family, model_cfg, cfg, par, device)
        self.load = load
        self.pending: dict[object, tuple[Named, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}

    @property
    def needs_backward(self) -> bool:
        return bool(self.trainable)

    def forward(self, key: object, sample_ids: list[int]) -> dict[int, Piece]:
        """This rank's outputs of each sample that carries this encoder's modality (detached), by name
        (``Encoder.outputs``): ``{sample id: (token index, {name: rows})}``.

        In the dtype the encoder computes them in (bfloat16 under ``train.dtype=bfloat16``): that is what
        crosses to the language model, which takes them as float32 leaves (``LanguageEngine``), as a cast
        here would have: the values are the same, the bytes on the router half."""
        samples = [self.load(i) for i in sample_ids]
        carrying = [s for s in samples if self.definition.num_placeholders(s, self.model_cfg)]
        if not carrying and not self.fsdp:
            return {}
        # FSDP2 ranks gather and reduce in lockstep: a replica without media still runs (on zero tokens)
        grad_ctx = nullcontext() if self.needs_backward else torch.no_grad()
        with grad_ctx, self.autocast():
            out, index = self.definition.encode(self.module, carrying, self.par, self.device)  # embeddings, [n]
        outputs = self.definition.named_outputs(out, self.model_cfg)  # {name: [n, D_name]}
        pieces, rows = {}, {}
        start = 0
        for s in carrying:
            end = start + self.definition.num_placeholders(s, self.model_cfg)
            mine = ((index >= start) & (index < end)).nonzero().flatten()  # local rows
            if len(mine):
                token_index = index[mine] - start  # which of the sample's placeholder tokens
                rows[s.index] = (mine, token_index)
                pieces[s.index] = (token_index, {n: t.detach()[mine] for n, t in outputs.items()})
            start = end
        if self.needs_backward:
            self.pending[key] = (outputs, rows)
        return pieces

    def backward(self, key: object, grads: dict[int, Named]) -> None:
        """Backpropagate the loss gradients w.r.t. the outputs this rank produced for ``key``.

        ``grads`` holds each sample's whole gradient of each output by name [n_tokens, D_name]; this rank takes
        its rows."""
        if not self.needs_backward or key not in self.pending:
            return
        _, rows = self.pending[key]
        own = {sid: {n: g.to(self.device)[token_index.to(self.device)] for n, g in grads[sid].items()}
               for sid, (_, token_index) in rows.items()}
        self.backward_rows(key, own)

    def backward_rows(self, key: object, grads: dict[int, Named]) -> None:
        """Backpropagate from the gradients of this rank's own rows: ``grads[sid][name]`` [rows, D_name] in the
        order of the token index ``forward`` gave for ``sid`` (what the point-to-point data plane sends back);
        one backward through every output at once."""
        if not self.needs_backward or key not in self.pending:
            return
        outputs, rows = self.pending.pop(key)
        seeds = {name: torch.zeros_like(out) for name, out in outputs.items()}
        for name, grad in seeds.items():
            for sid, (local_rows, _) in rows.items():  # every output's gradient must have come back
                grad[local_rows] = grads[sid][name].to(device=grad.device, dtype=grad.dtype)
        self._backward_from(outputs, seeds)

    def backward_parts(self, key: object, parts: list[tuple[int, torch.Tensor, Named]]) -> None:
        """Backpropagate from gradients that come back in parts: (sample id, the token indices of its rows,
        {name: rows}). A sample's rows may be split over several parts, in any order: under Megatron SP each
        text rank hands back the rows of its own sequence slice, and a sample can straddle two slices. Each part's
        rows go where ``forward`` put those tokens (device index ops, no host read); every row of every sample
        must come back once."""
        if not self.needs_backward or key not in self.pending:
            return
        outputs, rows = self.pending.pop(key)
        got: dict[int, int] = {}
        for sid, token_index, _ in parts:
            got[sid] = got.get(sid, 0) + len(token_index)
        missing = {sid: (len(local_rows), got.get(sid, 0)) for sid, (local_rows, _) in rows.items()
                   if got.get(sid, 0) != len(local_rows)}
        if missing:
            raise RuntimeError(f"{self.name}: gradients of micro-batch {key} came back for the wrong rows: "
                               f"{{sample: (rows here, rows back)}} {missing}")
        seeds = {name: torch.zeros_like(out) for name, out in outputs.items()}
        for sid, token_index, named in parts:
            local_rows, forward_index = rows[sid]
            order = torch.argsort(forward_index)
            at = local_rows[order[torch.searchsorted(forward_index[order], token_index.to(forward_index.device))]]
            for name, grad in seeds.items():
                grad[at] = named[name].to(device=grad.device, dtype=grad.dtype)
        self._backward_from(outputs, seeds)

    @staticmethod
    def _backward_from(outputs: Named, seeds: Named) -> None:
        """One backward through every output that requires a gradient, seeded with its gradient."""
        tensors = [out for out in outputs.values() if out.requires_grad]
        if tensors:
            torch.autograd.backward(tensors, [seeds[n] for n, out in outputs.items() if out.requires_grad])

    def output_layout(self, key: object) -> tuple[tuple[str, int, torch.dtype], ...]:
        """(name, width, dtype) of each output kept for ``key``'s backward, in ``outputs`` order: what their
        gradients come back as (empty: none kept)."""
        if key not in self.pending:
            return ()
        return tuple((n, t.shape[-1], t.dtype) for n, t in self.pending[key][0].items())


class LanguageEngine(ModuleEngine):
    """The language model + head: forward and backward of a micro-batch in one call."""

    definition: LanguageModel

    def __init__(self, family: Family, model_cfg: Any, cfg: Config, load: SampleLoader,
                 par: Parallel | None = None, device: str = "cpu") -> None:
        super().__init__(family.language, family, model_cfg, cfg, par, device)
        self.encoders = family.encoders
        self.definition.check_outputs(self.encoders, model_cfg)  # every output moved is one the module consumes
        self.load = load
        self.encoder_trains = {e.name: encoder_trains(cfg, e) for e in self.encoders}
        self._token_rows: dict[tuple[str, int], torch.Tensor] = {}  # (encoder, sample) -> its rows here (slices)
        self.pack_multiple = pack_multiple(cfg, family.language.name)

    def forward_backward(
        self, sample_ids: list[int], pieces: dict[str, dict[int, list[Piece]]], sequence_slice: bool = False
    ) -> tuple[torch.Tensor, int, dict[str, dict[int, Named]]]:
        """Summed loss (a detached float32 scalar on the device: read it once per step, not per micro-batch),
        supervised tokens, and per encoder d(summed loss)/d(output) per sample, by output name.

        Each encoder's named outputs of a placeholder id reach ``loss_sum``'s ``media`` through
        ``LanguageModel.handover`` (the tensor itself where the module consumes one input).

        The batch's segment boundaries, placeholder positions and supervised rows are host metadata
        (``PackedMeta``): the micro-batch reads no value back from the device.

        ``sequence_slice`` (Megatron sequence parallelism, the point-to-point data plane): ``pieces`` hold only
        the placeholder rows that fall in this TP rank's slice of the packed sequence (``sequence_slice``); they
        are placed there, and the gradients returned are of those rows only (``gradient_rows`` addresses them
        by token index). Otherwise every rank gets, and returns, whole samples."""
        from dhp.ops.attention import host_metadata

        with host_metadata():  # the data pipeline's work: host tensors, host metadata
            samples = [self.load(i, pixels=False) for i in sample_ids]  # placeholders only: no media decoding
            batch, meta = pack_language(samples, self.encoders, self.model_cfg, self.pack_multiple)
        inputs = self._inputs(batch)  # copies issued before the media are placed: they overlap it
        bounds = self._own_slice(batch.input_ids.numel()) if sequence_slice else None
        media: dict[int, Any] = {}
        leaves: dict[str, dict[int, Named]] = {}
        self._token_rows = {}
        for enc in self.encoders:
            carrying = [s for s in samples if enc.num_placeholders(s, self.model_cfg)]
            if not carrying:
                continue
            got = pieces.get(enc.name, {})
            if bounds is not None:
                leaves[enc.name] = self._slice_leaves(enc, carrying, got, meta, bounds, media)
                continue
            leaves[enc.name] = {  # float32 leaves per output, whatever dtype the pieces travelled in
                s.index: self._leaves(enc, assemble(got.get(s.index, []), enc.num_placeholders(s, self.model_cfg),
                                                    s.index, enc.name)) for s in carrying
            }
            ids = enc.placeholder_ids(self.model_cfg)  # a sample's embeddings: the first id's, then the next's
            chunks = [{n: leaf.split(list(enc.placeholder_counts(s, self.model_cfg)))
                       for n, leaf in leaves[enc.name][s.index].items()} for s in carrying]
            for k, token_id in enumerate(ids):
                media[token_id] = self.definition.handover({n: torch.cat([c[n][k] for c in chunks])
                                                            for n in chunks[0]}, self.model_cfg)
        with self.autocast():
            loss = self.module.loss_sum(
                *inputs,
                media,
                batch.cu_seqlens,
                meta=meta,
            )
        if loss.requires_grad:
            loss.backward()
        grads = {name: {i: {n: leaf.grad if leaf.grad is not None else torch.zeros_like(leaf)
                            for n, leaf in named.items()} for i, named in per_sample.items()}
                 for name, per_sample in leaves.items() if self.encoder_trains[name]}
        return loss.detach(), meta.num_supervised, grads

    def _leaves(self, enc: Encoder, named: Named) -> Named:
        """A sample's arrived outputs as float32 gradient leaves on the device (a leaf per output)."""
        trains = self.encoder_trains[enc.name]
        return {n: t.to(self.device, torch.float32).requires_grad_(trains) for n, t in named.items()}

    def _inputs(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The packed ids, positions and targets on the device: on CUDA put in pinned memory first, so that their
        ``non_blocking`` copies (``dhp.data.loader.to_device``) do not make the host wait."""
        host = (batch.input_ids, batch.position_ids, batch.targets)
        return to_device(pin_tensors(host) if self.device.type == "cuda" else host, self.device)

    def gradient_rows(self, encoder: str, sample_id: int, token_index: torch.Tensor) -> torch.Tensor:
        """Rows of the last ``forward_backward``'s ``grads[encoder][sample_id]`` that hold the gradients of the
        sample's placeholder tokens ``token_index`` (on the device): the token index itself for whole samples,
        its place among this rank's rows under ``sequence_slice``."""
        rows = self._token_rows.get((encoder, sample_id))
        return token_index if rows is None else rows[token_index]

    def _own_slice(self, n_tokens: int) -> tuple[int, int]:
        """[start, end) of this rank's slice of a packed sequence of ``n_tokens`` (Megatron SP)."""
        p = self.mcfg.parallel
        if not (p.sequence_parallel and self.par.inner_kind == "tp"):
            raise ValueError(f"{self.definition.name}: pieces of a sequence slice, but {self.definition.name}.parallel "
                             "has no Megatron sequence parallelism (tp > 1 and sequence_parallel)")
        return sequence_slice(n_tokens, p.tp, self.par.inner_rank)

    def _slice_leaves(self, enc: Encoder, carrying: list[Sample], got: dict[int, list[Piece]], meta: Any,
                      bounds: tuple[int, int], media: dict[int, Any]) -> dict[int, Named]:
        """This rank's rows of ``enc``'s outputs of each sample: float32 leaves [own rows, D_name] per output,
        in token-index order; into ``media``, per placeholder id, (rows (``handover``), their flat positions):
        ``TextModel.embed`` places them and leaves the id's other slots (the other ranks' slices, cut away before
        the first layer) at zero; every named part is cut the same way."""
        from dhp.ops.attention import host_metadata

        lo, hi = bounds
        ids = enc.placeholder_ids(self.model_cfg)
        rows: dict[int, list[Named]] = {t: [] for t in ids}
        positions: dict[int, list[torch.Tensor]] = {t: [] for t in ids}
        taken = dict.fromkeys(ids, 0)  # each id's positions in the batch, consumed sample by sample
        leaves = {}
        for s in carrying:
            counts = list(enc.placeholder_counts(s, self.model_cfg))
            with host_metadata():
                pos = torch.cat([meta.placeholders[t][taken[t]: taken[t] + c]
                                 for t, c in zip(ids, counts, strict=True)])  # flat positions, token-index order
                for t, c in zip(ids, counts, strict=True):
                    taken[t] += c
                mine = ((pos >= lo) & (pos < hi)).nonzero().flatten()  # own token indices, ascending
                ends = torch.tensor(counts).cumsum(0)
                per_id = [int(n) for n in torch.bucketize(mine, ends, right=True).bincount(minlength=len(ids))]
            arrived = got.get(s.index, [])
            if not len(mine):
                if arrived:
                    raise RuntimeError(f"sample {s.index}: {enc.name} embeddings arrived for slots outside this "
                                       f"rank's sequence slice [{lo}, {hi})")
                continue
            named, token_rows = assemble_slice(arrived, mine, len(pos), s.index, enc.name, self.device)
            leaves[s.index] = leaf = self._leaves(enc, named)
            self._token_rows[(enc.name, s.index)] = token_rows
            split = {n: t.split(per_id) for n, t in leaf.items()}
            for k, (t, sel) in enumerate(zip(ids, mine.split(per_id), strict=True)):
                rows[t].append({n: parts[k] for n, parts in split.items()})
                positions[t].append(pos[sel])
        for t in ids:
            with host_metadata():
                where = torch.cat([torch.zeros(0, dtype=torch.long), *positions[t]])
            value = None if not rows[t] else self.definition.handover(
                {n: torch.cat([r[n] for r in rows[t]]) for n in rows[t][0]}, self.model_cfg)
            media[t] = (value, where)
        return leaves


def encoder_trains(cfg: Config, definition: Encoder) -> bool:
    """Whether any parameter of the encoder (or its projector) trains: else it never runs a backward."""
    return cfg.module(definition.name).trainable or bool(definition.projector_prefixes and cfg.merger.trainable)


TP_PAD_MULTIPLE = 64  # data.pad_to_multiple_of's default under tensor parallelism


def pack_multiple(cfg: Config, language: str) -> int:
    """The multiple the language model's packed micro-batches are padded to (``dhp.data.batch.pack``):
    ``data.pad_to_multiple_of``, unset 64 under tensor parallelism (lengths that repeat hit DTensor's sharding
    cache) else 1; under Megatron sequence parallelism also a multiple of tp (the sequence is cut in tp equal
    slices). One rule for the language workers, the encoders that send them slices, and the planner."""
    p = cfg.module(language).parallel
    want = cfg.data.pad_to_multiple_of or (TP_PAD_MULTIPLE if p.tp > 1 else 1)
    return math.lcm(want, p.tp) if p.sequence_parallel and p.tp > 1 else want


def pack_language(samples: list[Sample], encoders: Iterable[Encoder], model_cfg: Any,
                  multiple: int) -> tuple[Batch, PackedMeta]:
    """The language model's micro-batch as it runs: ``samples`` packed to ``multiple`` (``pack_multiple``) and
    its host metadata (every encoder's placeholder positions; the supervised rows rounded up the same way). The
    one packing of the engine and the planner's fake run."""
    batch = pack(samples, multiple)
    return batch, batch.meta([t for enc in encoders for t in enc.placeholder_ids(model_cfg)], multiple)


def sequence_slice(n_tokens: int, tp: int, rank: int) -> tuple[int, int]:
    """[start, end) of TP rank ``rank``'s slice of a packed sequence of ``n_tokens`` under Megatron sequence
    parallelism: the sequence padded to a multiple of ``tp`` and cut in ``tp`` equal contiguous chunks, the
    ``Shard(1)`` cut a family's language model makes before its first layer (``end`` may pass ``n_tokens`` on
    the last ranks: padding). The data plane sends each rank the placeholder rows of its slice only."""
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"sequence_slice: rank {rank} of tp {tp}")
    size = (n_tokens + (-n_tokens % tp)) // tp
    return rank * size, (rank + 1) * size


def slot_positions(input_ids: torch.Tensor, placeholder_ids: tuple[int, ...] | list[int]) -> torch.Tensor:
    """Positions in one sample's tokens (host) of an encoder's placeholder tokens, in token-index order: every
    position of the first id, ascending, then the next id's (the order ``LanguageEngine`` takes a sample's
    embeddings in)."""
    ids = input_ids.reshape(-1)
    return torch.cat([torch.zeros(0, dtype=torch.long), *((ids == t).nonzero().flatten() for t in placeholder_ids)])


def assemble_slice(pieces: list[Piece], mine: torch.Tensor, n_tokens: int, sample_id: int, module: str,
                   device: torch.device) -> tuple[Named, torch.Tensor]:
    """A sample's rows of this rank's sequence slice, per output ``{name: [len(mine), D_name]}``, in the order
    of ``mine`` (its own token indices, host), from the pieces that arrived (token indices on the device); and
    the map from token index to row (on the device: the arrived indices are never read on the host)."""
    seen = sum(len(index) for index, _ in pieces)
    if seen != len(mine):
        raise RuntimeError(f"sample {sample_id}: {seen} {module} embeddings arrived for the {len(mine)} slots of "
                           "this rank's sequence slice")
    token_rows = torch.full((n_tokens,), -1, dtype=torch.long)
    token_rows[mine] = torch.arange(len(mine))
    token_rows = token_rows.to(device)
    out = _empty_like_outputs(pieces, len(mine))
    for index, named in pieces:
        at = token_rows[index.to(device)]
        for name, rows in named.items():
            out[name][at] = rows
    return out, token_rows


def _empty_like_outputs(pieces: list[Piece], n: int) -> Named:
    """Zeros [n, D_name] of each output of the first piece, in its dtype and device."""
    return {name: rows.new_zeros(n, rows.shape[-1]) for name, rows in pieces[0][1].items()}


def assemble(pieces: list[Piece], n_tokens: int, sample_id: int, module: str = "vision") -> Named:
    """A sample's outputs ``{name: [n_tokens, D_name]}`` of one encoder, from the pieces its ranks computed."""
    if not pieces:
        raise RuntimeError(f"sample {sample_id}: no embeddings arrived from the {module} group")
    out = _empty_like_outputs(pieces, n_tokens)
    seen = 0
    for index, named in pieces:
        if named.keys() != out.keys():
            raise RuntimeError(f"sample {sample_id}: {module} pieces with outputs {sorted(named)} and {sorted(out)}")
        for name, rows in named.items():
            out[name][index] = rows
        seen += len(index)
    if seen != n_tokens:
        raise RuntimeError(f"sample {sample_id}: {seen} of {n_tokens} {module} embeddings arrived")
    return out
