"""One rank of one module group, run for real but without memory: the real build, parallelize, forward,
backward and optimizer step under ``FakeTensorMode``, in a fake process group of the group's size.

What runs is the code ``dhp train`` runs: the family's ``build`` on the meta device, its ``parallelize``
(TP / Ulysses SP, activation checkpointing, FSDP2) with a ``Parallel`` whose process groups and DeviceMesh
come from ``dhp.runtime.mesh`` over torch's fake backend, ``to_empty``, the engine's parameter groups and
optimizer (ZeRO-1 included), the family's ``encode`` (its own sharding under SP: a rank holds
1/sp of the sequence) or the language model's ``loss_sum``, the engine's ``finish_gradients`` and ``step``.
Tensors are fake: they have shapes, dtypes and devices, no storage, so a 72B model "runs" on a laptop.

The inputs are the family's: ``family.synthetic_sample`` makes a sample of the job's media sizes (an image of N
patches, a clip of F mel frames...) with real host metadata and fake media; an encoder's group encodes it, the
language model's group packs it as the engine does and takes every encoder's embeddings at its placeholders,
their width read off a shape-only run of the encoder's ``encode``. Nothing here names a module or a family.

Three observers watch the same run:

* ``MemTracker`` (``FSDPMemTracker`` under FSDP2) from ``torch.distributed._tools``: the rank's peak and
  its parts (weights, gradients, optimizer state, activations, the rest);
* ``dhp.plan.ops.OpTally``: what the rank dispatched, priced by ``dhp.plan.costs``, and its FLOPs of a
  micro-batch (forward, backward, recomputation; ``ops.tally_flops``, equal to ``FlopCounterMode``'s, which
  ``measure(flop_counter=True)`` runs beside it as the tests' check);
* ``dhp.parallel.comm.CommCounter``: bytes per collective kind, per micro-batch and per step.

The fake backend gives every group rank 0: a rank 0 of each inner group is measured (shards are balanced, so
every rank holds the same to within one attention window or one row of an uneven vocabulary shard).
"""

from __future__ import annotations

import gc
from collections import Counter
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from dhp.plan.ops import OpTally, extrapolate_phases, extrapolate_regions, tally_flops

GiB = 1024**3

# ---- what to measure, and what comes back -------------------------------------------------------------------------


@dataclass(frozen=True)
class SampleBatch:
    """A micro-batch of real samples for a job (``dhp bench --profile``: the data set's own), in place of the
    family's synthetic ones: each sample's host metadata as loaded (ids, labels, positions, grids), its media
    data as meta tensors of the loaded shapes (no data). Compared and hashed by ``digest``; picklable, so a
    job that holds it goes to a pool's worker as any other."""

    digest: str
    size: int  # how many samples
    blob: bytes = field(compare=False, repr=False)

    @classmethod
    def of(cls, samples: list) -> SampleBatch:
        import hashlib
        import io

        buf = io.BytesIO()
        torch.save(samples, buf)
        data = buf.getvalue()
        return cls(hashlib.blake2b(data, digest_size=8).hexdigest(), len(samples), data)

    def samples(self) -> list:
        import io

        return torch.load(io.BytesIO(self.blob), weights_only=False)


def shape_sample(full: Any, meta: Any) -> Any:
    """A loaded sample for a ``SampleBatch``: ``full`` (loaded with its media) with every media tensor that the same
    sample loaded without media (``meta``) holds at another shape (the pixels, the audio features: data) made a
    meta tensor of its shape; the rest (ids, positions, grids: host metadata) kept as it is."""
    import copy

    out = copy.copy(full)
    out.media = {k: torch.empty(t.shape, dtype=t.dtype, device="meta")
                 if isinstance(t, torch.Tensor) and tuple(t.shape) != tuple(meta.media[k].shape) else t
                 for k, t in full.media.items()}
    return out


@dataclass(frozen=True)
class GroupJob:
    """One module group's layout and its work per micro-batch: ``micro_batch_size`` samples of the family's
    ``synthetic_sample`` with ``media`` and ``text_tokens``."""

    module: str  # the module's name in its family ("vision", "audio", "text")
    dp: int = 1
    inner: int = 1  # sp or tp ranks per replica
    inner_kind: str = "none"  # "sp" | "tp" | "none"
    zero: int = 0
    activation_checkpointing: bool = False
    sequence_parallel: bool = False  # Megatron sequence parallelism inside TP (text): residual and norms 1/tp
    media: tuple[tuple[str, int], ...] = ()  # a sample's media: (encoder, tokens of its own input), ``media_of``
    text_tokens: int = 4096  # text tokens per sample besides the placeholders
    micro_batch_size: int = 1
    device: str = "cuda"  # the engine's decisions follow this device type (FSDP2 bf16 policy on cuda)
    dtype: str = "bfloat16"
    precision: str = "fp32_master"  # train.precision: fp32_master | bf16 | bf16_plain (docs/memory.md)
    optimizer: str = "adamw"
    loss_chunk_tokens: int | None = None  # train.loss_chunk_tokens; None: the trainer's default
    static: bool = False  # build, gradients and optimizer state only: no forward (closed-form checks)
    lora_rank: int = 0  # <module>.lora.r: adapters only, the base frozen in the compute dtype (0: trained whole)
    lora_targets: str = "all-linear"  # <module>.lora.target_modules (a regex or all-linear; a list joined by ",")
    pad_to_multiple_of: int | None = None  # data.pad_to_multiple_of (the language model's packing: pack_multiple)
    batch: SampleBatch | None = None  # real samples for the micro-batch (then ``media``/``text_tokens`` size only
    # the encoders' output widths, and an encoder's micro-batch is the samples that carry its media)

    @property
    def ranks(self) -> int:
        return self.dp * self.inner

    def tokens(self, encoder: str) -> int:
        """The sample's tokens of ``encoder``'s own input (0: none)."""
        return dict(self.media).get(encoder, 0)


