"""What a model family declares, so that the runtime, engines and trainer never import one.

A family (``dhp/models/<family>/``) is one or more encoders feeding one language
model. Each module runs in its own group of workers with its own layout, so per
module the family gives (torchtitan's ``ModelSpec``, per module):

- ``build(model_cfg)`` the module, with no weights touched (works under ``torch.device("meta")``);
- ``init(module, seed)`` a deterministic random init of this rank's shards (same values in every layout);
- ``parallelize(module, par, opts)`` TP or SP, then activation checkpointing, then FSDP, in that order;
- ``weight_prefix`` its part of the whole-model state dict (the family's weight adapter maps HF names);
- data hooks: ``num_tokens(sample, model_cfg)`` how many placeholder tokens the encoder fills for a sample,
  ``token_id(model_cfg)`` which placeholder the language model puts them at, ``encode`` what the
  encoder computes from a batch of samples, and ``cost(info)`` what balancing the group weighs.

The family itself adds the model config (presets, HF ``config.json``), the whole-model adapter
(HF checkpoint in and out) and the full model used for evaluation.

This file is a leaf: it imports nothing from dhp, so anything may import it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn

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


@dataclass(frozen=True)
class ModuleSpec:
    """One module of a family: how to build, initialise and parallelize it, and where its weights live."""

    name: str  # the module's role: its config section and its worker group ("vision", "audio", "text")
    weight_prefix: str  # its keys in the whole-model state dict ("visual", "language")
    build: Callable[[Any], nn.Module]
    init: Callable[..., None]  # (module, seed, transforms=...) fills the materialized (possibly sharded) module
    # deterministically, the same values in every layout; ``transforms`` (passed only when the layout has any) are
    # this layout's ``layout_transforms``: those parameters are built whole and canonical, then laid out
    parallelize: Parallelize
    seed_offset: int = 0  # init seed = train.seed + seed_offset (each module its own stream)
    inner: tuple[InnerKind, ...] = ()  # the inner parallelism it supports besides dp ("sp", "tp")
    sequence_parallel: bool = False  # supports Megatron-style sequence parallelism under tp
    check_layout: Callable[[Any, int, int], str | None] | None = None  # (model_cfg, sp, tp) -> problem or None
    projector_prefixes: tuple[str, ...] = ()  # parameters governed by the `merger` config section
    forward_methods: tuple[str, ...] = ()  # methods called instead of __call__ (FSDP2 must hook them)
    layout_transforms: Callable[[nn.Module, Any], dict[str, LayoutTransform]] | None = None
    # ^ (module, par) -> {parameter name: transform} for parameters whose global (DTensor) layout under this
    #   layout is not the canonical one (e.g. a fused qkv whose rows a TP plan groups by rank)
    reset_buffers: Callable[[nn.Module], None] | None = None  # recompute non-persistent buffers after to_empty
    cost: Callable[[SampleInfo, Any], float] | None = None  # (info, model_cfg) -> this module's work on a sample
    flops: Callable[[SampleInfo, Any], tuple[float, float]] | None = None  # (info, model_cfg) -> model FLOPs
    # ^ (forward, backward) of the module on the sample, as dhp.observe.flops counts them (for MFU)


@dataclass(frozen=True)
class EncoderSpec(ModuleSpec):
    """An encoder: turns a sample's media into embeddings at the language model's placeholders.

    ``encode(module, samples, par, device) -> (embeds [n_local, D], index [n_local])``: embeddings of the
    placeholder tokens this rank computed, and for each its position among the placeholder tokens of the
    batch (the samples' placeholder tokens concatenated in sample order). Without sequence parallelism a
    rank computes all of them, in order. ``index`` is host metadata (a CPU tensor): the engine cuts it per
    sample without reading the device.
    """

    num_tokens: Callable[[Any, Any], int] = lambda sample, model_cfg: 0  # noqa: E731 - (Sample, model_cfg)
    token_id: Callable[[Any], int] = lambda model_cfg: -1  # noqa: E731 - the placeholder id
    encode: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None
    info_tokens: Callable[[SampleInfo, Any], int] | None = None  # placeholder count from a SampleInfo
    # An encoder that fills several placeholders (Qwen's vision: images and videos) gives them all, and a
    # sample's count of each; its embeddings of a sample come in that order (all of the first id's, then the
    # next id's), ``num_tokens`` their sum. Unset: the one placeholder ``token_id``.
    token_ids: Callable[[Any], tuple[int, ...]] | None = None  # (model_cfg) -> placeholder ids
    token_counts: Callable[[Any, Any], tuple[int, ...]] | None = None  # (Sample, model_cfg) -> count per id
    modalities: tuple[str, ...] = ()  # the media kinds of a sample it reads ("image", "video", "audio")

    def placeholder_ids(self, model_cfg: Any) -> tuple[int, ...]:
        return self.token_ids(model_cfg) if self.token_ids else (self.token_id(model_cfg),)

    def placeholder_counts(self, sample: Any, model_cfg: Any) -> tuple[int, ...]:
        return self.token_counts(sample, model_cfg) if self.token_counts else (self.num_tokens(sample, model_cfg),)


@dataclass(frozen=True)
class LanguageSpec(ModuleSpec):
    """The language model: ``module.loss_sum(input_ids, position_ids, targets, media, cu_seqlens, meta=None)`` with
    ``media = {placeholder token id: embeddings [n, D] in order}`` returns the summed next-token loss; ``meta`` is
    the batch's host metadata (``dhp.data.batch.PackedMeta``), which the engine always passes."""


@dataclass(frozen=True)
class FamilySpec:
    """A model family: its modules and the whole-model adapters. Registered by name (``dhp.models.registry``)."""

    name: str
    encoders: tuple[EncoderSpec, ...]
    language: LanguageSpec
    hf_model_types: tuple[str, ...] = ()
    presets: tuple[str, ...] = ()
    # (cfg: Config, tokenizer) -> model config; reads the preset, model.hf_path, and token ids from the tokenizer
    model_config: Callable[[Any, Any], Any] | None = None
    # (hf checkpoint dir) -> our-named whole-model state dict
    load_hf_state: Callable[[str | Path], dict[str, torch.Tensor]] | None = None
    # (model_cfg, our-named state) -> the whole model, for evaluation and export
    full_model: Callable[[Any, dict[str, torch.Tensor]], nn.Module] | None = None
    # (whole model, out dir) -> an HF checkpoint there
    save_hf: Callable[[nn.Module, Path], None] | None = None
    describe: Callable[[Any], list[tuple[str, int, str]]] | None = None  # (model_cfg) -> (module, params, text)
    hf_key: Callable[[str], str] | None = None  # our whole-model key ("visual.blocks.0...") -> its HF name
    hf_config: Callable[[Any, torch.dtype], dict] | None = None  # (model_cfg, dtype) -> HF config.json contents
    tied: Callable[[Any], dict[str, str]] | None = None  # (model_cfg) -> {our key: the key it shares storage with}
    preset_config: Callable[[str], Any] | None = None  # (preset name) -> model config, no tokenizer needed
    # (model_cfg, sample) -> position ids [3, L] of a dhp.data.batch.Sample (its ids, grids, audio lengths);
    # unset: Qwen2.5-VL's M-RoPE (dhp.data.mrope.rope_index)
    position_ids: Callable[[Any, Any], torch.Tensor] | None = None
    demo_data: Callable[[], Path] | None = None  # () -> a folder with train.jsonl, eval.jsonl and tokenizer/

    @property
    def modules(self) -> tuple[ModuleSpec, ...]:
        return (*self.encoders, self.language)

    @property
    def module_names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.modules)

    def module(self, name: str) -> ModuleSpec:
        for m in self.modules:
            if m.name == name:
                return m
        raise KeyError(f"model family {self.name} has no module {name!r} (its modules: "
                       f"{', '.join(self.module_names)})")
