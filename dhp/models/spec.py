"""What a model family implements, so that the runtime, engines, data and planner never import one.

A family (``dhp/models/<family>/``) is one or more encoders feeding one language model, each module run by
its own group of workers with its own layout. The interface is three classes with a default for every method
a module need not change (torchtitan's ``ModelSpec``, as objects): ``Module`` (build, init, reset buffers,
blocks, check_layout, parallelize, layout transforms, FLOPs and the balancing cost, depth variants),
``Encoder`` (placeholder ids and counts, encode) and ``LanguageModel`` (``loss_sum``). ``Family`` holds the
modules and adds the model configs, the processor (a raw sample's media into model inputs,
``dhp.data.processor``), the weight adapter (HF names, ``dhp.models.adapter``), synthetic samples for the
planner and the whole model. Generic code calls methods and never asks whether a hook is set.

A leaf of the model-interface layer (``docs/design.md``): it imports nothing from dhp at import time; a
default that needs a helper imports it inside the method, from a layer below.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from dhp.models.adapter import WeightAdapter

InnerKind = Literal["sp", "tp"]


@dataclass(frozen=True)
class SampleInfo:
    """What the planner knows of a sample without decoding its media (from validation)."""

    index: int
    num_tokens: int  # tokens in the language model's sequence
    image_grids: tuple[tuple[int, int, int], ...] = ()  # (t, h, w) patches per image
    token_counts: dict[int, int] = field(default_factory=dict)  # special token id -> occurrences
    audio_frames: tuple[int, ...] = ()  # log-mel frames per audio clip (100 per second)


@dataclass
class ParallelizeOptions:
    """What the engine decided for one module, handed to the family's ``parallelize``."""

    activation_checkpointing: bool = False
    fsdp_mesh: Any = None  # a 1D DeviceMesh to shard over (ZeRO-3 / FSDP2), or None
    mp_policy: Any = None  # FSDP2 MixedPrecisionPolicy, or None
    sequence_parallel: bool = False  # Megatron-style SP inside TP (language model)


class Parallelize(Protocol):
    def __call__(self, module: nn.Module, par: Any, opts: ParallelizeOptions) -> None: ...


@dataclass(frozen=True)
class LayoutTransform:
    """Full global tensor in a layout's order <-> the canonical (checkpoint, HF) order."""

    to_canonical: Callable[[torch.Tensor], torch.Tensor]
    from_canonical: Callable[[torch.Tensor], torch.Tensor]


def standard_init_rule(name: str, param: torch.Tensor, std: float = 0.02) -> tuple:
    """How ``Module.init`` fills a parameter (as HF initialises): Normal(0, std) for linear/conv/embedding
    weights, zero biases, unit norm weights (the only 1-D weights)."""
    if name.endswith("bias"):
        return ("zeros",)
    if param.ndim == 1:
        return ("ones",)
    return ("normal", std)