@dataclass
class GroupResult:
    """Bytes, FLOPs and collective bytes of one rank of a group (per micro-batch unless said otherwise)."""

    peak: int = 0  # this rank's peak over forward, backward, gradient reduction and optimizer step
    peak_fb: int = 0  # ... over the micro-batch (forward, backward)
    peak_step: int = 0  # ... over the gradient reduction and the optimizer step
    weights: int = 0  # parameters (local shards) and buffers
    grads: int = 0  # gradients, all of them (after the backward)
    optimizer: int = 0  # optimizer state
    activations: int = 0  # activations at the micro-batch's peak
    retained: int = 0  # what a forward leaves for its backward (held while the text group runs)
    flops: float = 0.0  # forward + backward (+ recomputation) of one micro-batch
    counted_flops: float = 0.0  # the same by torch's FLOP counter, where ``measure(flop_counter=True)``
    comm: dict[str, int] = field(default_factory=dict)  # payload bytes per kind, one micro-batch
    comm_sent: dict[str, int] = field(default_factory=dict)  # bytes sent to other ranks (all-to-all)
    step_comm: dict[str, int] = field(default_factory=dict)  # payload bytes per kind, once per step
    router: int = 0  # embedding bytes in + their gradients out, one micro-batch of this rank
    parameters: int = 0  # local parameter elements
    comm_calls: dict[str, int] = field(default_factory=dict)  # collective calls per kind, one micro-batch
    step_comm_calls: dict[str, int] = field(default_factory=dict)  # ... once per step
    ops: list[dict[str, float]] = field(default_factory=list)  # ``ops.OpTally`` regions of one micro-batch
    forward_regions: int = 0  # how many of ``ops`` are the forward's (the rest: the backward)
    forward_comm: dict[str, int] = field(default_factory=dict)  # ``comm``'s payload bytes of the forward alone
    forward_comm_calls: dict[str, int] = field(default_factory=dict)  # ``comm_calls`` of the forward alone
    step_ops: list[dict[str, float]] = field(default_factory=list)  # ... of the gradient reduction and step
    breakdown: dict[str, int] = field(default_factory=dict)  # the tracker's peak snapshot

    @property
    def temporaries(self) -> int:
        return max(0, self.peak - self.weights - self.grads - self.optimizer - self.activations)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---- inputs: the family's synthetic samples -----------------------------------------------------------------------


def media_of(tokens: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """A job's ``media`` from ``{encoder: tokens of its own input}`` (vision: patches; audio: mel frames)."""
    return tuple(sorted((str(k), int(v)) for k, v in tokens.items() if v))


def family_of(family: Any = None) -> Any:
    """``family``, or the registry's default family (looked up by name: the planner imports no family)."""
    from dhp.models.registry import DEFAULT_FAMILY, get_family

    return family if family is not None else get_family(DEFAULT_FAMILY)


def is_language(family: Any, module: str) -> bool:
    return module == family.language.name


def _real():
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


def _shape_mode():
    """A ``FakeTensorMode`` of its own, for the family's synthetic samples: the media come out fake (shapes, no
    memory), the host metadata real (the family makes it under ``host_metadata``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode(allow_non_fake_inputs=True)


def synthetic_samples(job: GroupJob, model_cfg: Any, family: Any, media: dict[str, int] | None = None) -> list:
    """``micro_batch_size`` samples of the family's ``synthetic_sample`` for ``job`` (``media``: the job's own by
    default), made under ``_shape_mode``: their media tensors are fake (``materialized`` later, where they are
    to be counted), their host metadata real."""
    media = dict(job.media) if media is None else media
    with _shape_mode():
        return [family.synthetic_sample(model_cfg, media, job.text_tokens, index=i)
                for i in range(job.micro_batch_size)]


def sample_tokens(family: Any, model_cfg: Any, media: dict[str, int], text_tokens: int) -> int:
    """Tokens of the language model's sequence in one synthetic sample: the text and every placeholder."""
    with _shape_mode():
        return int(family.synthetic_sample(model_cfg, media, text_tokens).input_ids.shape[0])


def _map_tensors(sample: Any, fn: Any) -> Any:
    """A shallow copy of ``sample`` with ``fn`` applied to each tensor field (and tensor values of dict fields)."""
    import copy

    out = copy.copy(sample)
    for name, value in list(vars(out).items()):
        if isinstance(value, torch.Tensor):
            setattr(out, name, fn(value))
        elif isinstance(value, dict) and any(isinstance(v, torch.Tensor) for v in value.values()):
            setattr(out, name, {k: fn(v) if isinstance(v, torch.Tensor) else v for k, v in value.items()})
    return out


def materialized(sample: Any) -> Any:
    """``sample`` with its media (the fake tensors of ``synthetic_samples``) made afresh in the current mode:
    fake under the planner's run, real zeros in a real one, and counted by the tracker where they are made, as
    a rank's loaded sample is. Host metadata (real tensors) is kept as it is."""
    from torch._subclasses.fake_tensor import is_fake

    return _map_tensors(sample, lambda t: torch.zeros(t.shape, dtype=t.dtype) if is_fake(t) else t)


def without_media(sample: Any) -> Any:
    """``sample`` as the language model's rank loads it (``pixels=False``): every media tensor empty."""
    from torch._subclasses.fake_tensor import is_fake

    return _map_tensors(sample, lambda t: torch.zeros((0, *t.shape[1:]), dtype=t.dtype) if is_fake(t) else t)