class Module:
    """One module of a family: a class with a default for everything but ``build`` (and an encoder's ``encode``).

    Generic code (engines, runtime, planner) calls these methods and never asks whether one is there. The
    class attributes are the module's static facts; a family sets them on its subclass.
    """

    name: str = ""  # the module's role: its config section and its worker group ("vision", "audio", "text")
    weight_prefix: str = ""  # its keys in the whole-model state dict ("visual", "language")
    seed_offset: int = 0  # init seed = train.seed + seed_offset (each module its own stream)
    inner: tuple[InnerKind, ...] = ()  # the inner parallelism it supports besides dp ("sp", "tp")
    sequence_parallel: bool = False  # supports Megatron-style sequence parallelism under tp
    projector_prefixes: tuple[str, ...] = ()  # parameters governed by the `merger` config section
    forward_methods: tuple[str, ...] = ()  # methods called instead of __call__ (FSDP2 must hook them)

    # ---- building ----------------------------------------------------------------------------------
    def build(self, model_cfg: Any) -> nn.Module:
        """The module, with no weights touched (works under ``torch.device("meta")``)."""
        raise NotImplementedError(f"module {self.name!r} of its family defines no build()")

    def init(self, module: nn.Module, seed: int, transforms: dict[str, LayoutTransform] | None = None) -> None:
        """A deterministic init of this rank's shards, the same values in every layout: normal(0, 0.02)
        matrices, zero biases, unit norm weights, each parameter from ``(seed, its name)``. ``transforms``: the
        layout's non-canonical parameters (``layout_transforms``), built whole and canonical, then laid out."""
        from dhp.parallel.materialize import init_by_name

        init_by_name(module, seed, standard_init_rule, transforms=transforms)

    def reset_buffers(self, module: nn.Module) -> None:
        """Recompute the non-persistent buffers after ``to_empty`` (rotary tables...). Default: the module has
        none; a module that has some must say how to fill them."""
        names = [n for n, _ in module.named_buffers()]
        if names:
            raise NotImplementedError(f"the {self.name} module has buffers {names[:5]} but no reset_buffers(): "
                                      "after to_empty they would hold uninitialised memory")

    def set_train_options(self, module: nn.Module, train: Any) -> None:
        """Hand the module the ``train`` settings its own code reads (``train.attention``: packed attention's
        kernel; ``train.loss_chunk_tokens``: the language model's chunked loss). Default: it reads none."""

    # ---- layout ------------------------------------------------------------------------------------
    def blocks(self, module: nn.Module) -> list[nn.Module]:
        """The repeated blocks: the units of activation checkpointing and FSDP2. Default: ``module.blocks`` or
        ``module.layers``."""
        for attr in ("blocks", "layers"):
            if isinstance(getattr(module, attr, None), nn.ModuleList):
                return list(getattr(module, attr))
        return []

    def check_layout(self, model_cfg: Any, sp: int, tp: int) -> str | None:
        """A problem with ``sp``/``tp`` for this model (heads not divisible...), or None."""
        return None

    def parallelize(self, module: nn.Module, par: Any, opts: ParallelizeOptions) -> None:
        """The module's layout in the one fixed order. Default (a data-parallel-only module):
        1. no TP or SP (``inner`` is empty), 2. activation checkpointing of each block, 3. FSDP2 over the
        blocks."""
        from dhp.parallel.sharding import apply_activation_checkpointing, apply_fsdp

        if opts.activation_checkpointing:
            apply_activation_checkpointing(self.blocks(module))
        if opts.fsdp_mesh is not None:
            apply_fsdp(module, opts.fsdp_mesh, self.blocks(module), mp_policy=opts.mp_policy,
                       forward_methods=self.forward_methods)

    def layout_transforms(self, module: nn.Module, par: Any) -> dict[str, LayoutTransform]:
        """{parameter name: transform} for parameters whose global (DTensor) layout under ``par`` is not the
        canonical one (e.g. a fused qkv whose rows a TP plan groups by rank). Default: none."""
        return {}

    # ---- work --------------------------------------------------------------------------------------
    def work_tokens(self, info: Any, model_cfg: Any) -> int:
        """The tokens of a sample this module computes on (the language model: the whole sequence)."""
        return int(info.num_tokens)

    def flops(self, info: Any, model_cfg: Any) -> tuple[float, float]:
        """(forward, backward) model FLOPs of the module on a sample (``SampleInfo`` or decoded sample), as
        ``dhp.observe.flops`` counts them (MFU). Default: 2 FLOPs per parameter per token forward, twice
        that backward, over ``work_tokens``; a family gives its closed form (attention included)."""
        params = self.num_parameters(model_cfg)
        fwd = 2.0 * params * self.work_tokens(info, model_cfg)
        return fwd, 2.0 * fwd

    def cost(self, info: Any, model_cfg: Any) -> float:
        """What the module's group balances across its replicas: the forward part of ``flops`` (one source)."""
        return self.flops(info, model_cfg)[0]

    def num_parameters(self, model_cfg: Any) -> int:
        """Parameters of the module (tied ones once), from a build on the meta device."""
        with torch.device("meta"):
            module = self.build(model_cfg)
        return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())

    def depth_variants(self, model_cfg: Any) -> tuple[list[Any], int] | None:
        """For the planner: two shallower model configs of this module whose measured figures extrapolate
        linearly to the whole depth, and the whole depth in the same unit as their steps; None: measure it
        whole."""
        return None


EMBEDS = "embeds"  # the one output of a one-output encoder: the embeddings placed at the placeholder tokens


@dataclass(frozen=True)
class Input:
    """One named encoder output the language model consumes, and where it goes.

    ``after_layer=None``: at the placeholder tokens' embeddings, before the first layer (the main embeddings,
    the first of ``LanguageModel.inputs``, take their place); ``after_layer=i``: added at the same placeholder
    positions to the residual stream after decoder layer ``i`` (Qwen3-VL's DeepStack features). Generic code
    only moves the named tensors and checks the names; the language module itself does the placing."""

    name: str
    after_layer: int | None = None


Named = dict[str, torch.Tensor]  # one sample's (or one piece's) encoder outputs by name, every one [n, D_name]