@dataclass(frozen=True)
class MediaInput:
    """What the router delivers to the language model for one placeholder id and one named encoder output
    (``Encoder.outputs``): rows, width, payload dtype."""

    token_id: int
    rows: int
    width: int
    dtype: torch.dtype  # what crosses the router (the encoder's compute dtype); the language model takes float32
    name: str = "embeds"  # the encoder output it is


_OUTPUT_WIDTH: dict[tuple, tuple[tuple[str, int], ...]] = {}


def encoder_widths(family: Any, name: str, model_cfg: Any, tokens: int) -> tuple[tuple[str, int], ...]:
    """(name, width) of each of the encoder's named outputs, from the shapes of its ``encode`` output on a
    synthetic sample (a shape-only run of the shallowest depth variant, on one process): the language model's
    inputs as the family makes them, no config field read."""
    from dhp.parallel.layout import Parallel

    key = (id(family), name, repr(model_cfg), tokens)
    if key not in _OUTPUT_WIDTH:
        enc = family.module(name)
        variants = enc.depth_variants(model_cfg)
        cfg = variants[0][0] if variants else model_cfg
        with _shape_mode(), torch.no_grad():
            sample = family.synthetic_sample(cfg, {name: tokens}, 0)
            module = enc.build(cfg)
            enc.reset_buffers(module)
            out, _ = enc.encode(module, [sample], Parallel(_config(GroupJob(name)).module(name).parallel), "cpu")
        _OUTPUT_WIDTH[key] = tuple((n, int(t.shape[-1])) for n, t in enc.named_outputs(out, cfg).items())
    return _OUTPUT_WIDTH[key]


def media_inputs(job: GroupJob, model_cfg: Any, family: Any, samples: list, payload: torch.dtype) -> list[MediaInput]:
    """Per placeholder id of every encoder and per named output of it, the rows the micro-batch's samples hold
    (``placeholder_counts``) and the output's width: the language model's media, as the router delivers them."""
    out = []
    media = dict(job.media)
    for enc in family.encoders:
        counts = [enc.placeholder_counts(s, model_cfg) for s in samples]
        if not any(sum(c) for c in counts):
            continue
        if enc.name not in media:
            raise ValueError(f"the {job.module} job's samples hold {enc.name} placeholders but its media "
                             f"{media} has no {enc.name} entry")
        widths = encoder_widths(family, enc.name, model_cfg, media[enc.name])
        for k, tid in enumerate(enc.placeholder_ids(model_cfg)):
            rows = sum(c[k] for c in counts)
            if rows:
                out += [MediaInput(int(tid), rows, width, payload, output) for output, width in widths]
    return out


@dataclass
class _Inputs:
    """A micro-batch of ``job``, made before the run (outside the tracker; media fake): an encoder's samples, or
    the language model's packed host tensors and its media."""

    samples: list = field(default_factory=list)  # an encoder's (media fake, ``materialized`` in the run)
    batch: Any = None  # the language model's packed batch (host tensors)
    media: list[MediaInput] = field(default_factory=list)
    meta: Any = None  # the batch's ``PackedMeta``, as the engine makes it (the loss's head on the supervised rows)


def batch_samples(batch: SampleBatch) -> list:
    """A ``SampleBatch``'s samples as the planner's run takes them: media fake (made under ``_shape_mode``, made
    afresh where the run counts them: ``materialized``), host metadata real."""
    samples = batch.samples()  # (loaded outside the mode: the host metadata stays real)
    with _shape_mode():
        return [_map_tensors(s, lambda t: torch.empty(t.shape, dtype=t.dtype) if t.is_meta else t) for s in samples]


def _inputs(job: GroupJob, model_cfg: Any, family: Any) -> _Inputs:
    from dhp.config import compute_dtype

    real = batch_samples(job.batch) if job.batch is not None else None
    if not is_language(family, job.module):
        if real is not None:  # the samples that carry this encoder's media (none: no micro-batch, as the engine)
            enc = family.module(job.module)
            return _Inputs(samples=[s for s in real if enc.num_placeholders(s, model_cfg)])
        if not job.tokens(job.module):
            return _Inputs()  # no media for this encoder: it runs no micro-batch (as the engine skips it)
        return _Inputs(samples=synthetic_samples(job, model_cfg, family, {job.module: job.tokens(job.module)}))
    from dhp.engine import pack_language, pack_multiple

    samples = real if real is not None else synthetic_samples(job, model_cfg, family)
    cfg = _config(job)
    payload = torch.bfloat16 if compute_dtype(cfg.train, job.device) == "bfloat16" else torch.float32
    media = media_inputs(job, model_cfg, family, samples, payload)
    with _real():  # as the engine packs, and its host metadata
        batch, meta = pack_language([without_media(s) for s in samples], family.encoders, model_cfg,
                                    pack_multiple(cfg, job.module))
    return _Inputs(batch=batch, media=media, meta=meta)



# ---- the fake world ---------------------------------------------------------------------------------------------


def _fake_world(job: GroupJob, spec_parallel: Any, fake: bool = True, joining: bool = False):
    """A fake default group of the group's size, the runtime's mesh groups and DeviceMesh over it (made
    outside FakeTensorMode), and this rank's ``Parallel``. ``fake=False``: the same over the default group
    already there (a real multi-process run of ``job.ranks`` processes, the tests' check of the prediction).
    ``joining``: a second group on the same ranks (collocated) joins the fake group already there."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from dhp.parallel.layout import Parallel
    from dhp.runtime.mesh import ModuleLayout, create_mesh_groups, device_mesh

    if fake and not (dist.is_initialized() and dist.get_backend() == "fake" and dist.get_world_size() == job.ranks
                     and joining):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=job.ranks)
        backend, rank = "fake", 0
    elif fake:
        backend, rank = "fake", 0
    else:
        assert dist.get_world_size() == job.ranks, (dist.get_world_size(), job.ranks)
        backend, rank = dist.get_backend(), dist.get_rank()
    if job.ranks == 1:
        return Parallel(spec_parallel)
    name = "sp" if job.inner_kind == "sp" else "tp"
    layout = ModuleLayout(job.module, job.dp, job.inner, name)
    groups = create_mesh_groups([layout], backend, rank)
    mesh = device_mesh(layout, rank, groups, "cpu")
    return Parallel(config=spec_parallel, inner_kind=name if job.inner > 1 else "none", dp_rank=rank // job.inner,
                    inner_rank=rank % job.inner, dp_group=groups["dp"], inner_group=groups[name],
                    module_group=dist.group.WORLD, mesh=mesh)


def _config(job: GroupJob) -> Any:
    from dhp.config import Config, LoRAConfig, ModuleConfig, ParallelConfig

    cfg = Config()
    cfg.train.dtype = job.dtype
    cfg.train.precision = job.precision
    cfg.train.optimizer = job.optimizer
    cfg.data.pad_to_multiple_of = job.pad_to_multiple_of
    if job.loss_chunk_tokens is not None:
        cfg.train.loss_chunk_tokens = job.loss_chunk_tokens
    sp = job.inner if job.inner_kind == "sp" else 1
    tp = job.inner if job.inner_kind == "tp" else 1
    targets = job.lora_targets.split(",") if "," in job.lora_targets else job.lora_targets
    cfg.modules[job.module] = ModuleConfig(activation_checkpointing=job.activation_checkpointing,
                                           parallel=ParallelConfig(dp=job.dp, sp=sp, tp=tp, zero=job.zero,
                                                                   sequence_parallel=job.sequence_parallel),
                                           lora=LoRAConfig(r=job.lora_rank, target_modules=targets))
    return cfg


def _engine_shell(spec: Any, model_cfg: Any, cfg: Any, par: Any) -> tuple[Any, Any]:
    """A bare ``ModuleEngine`` (no module yet) and its FSDP2 mesh, made outside FakeTensorMode (a DeviceMesh
    reads its ranks)."""
    from dhp.engine import ModuleEngine

    eng = ModuleEngine.__new__(ModuleEngine)
    eng.definition, eng.model_cfg, eng.cfg = spec, model_cfg, cfg
    eng.mcfg = cfg.module(spec.name)
    eng.par = par
    eng.device = torch.device("cpu")
    eng.fsdp = eng.mcfg.parallel.zero == 3 and par.distributed
    return eng, (eng.reduce_mesh() if eng.fsdp else None)


def _engine_build(eng: Any, fsdp_mesh: Any, device_type: str, family: Any = None) -> Any:
    """The rest of ``ModuleEngine.__init__``, less the weights' values (fake tensors have none): the family's
    build (on fake CPU tensors, which hold no storage, where the engine builds on meta and calls ``to_empty``:
    a fake parameter cannot be swapped in), trainable flags, the family's ``parallelize`` with the engine's
    options (the FSDP2 bf16 policy when the device is CUDA, as the engine decides there), ``reset_buffers``,
    the engine's parameter groups and optimizer (ZeRO-1 over the reduce group). Under ``<module>.lora`` the
    adapters are added before any layout and the frozen base held in the compute dtype, as the engine does."""
    from dhp.engine import lr_lambda, param_groups
    from dhp.models.spec import ParallelizeOptions

    spec, cfg = eng.definition, eng.cfg
    with torch.device("cpu"):
        eng.module = spec.build(eng.model_cfg)
    eng._set_train_options()
    policy = eng._set_precision(device_type)  # train.dtype / train.precision as the engine resolves them there
    eng.lora = eng._apply_lora(family_of(family))  # {} without <module>.lora
    eng._set_trainable()
    eng._hold_frozen_base()
    opts = ParallelizeOptions(activation_checkpointing=eng.mcfg.activation_checkpointing, fsdp_mesh=fsdp_mesh,
                              mp_policy=policy, sequence_parallel=eng.mcfg.parallel.sequence_parallel)
    spec.parallelize(eng.module, eng.par, opts)
    eng._set_trainable()
    spec.reset_buffers(eng.module)
    named = list({id(p): (n, p) for n, p in eng.module.named_parameters()}.values())
    groups = param_groups(named, cfg.train.lr, cfg.train.weight_decay)
    eng.trainable = [p for g in groups for p in g["params"]]
    eng.optimizer = eng._optimizer(groups) if eng.trainable else None
    eng.scheduler = torch.optim.lr_scheduler.LambdaLR(eng.optimizer, lr_lambda(cfg)) if eng.optimizer else None
    return eng


def _local_bytes(tensors) -> int:
    from dhp.parallel.tensor import local_tensor

    seen, total = set(), 0
    for t in tensors:
        if t is None or id(t) in seen:
            continue
        seen.add(id(t))
        loc = local_tensor(t)
        total += loc.numel() * loc.element_size()
    return total


def _optimizer_state(opt: Any) -> list[torch.Tensor]:
    from torch.distributed.optim import ZeroRedundancyOptimizer

    inner = opt.optim if isinstance(opt, ZeroRedundancyOptimizer) else opt
    return [v for st in inner.state.values() for v in st.values()
            if isinstance(v, torch.Tensor) and v.numel() > 1]


def _warm_optimizer(eng: Any) -> None:
    """The optimizer state of a later step exists already (an AdamW step on zero gradients, no values)."""
    if eng.optimizer is None:
        return
    for p in eng.trainable:
        p.grad = torch.zeros_like(p)
    eng.optimizer.step()
    eng.optimizer.zero_grad(set_to_none=True)


# ---- FLOPs of CPU attention (the fake run's SDPA picks the CPU flash kernel) ------------------------------------

_FLOPS_REGISTERED = False


def _register_cpu_attention_flops() -> None:
    global _FLOPS_REGISTERED
    if _FLOPS_REGISTERED:
        return
    from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

    aten = torch.ops.aten

    @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu)
    def _fwd(q, k, v, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(q, k, v) // (2 if is_causal else 1)

    @register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward)
    def _bwd(grad_out, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
        return sdpa_backward_flop_count(grad_out, q, k, v) // (2 if is_causal else 1)

    _FLOPS_REGISTERED = True


def _local_flop_counter() -> Any:
    """``FlopCounterMode`` counting what this rank computes. The stock mode sees a DTensor op before DTensor
    desugars it and counts it at its *global* shapes: a TP rank's matmuls counted whole, ``t`` times its
    share (a uniform-TP layout looked ``t`` times slower than it is). Here the mode steps aside for DTensor
    (as ``MemTracker`` does), counts the local ops DTensor runs, and not the global-shape ops of its sharding
    propagation (``_untracked_sharding_propagation``)."""
    from torch.distributed.tensor import DTensor
    from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

    class _Local(_FlopCounterMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if any(issubclass(t, DTensor) for t in types):
                return NotImplemented
            if _PROPAGATING[0]:  # DTensor's shape inference, not the rank's work
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

    class LocalFlopCounterMode(FlopCounterMode):
        def __enter__(self) -> Any:
            self.flop_counts.clear()
            self.mod_tracker.__enter__()
            self.mode = _Local(self)
            self.mode.__enter__()
            return self

    return LocalFlopCounterMode(display=False)


# ---- the run ---------------------------------------------------------------------------------------------------


def measure(job: GroupJob, model_cfg: Any, family: Any = None, fake: bool = True,
            flop_counter: bool = False) -> GroupResult:
    """Run one rank of ``job`` under FakeTensorMode and a fake process group; see the module docstring.
    ``fake=False``: the same code on real tensors, on this rank of the real default group (tests). ``family``:
    the model family (``dhp.models.spec.Family``; default: the registry's default). The FLOPs are the tally's
    (``ops.tally_flops``); ``flop_counter``: count them by torch's ``FlopCounterMode`` too, into
    ``counted_flops`` (the tally's check; off in the planner's runs: one more dispatch mode on every op, about
    15 % of a run's time)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker
    from torch.distributed._tools.mem_tracker import MemTracker

    from dhp.parallel.comm import CommCounter
    from dhp.parallel.sharding import is_fsdp

    _register_cpu_attention_flops()
    family = family_of(family)
    spec = family.module(job.module)
    inputs = _inputs(job, model_cfg, family)  # before the run's fake mode: shapes only, host metadata real
    static = job.static or not (inputs.samples or inputs.batch is not None)
    cfg = _config(job)
    par = _fake_world(job, cfg.module(job.module).parallel, fake)
    res = GroupResult()
    try:
        eng, fsdp_mesh = _engine_shell(spec, model_cfg, cfg, par)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext():
            eng = _engine_build(eng, fsdp_mesh, job.device, family)
            _warm_optimizer(eng)
            fsdp = is_fsdp(eng.module)
            tracker = _peak_only(FSDPMemTracker)(eng.module, eng.optimizer) if fsdp else _peak_only(MemTracker)()
            tracker.collect_in_backward = has_checkpointed_blocks(eng.module)
            if fsdp:
                _know_fsdp_roots(tracker, eng.module)
            else:
                tracker.track_external(eng.module, eng.optimizer)
            res.parameters = sum(p.numel() for p in {id(q): q.to_local() if hasattr(q, "to_local") else q
                                                     for q in eng.module.parameters()}.values())
            res.weights = _local_bytes(list(eng.module.parameters()) + list(eng.module.buffers()))
            res.optimizer = _local_bytes(_optimizer_state(eng.optimizer)) if eng.optimizer else 0
            flops, comm = _local_flop_counter() if flop_counter else nullcontext(), CommCounter()
            tally, step_tally = OpTally(skip=_propagating), OpTally(skip=_propagating)
            with ExitStack() as stack:
                stack.enter_context(_untracked_sharding_propagation())
                stack.enter_context(tracker)
                if not static:
                    def at_backward() -> None:  # the forward's share of the tally and of the collectives
                        res.forward_regions = tally.cut()
                        res.forward_comm, res.forward_comm_calls = dict(comm.bytes), dict(comm.calls)

                    with flops, comm, tally:
                        after_fwd, before, res.router = _micro_batch(eng, inputs, tracker, at_backward)
                    res.retained = max(0, after_fwd - before)
                res.grads = _local_bytes([p.grad for p in eng.trainable]) if not static else 0
                fb = _device_snapshot(tracker.get_tracker_snapshot("peak"))
                tracker._peak_mem, tracker._peak_mem_snap = {}, {}  # the step's own peak from here
                step = CommCounter()
                with step, step_tally:
                    eng.finish_gradients(1.0)  # real code: zero grads where a parameter got none, dp/sp reduce
                if static:
                    res.grads = _local_bytes([p.grad for p in eng.trainable])
                with step, step_tally:  # (the global norm is a few scalars, and a host read: left out)
                    eng.step(1.0)
            st = _device_snapshot(tracker.get_tracker_snapshot("peak"))
            res.peak_fb, res.peak_step = fb.get("Total", 0), st.get("Total", 0)
            res.breakdown = fb if res.peak_fb >= res.peak_step else st
            res.peak = max(res.peak_fb, res.peak_step)
            res.activations = fb.get("Activation", 0)
            res.comm = dict(comm.bytes)
            res.comm_sent = dict(comm.sent)
            res.step_comm = dict(step.bytes)
            res.comm_calls, res.step_comm_calls = dict(comm.calls), dict(step.calls)
            res.ops = tally.tally() if not static else []
            res.step_ops = step_tally.tally()
            res.flops = tally_flops(res.ops)
            res.counted_flops = float(flops.get_total_flops()) if flop_counter else 0.0
    finally:
        if fake and dist.is_initialized():
            dist.destroy_process_group()
    return res


_PROPAGATING = [0]  # > 0 while DTensor's sharding propagator runs an op on global-shape fake tensors


def _propagating() -> bool:
    return _PROPAGATING[0] > 0


@contextmanager
def _untracked_sharding_propagation():
    """DTensor's sharding propagator learns an op's output shape by running it on fake tensors of the
    *global* shape, under the fake mode it detects: ours. ``MemTracker`` skips those ops only when it was
    entered outside any fake mode (its identity check on the active fake mode); under ours it counts them
    as allocations. The propagator caches per op schema, so only the first run of a process paid them (a
    32B text rank under TP 8 "held" the full-vocabulary logits, 4.7 GB, once): a run's figures depended on
    what ran before it in the process. Marked here, and ignored by ``_peak_only``'s trackers."""
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    orig = ShardingPropagator._propagate_tensor_meta_non_cached

    def marked(self: Any, op_schema: Any) -> Any:
        _PROPAGATING[0] += 1
        try:
            return orig(self, op_schema)
        finally:
            _PROPAGATING[0] -= 1

    ShardingPropagator._propagate_tensor_meta_non_cached = marked
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = orig


class _GC:
    """Python's cyclic garbage collector, run at the end of every module's backward in a run with checkpointed
    blocks (``_peak_only``'s trackers, ``collect_in_backward``).

    The tracker's module hooks (``ModTracker``) leave the autograd graphs that a checkpointed block builds
    when it recomputes its forward reachable only through reference cycles, so their tensors are freed when
    the cyclic collector next runs, not when their backward is done. A run without the tracker has no such
    cycles: a hookless storage tracker sees the same peak with the collector on or off. So the tracked peak
    under checkpointing followed the collector's timing: tiny width, 32 text layers, 54.3 MB above the weights
    and state against 14.3 MB without the tracker; collected at each block's boundaries, 16.8 MB; at each
    module's, 14.3 MB, the hookless figure (``test_plan_collocated``).

    What a collection costs (2026-12-06): 448 full collections at about 2.5 ms each took 40 % of a checkpointed
    32B text FSDP 8 run. Two cuts, each leaving the peaks of the 32B runs at 16k patches (text TP 8, text FSDP
    8, vision SP 8, checkpointed) the same to the byte and the tiny width's equal to the hookless tracker's:

    * at the end of each module's backward only, not at its start too: a module's backward starts where the
      one before it ended (a sibling's, or a child's inside its parent), so that collection found nothing new;
    * of the two younger generations only (``gc.collect(1)``): the garbage is the graph the module's backward
      just released, made since the last collection, not yet aged into the oldest generation.

    The 32B plan at two lengths went from 127 s to 107 s. ``gc.freeze()`` at entry keeps the heap from before
    the run out of every collection (a full collection of a planner process's heap takes 0.2 s)."""

    @staticmethod
    def enter(tracker: Any) -> None:
        gc.collect()
        gc.freeze()
        mod = tracker._mod_tracker
        if mod._user_pre_bw_hook is None:  # FSDPMemTracker registers no module hooks of its own

            def at(module: Any, *_: Any) -> None:
                _GC.at(tracker, module)

            mod.register_user_hooks(post_bw_hook=at)
            tracker._dhp_gc_hooks = True

    @staticmethod
    def at(tracker: Any, module: Any) -> None:
        if tracker.collect_in_backward and module is not None:
            gc.collect(1)

    @staticmethod
    def exit(tracker: Any) -> None:
        if getattr(tracker, "_dhp_gc_hooks", False):
            tracker._mod_tracker.clear_user_hooks()
            tracker._dhp_gc_hooks = False
        gc.unfreeze()


def has_checkpointed_blocks(*modules: torch.nn.Module) -> bool:
    """Whether ``apply_activation_checkpointing`` wrapped a block of any of ``modules``."""
    return any(getattr(m, "_dhp_checkpointed", False) for root in modules for m in root.modules())


def _peak_only(cls: type) -> type:
    """The tracker, keeping the rank's peak only: the stock ``_update_peak_stats`` also walks every module's
    statistics on every op (most of a 32B run's time); the planner reads the device peak and its parts. Ops
    run by DTensor's sharding propagation are not the rank's (``_untracked_sharding_propagation``)."""

    class PeakOnly(cls):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if _PROPAGATING[0]:
                return func(*args, **(kwargs or {}))
            return super().__torch_dispatch__(func, types, args, kwargs)

        def __enter__(self) -> Any:
            first = self._depth == 0
            out = super().__enter__()
            if first:
                _GC.enter(self)
            return out

        def __exit__(self, *args: Any) -> None:
            super().__exit__(*args)
            if self._depth == 0:
                _GC.exit(self)

        collect_in_backward = False  # set for a run with checkpointed blocks (``_GC``)

        def _pre_bw_hook(self, module: Any, args: Any) -> None:  # MemTracker's (FSDPMemTracker: _GC.enter)
            _GC.at(self, module)
            super()._pre_bw_hook(module, args)

        def _post_bw_hook(self, module: Any, args: Any) -> None:
            super()._post_bw_hook(module, args)
            _GC.at(self, module)

        def _track_module_params_and_buffers(self, module: Any, install_grad_hooks: bool = True) -> tuple[int, int]:
            # the stock one hooks every parameter's gradient, and a frozen one (a LoRA base) takes no hook
            out = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
            if install_grad_hooks:
                for param in module.parameters():
                    if param.requires_grad and self._param_to_grad_hook_handles.get(param) is None:
                        self._param_to_grad_hook_handles[param] = (
                            param.register_hook(self._gradient_seen),
                            param.register_post_accumulate_grad_hook(lambda p: self._gradient_seen(p.grad)))
            return out

        def _gradient_seen(self, grad: torch.Tensor) -> None:
            from torch.distributed._tools.mem_tracker import _MemRefType

            self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

        def _update_peak_stats(self, peak_state: Any) -> None:
            for dev, snap in self._curr_mem_snap.items():
                total = snap["Total"]
                if self._peak_mem.get(dev, 0) < total:
                    self._peak_mem[dev] = total
                    self._peak_mem_snap[dev] = dict(snap)

    PeakOnly.__name__ = f"PeakOnly{cls.__name__}"
    return PeakOnly


def _know_fsdp_roots(tracker: Any, module: torch.nn.Module) -> None:
    """``FSDPMemTracker`` registers a unit when its ``__call__`` runs; a root driven through a registered
    forward method (``TextModel.loss_sum``, ``VisionTransformer.encode_rows``) never goes through it, and its
    backward hook would then find no entry. Register the root up front (its blocks register themselves). A
    root with several forward methods (the Omni audio encoder's ``encode_chunks`` then ``pool_project``) enters
    its pre-forward more than once in one forward, which the tracker takes for a second iteration and refuses:
    its per-module statistics (which the planner does not read: the device peak only) are begun afresh at
    each entry instead."""
    from torch.distributed._tools.fsdp2_mem_tracker import _FSDPModMemStats
    from torch.distributed.fsdp import FSDPModule
    from torch.utils.weak import WeakIdKeyDictionary

    if not isinstance(module, FSDPModule):
        return
    if module not in tracker.memory_tracking:
        stat = _FSDPModMemStats(type(module).__name__)
        stat.local_peak = {}
        tracker.memory_tracking[module] = stat

    class _RootReentrant(WeakIdKeyDictionary):
        def __contains__(self, key: object) -> bool:
            return key is not module and super().__contains__(key)

    tracker.memory_tracking = _RootReentrant(dict(tracker.memory_tracking.items()))


def _device_snapshot(snap: dict) -> dict[str, int]:
    """The tracker's snapshot of the (one) device, ``{category: bytes}``."""
    out: Counter[str] = Counter()
    for dev_snap in snap.values():
        for k, v in dev_snap.items():
            out[getattr(k, "value", str(k))] += int(v)
    return dict(out)


def _current_total(tracker: Any) -> int:
    return _device_snapshot(tracker.get_tracker_snapshot("current")).get("Total", 0)


def _encoder_forward(eng: Any, inputs: _Inputs) -> tuple[list[torch.Tensor], int]:
    """The encoder's forward on the micro-batch's samples, their media made here (counted, as a rank's loaded
    samples are) -> (its embeddings as float32, as the language model takes them; router bytes: the embeddings
    out and their gradients back, in the dtype the encoder computes them in, this rank's rows)."""
    samples = [materialized(s) for s in inputs.samples]
    with eng.autocast():
        out, _ = eng.definition.encode(eng.module, samples, eng.par, eng.device)
        named = eng.definition.named_outputs(out, eng.model_cfg)  # every named output crosses the router
        router = sum(2 * t.numel() * t.element_size() for t in named.values())
        embeds = [t.float() for t in named.values()]
    del samples  # the engine's forward drops its samples on return: what stays is what the graph saved
    return embeds, router


def _language_loss(eng: Any, inputs: _Inputs) -> tuple[torch.Tensor, int]:
    """The language model's ``loss_sum`` on the packed micro-batch (its host tensors made here, as the engine's
    pack is) with the encoders' embeddings as the router delivers them (float32 gradient leaves) -> (the loss;
    router bytes: the embeddings in and their gradients out, in the payload dtype)."""
    b = inputs.batch
    with _real():  # host metadata: real tensors, counted where they are made
        ids, pos, targets, cu = (t.clone() for t in (b.input_ids, b.position_ids, b.targets, b.cu_seqlens))
    named: dict[int, dict[str, torch.Tensor]] = {}
    for m in inputs.media:
        named.setdefault(m.token_id, {})[m.name] = torch.zeros(m.rows, m.width, requires_grad=True)
    media = {tid: eng.definition.handover(parts, eng.model_cfg) for tid, parts in named.items()}
    with eng.autocast():
        loss = eng.module.loss_sum(ids, pos, targets, media, cu, meta=inputs.meta)
    return loss, sum(2 * m.rows * m.width * m.dtype.itemsize for m in inputs.media)


def _micro_batch(eng: Any, inputs: _Inputs, tracker: Any, at_backward: Any = None) -> tuple[int, int, int]:
    """One micro-batch through the engine's code: the encoder's forward then backward of its embeddings'
    gradient, or the language model's ``loss_sum`` and backward (``at_backward()`` is called between the two).
    -> (memory after forward, before it, router bytes)."""
    at_backward = at_backward or (lambda: None)
    before = _current_total(tracker)
    if inputs.batch is not None:
        loss, router = _language_loss(eng, inputs)
        after = _current_total(tracker)
        at_backward()
        loss.backward()
        return after, before, router
    embeds, router = _encoder_forward(eng, inputs)
    after = _current_total(tracker)
    at_backward()
    torch.autograd.backward(embeds, [torch.zeros_like(t) for t in embeds])
    return after, before, router


# ---- deep stacks: two shallow runs, extrapolated along the depth --------------------------------------------------

_NUMERIC = ("peak_fb", "peak_step", "weights", "grads", "optimizer", "activations", "retained", "flops", "router",
            "parameters")


def measure_model(job: GroupJob, model_cfg: Any, family: Any = None) -> GroupResult:
    """``measure``, on the whole model or, for a deep stack, on the two shallow copies of it that the module's
    ``depth_variants`` gives (one and two depth steps), whose results are extended along the depth: every block
    of a stack holds and computes the same, so the peak, its parts, the FLOPs and the bytes of every collective
    are linear in the number of blocks (``tests/unit/test_plan_collocated.py`` checks the line against the
    whole model)."""
    family = family_of(family)
    plan = family.module(job.module).depth_variants(model_cfg)
    if plan is None:
        return measure(job, model_cfg, family)
    (a_cfg, b_cfg), steps = plan
    a, b = measure(job, a_cfg, family), measure(job, b_cfg, family)
    return extrapolate(a, b, steps - 1)  # the whole depth lies steps - 1 steps beyond the first variant


def extrapolate(a: GroupResult, b: GroupResult, t: float) -> GroupResult:
    """``a + t (b - a)`` for every figure (``t``: how many times the step from a to b the real depth lies
    beyond a). The micro-batch's peak and the optimizer step's peak are extended apart (each is linear in the
    depth; which one is the larger can change with it) and the peak is the larger of the two."""
    out = GroupResult()
    for name in _NUMERIC:
        x, y = getattr(a, name), getattr(b, name)
        val = x + t * (y - x)
        setattr(out, name, type(x)(round(val)) if isinstance(x, int) else val)
    out.peak = max(out.peak_fb, out.peak_step)
    out.ops, out.forward_regions = extrapolate_phases(a.ops, b.ops, a.forward_regions, b.forward_regions, t)
    out.step_ops = extrapolate_regions(a.step_ops, b.step_ops, t)
    for name in ("comm", "comm_sent", "step_comm", "comm_calls", "step_comm_calls", "breakdown", "forward_comm",
                 "forward_comm_calls"):
        x, y = getattr(a, name), getattr(b, name)
        setattr(out, name, {k: int(round(x.get(k, 0) + t * (y.get(k, 0) - x.get(k, 0)))) for k in {*x, *y}})
    return out


# ---- a collocated rank: both groups' engines in one process, the collocated schedule under one tracker ------------


def measure_collocated(jobs: dict[str, GroupJob], model_cfg: Any, family: Any = None, fake: bool = True,
                       rounds: int = 2) -> int:
    """The peak of one collocated rank holding every group (same ranks, one engine each), running the order the
    Ray backend submits under ``placement=collocated`` (``encoders_ahead`` 0): per round each encoder's forward,
    the language model's forward-backward, each encoder's backward; then every group's gradient reduction and
    optimizer step. Why: the planner predicts this peak from separate runs of each group (``planner.evaluate``:
    a group's own peak plus what the others hold meanwhile); this is the run it stands for, under one tracker
    (``tests/unit/test_plan_collocated.py``). Two rounds, so that each group's gradients exist while the others
    run, as they do from a replica's second micro-batch on. Non-FSDP layouts only (dhp's collocated rows are
    SP / TP). Fake: run it after the process's other fake runs (the language model's mesh groups are made last
    here, and DTensor keeps meshes of a past fake world that a later ``measure`` of the same layout picks up)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    _register_cpu_attention_flops()
    family = family_of(family)
    order = [m for m in family.module_names if m in jobs]  # the encoders, then the language model
    assert family.language.name in jobs and len({jobs[m].ranks for m in order}) == 1, jobs
    assert all(jobs[m].zero != 3 for m in order), jobs
    inputs = {m: _inputs(jobs[m], model_cfg, family) for m in order}
    shells = {}
    try:
        for i, k in enumerate(order):
            cfg = _config(jobs[k])
            par = _fake_world(jobs[k], cfg.module(k).parallel, fake, joining=i > 0)
            shells[k] = _engine_shell(family.module(k), model_cfg, cfg, par)
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else nullcontext():
            eng = {k: _engine_build(e, mesh, jobs[k].device, family) for k, (e, mesh) in shells.items()}
            for e in eng.values():
                _warm_optimizer(e)
            tracker = _peak_only(MemTracker)()
            tracker.collect_in_backward = has_checkpointed_blocks(*(e.module for e in eng.values()))
            tracker.track_external(*(x for e in eng.values() for x in (e.module, e.optimizer) if x is not None))
            with _untracked_sharding_propagation(), tracker:
                for _ in range(rounds):
                    _collocated_round(eng, inputs, family.language.name)
                    tracker.reset_mod_stats()  # the module statistics only: the device peak stays
                for e in eng.values():
                    e.finish_gradients(1.0)
                for e in eng.values():
                    e.step(1.0)
            return _device_snapshot(tracker.get_tracker_snapshot("peak")).get("Total", 0)
    finally:
        if fake and dist.is_initialized():
            dist.destroy_process_group()


def _collocated_round(eng: dict[str, Any], inputs: dict[str, _Inputs], language: str) -> None:
    """One micro-batch round of a collocated rank: each encoder's output (and its graph) is held while the
    language model runs, and released by the encoder's backward."""
    held = [_encoder_forward(e, inputs[k])[0] for k, e in eng.items() if k != language and inputs[k].samples]
    loss, _ = _language_loss(eng[language], inputs[language])
    loss.backward()
    del loss
    for embeds in held:
        torch.autograd.backward(embeds, [torch.zeros_like(t) for t in embeds])