class Encoder(Module):
    """An encoder: turns a sample's media into embeddings at the language model's placeholder tokens.

    It fills one or several placeholder ids (Qwen's vision: images and videos). Its embeddings of a sample come
    in that order: all of the first id's, then the next id's.

    It may emit several named outputs per placeholder token (``outputs``: the main embeddings and, for
    Qwen3-VL, the DeepStack features), each of its own width and dtype; the router moves each by name and brings
    the gradient of each back by name. The rule for the common case: an encoder that declares one output
    returns a plain tensor from ``encode`` (``named_outputs`` names it).
    """

    modalities: tuple[str, ...] = ()  # the media kinds of a sample it reads ("image", "video", "audio")

    def outputs(self, model_cfg: Any) -> tuple[str, ...]:
        """The names of what ``encode`` emits per placeholder token, in the order the router sends them (the
        first is the main embeddings). Default: one output, ``"embeds"``."""
        return (EMBEDS,)

    def named_outputs(self, out: torch.Tensor | dict[str, torch.Tensor], model_cfg: Any) -> Named:
        """``encode``'s output as ``{name: tensor}`` in ``outputs`` order: a plain tensor is the one output of a
        one-output encoder; a mapping must hold exactly the declared names, every tensor of the same rows."""
        names = self.outputs(model_cfg)
        if isinstance(out, torch.Tensor):
            if len(names) != 1:
                raise ValueError(f"encoder {self.name!r} declares outputs {list(names)} but its encode() returned "
                                 "one tensor: return a mapping name -> tensor")
            return {names[0]: out}
        if set(out) != set(names):
            raise ValueError(f"encoder {self.name!r} declares outputs {list(names)} but its encode() returned "
                             f"{sorted(out)}")
        rows = {n: out[n].shape[0] for n in names}
        if len(set(rows.values())) > 1:
            raise ValueError(f"encoder {self.name!r}: its outputs must have one row per placeholder token each, "
                             f"got rows {rows}")
        return {n: out[n] for n in names}

    def placeholder_ids(self, model_cfg: Any) -> tuple[int, ...]:
        """The placeholder token ids this encoder fills, in the order of its embeddings."""
        raise NotImplementedError(f"encoder {self.name!r} declares no placeholder_ids()")

    def placeholder_counts(self, item: Any, model_cfg: Any) -> tuple[int, ...]:
        """A sample's count of each placeholder id, from a decoded ``Sample`` or a ``SampleInfo`` alike (both
        carry ``token_counts``: the special tokens of the sequence)."""
        counts = item.token_counts
        return tuple(int(counts.get(t, 0)) for t in self.placeholder_ids(model_cfg))

    def num_placeholders(self, item: Any, model_cfg: Any) -> int:
        """The embeddings this encoder makes for a sample (0: it has no media for this encoder)."""
        return sum(self.placeholder_counts(item, model_cfg))

    def work_tokens(self, info: Any, model_cfg: Any) -> int:
        return self.num_placeholders(info, model_cfg)

    def encode(self, module: nn.Module, samples: list, par: Any,
               device: torch.device | str) -> tuple[torch.Tensor | dict[str, torch.Tensor], torch.Tensor]:
        """-> (embeds [n_local, D], index [n_local]): embeddings of the placeholder tokens this rank computed,
        and for each its position among the placeholder tokens of the batch (the samples' placeholder tokens
        concatenated in sample order). Without sequence parallelism a rank computes all of them, in order.
        ``index`` is host metadata (a CPU tensor): the engine cuts it per sample without reading the device.
        An encoder of several ``outputs`` returns ``{name: [n_local, D_name]}`` in place of ``embeds``."""
        raise NotImplementedError(f"encoder {self.name!r} defines no encode()")


class LanguageModel(Module):
    """The language model: ``module.loss_sum(input_ids, position_ids, targets, media, cu_seqlens, meta=None)``
    with ``media = {placeholder token id: embeddings [n, D] in order}`` returns the summed next-token loss;
    ``meta`` is the batch's host metadata (``dhp.data.batch.PackedMeta``), which the engine always passes.

    A language model that consumes several named encoder outputs (``inputs``) gets, per placeholder id, a
    mapping ``{name: [n, D_name]}`` in place of the tensor (``handover``)."""

    forward_methods = ("loss_sum",)

    def inputs(self, model_cfg: Any) -> tuple[Input, ...]:
        """The named encoder outputs the module consumes and where each goes. Default: the main embeddings at
        the placeholder tokens only."""
        return (Input(EMBEDS),)

    def handover(self, named: Named, model_cfg: Any) -> torch.Tensor | Named:
        """One placeholder id's encoder outputs as ``loss_sum``'s ``media`` takes them: the tensor itself where the
        module consumes one input, else the mapping (the engine and the planner hand media over through this)."""
        if len(self.inputs(model_cfg)) == 1:
            return next(iter(named.values()))
        return named

    def check_outputs(self, encoders: tuple[Encoder, ...], model_cfg: Any) -> None:
        """Refuse a family whose encoders emit an output this module does not consume (the router would move bytes
        nobody reads), or whose encoders lack the main input; the message names both sides."""
        inputs = self.inputs(model_cfg)
        consumed = {i.name for i in inputs}
        for enc in encoders:
            names = enc.outputs(model_cfg)
            extra = [n for n in names if n not in consumed]
            if extra or names[:1] != (inputs[0].name,):
                raise ValueError(f"encoder {enc.name!r} emits {list(names)} but the {self.name} module consumes "
                                 f"{[i.name for i in inputs]} (the main embeddings first): declare matching "
                                 "Encoder.outputs and LanguageModel.inputs")


class Family:
    """A model family: its modules, its processor, its weight adapter and its whole model. Registered by name
    (``dhp.models.registry``); a family sets the class attributes and overrides what it has.

    What turns a raw sample's media into model inputs is the family's ``processor``; what its weights are
    called in a Hugging Face checkpoint is its ``weights`` adapter (``dhp.models.adapter.WeightAdapter``).
    """

    name: str = ""
    encoders: tuple[Encoder, ...] = ()
    language: LanguageModel
    hf_model_types: tuple[str, ...] = ()  # config.json model_type values this family reads
    presets: tuple[str, ...] = ()

    @property
    def weights(self) -> WeightAdapter:
        """The family's weight adapter (``dhp.models.adapter``): HF names, fused and tied tensors, config.json,
        save. A family sets it (a class attribute will do); this default is a family's without Hugging Face
        weights, whose HF methods raise a ``ConfigError`` naming the family."""
        from dhp.models.adapter import WeightAdapter

        return WeightAdapter(self.name)

    @property
    def modules(self) -> tuple[Module, ...]:
        return (*self.encoders, self.language)

    @property
    def module_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modules)

    def module(self, name: str) -> Module:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"model family {self.name} has no module {name!r} (its modules: "
                       f"{', '.join(self.module_names)})")

    def placeholder_ids(self, model_cfg: Any) -> list[int]:
        """Every encoder's placeholder ids, in encoder order."""
        return [t for enc in self.encoders for t in enc.placeholder_ids(model_cfg)]

    # ---- configs -----------------------------------------------------------------------------------
    def model_config(self, cfg: Any, tokenizer: Any) -> Any:
        """The model config of a run: from ``model.hf_path``'s config.json, or ``model.preset`` with the
        tokenizer's token ids. Raises ValueError naming the key when the tokenizer does not fit the model."""
        raise NotImplementedError(f"model family {self.name} defines no model_config()")

    def preset_config(self, name: str) -> Any:
        """A preset's (or an HF directory's) model config, no tokenizer needed (``dhp plan``, ``dhp models``)."""
        from dhp.errors import ConfigError

        raise ConfigError(f"model.preset: the {self.name} family has no presets; give model.hf_path")

    def describe(self, model_cfg: Any) -> list[tuple[str, int, str]]:
        """(module, parameters, one line about it) per module, for ``dhp models``."""
        return [(m.name, m.num_parameters(model_cfg), type(m).__name__) for m in self.modules]

    # ---- data --------------------------------------------------------------------------------------
    def processor(self, data_cfg: Any, tokenizer: Any, model_cfg: Any) -> Any:
        """What turns a raw sample's media and text into model inputs and ``SampleInfo`` (a
        ``dhp.data.processor.Processor``): media probing, decoding, placeholder counts, position ids."""
        raise NotImplementedError(f"model family {self.name} defines no processor()")

    def demo_data(self) -> Path:
        """A folder with train.jsonl, eval.jsonl and tokenizer/ (generated once into the cache)."""
        from dhp.errors import ConfigError

        raise ConfigError(f"data.path: set it to a training data file (the {self.name} family has no demo set)")

    def synthetic_sample(self, model_cfg: Any, media_tokens: dict[str, int], text_tokens: int,
                         index: int = 0) -> Any:
        """A decoded ``Sample`` for the planner and ``bench --max-vision-tokens``: for each encoder named in
        ``media_tokens`` media of that many tokens of the encoder's own sequence (vision: patches; audio:
        encoder frames), and ``text_tokens`` text tokens besides the placeholders. Zeros, shapes exact."""
        raise NotImplementedError(f"model family {self.name} defines no synthetic_sample()")

    # ---- the whole model ---------------------------------------------------------------------------
    def full_model(self, model_cfg: Any, state: dict[str, torch.Tensor]) -> nn.Module:
        """The whole model from our-named weights, for evaluation and export."""
        raise NotImplementedError(f"model family {self.name} defines no full_model()")
