"""Qwen3-VL (dense) as a dhp model family: a vision encoder with DeepStack mergers feeding a language model.

Everything the runtime needs to know about Qwen3-VL is here (``FAMILY``): how each module is built and
parallelized, where its weights live, which placeholders it fills and what a sample costs it (``flops.py``).

DeepStack through the runtime: the vision module declares its named outputs (``Vision.outputs``: ``embeds``,
then ``deepstack_0`` ... ``deepstack_{K-1}``, from the config) and its ``encode`` emits them per placeholder
token, each ``[n, D]``; the language module declares the same names as its ``inputs`` (the main embeddings at the
placeholders, feature i after layer i) and takes them from its ``media`` by name (``text.TextModel.route_media``).
The router moves each part as its own tensor and returns the gradient of each by name (``docs/qwen3_vl.md``).

Layouts built: data parallel, ZeRO-1, ZeRO-3 / FSDP2 and activation checkpointing on both modules (the
``Module`` defaults: checkpointing and FSDP2 units over ``blocks`` / ``layers``), vision Ulysses SP
(``sequence_parallel.py``) or vision TP over the fused qkv (the uniform-TP baseline), and text TP with or
without Megatron SP (``parallelize.py``). Under text TP the fused q/k/v and gate/up rows, under vision TP the
fused qkv rows, are grouped by rank: ``layout_transforms`` are Qwen2.5-VL's (the same parameter names).

The modules and the family subclass Qwen2.5-VL's (``dhp.models.qwen2_5_vl.family``): names, seeds, inner
kinds, layout checks, layout transforms, train options, the synthetic samples and the demo data are its; what
is Qwen3-VL's own is built here (the modules, their parallelization, FLOPs, depth steps, encode, configs).
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from dhp.data.loader import cat_to_device
from dhp.models.qwen2_5_vl.family import Qwen2_5_VLFamily
from dhp.models.qwen2_5_vl.family import Text as Qwen25Text
from dhp.models.qwen2_5_vl.family import Vision as Qwen25Vision
from dhp.models.qwen3_vl.config import PRESET_PREFIX, PRESETS, Qwen3VLConfig, preset
from dhp.models.qwen3_vl.flops import text_sample_flops, vision_sample_flops
from dhp.models.qwen3_vl.model import Qwen3VL
from dhp.models.qwen3_vl.text import TextModel, text_inputs
from dhp.models.qwen3_vl.vision import VisionTransformer, output_names
from dhp.models.qwen3_vl.weights import WEIGHTS, load_into, read_hf_config
from dhp.models.spec import Encoder, Input, LanguageModel, ParallelizeOptions, SampleInfo
from dhp.ops.attention import host_metadata

VISION_STEP = 8  # vision blocks per depth step of the planner's shallow copies
TEXT_STEP = 8
WHOLE_BELOW = 24  # a stack this deep or shallower is measured whole


def depth_variants(module_name: str, model_cfg: Qwen3VLConfig) -> tuple[list[Any], float] | None:
    """Two shallower configs of the module (one and two depth steps) and the whole depth in steps; None: measure
    it whole. Both shallow vision copies keep every DeepStack merger (at the first blocks), so the mergers fall
    in the line's intercept and the steps differ by blocks only."""
    if module_name == "text":
        n = model_cfg.text.num_hidden_layers
        if n <= WHOLE_BELOW:
            return None
        return [replace(model_cfg, text=replace(model_cfg.text, num_hidden_layers=k * TEXT_STEP)) for k in (1, 2)], \
            n / TEXT_STEP
    v = model_cfg.vision
    if v.depth <= WHOLE_BELOW or len(v.deepstack_visual_indexes) > VISION_STEP:
        return None
    levels = tuple(range(len(v.deepstack_visual_indexes)))
    small = [replace(model_cfg, vision=replace(v, depth=k * VISION_STEP, deepstack_visual_indexes=levels))
             for k in (1, 2)]
    return small, v.depth / VISION_STEP


# ---- vision encoder -----------------------------------------------------------------------------------


class Vision(Qwen25Vision):
    """The vision encoder, its merger and DeepStack mergers: images and video frames into vision tokens, each
    with its named outputs (the embeddings and the DeepStack features)."""

    projector_prefixes = ("merger.", "deepstack_merger_list.")

    def build(self, model_cfg: Qwen3VLConfig) -> VisionTransformer:
        return VisionTransformer(model_cfg.vision)

    def outputs(self, model_cfg: Qwen3VLConfig) -> tuple[str, ...]:
        """The merged embeddings, then one DeepStack feature per ``deepstack_visual_indexes`` entry."""
        return output_names(model_cfg.vision)

    def parallelize(self, module: VisionTransformer, par: Any, opts: ParallelizeOptions) -> None:
        """1. Ulysses SP (every block all-to-alls) or TP (the uniform-TP baseline), 2.-3. the defaults:
        activation checkpointing, FSDP2 over the blocks."""
        if par.inner_kind == "sp":
            from dhp.models.qwen3_vl.sequence_parallel import parallelize_vision_sp

            parallelize_vision_sp(module, par.inner_group)
        elif par.inner_kind == "tp":
            from dhp.models.qwen3_vl.parallelize import parallelize_vision_tp

            parallelize_vision_tp(module, par.mesh["tp"])
        Encoder.parallelize(self, module, par, opts)

    def flops(self, info: SampleInfo, model_cfg: Qwen3VLConfig) -> tuple[float, float]:
        return vision_sample_flops(info, model_cfg)

    def depth_variants(self, model_cfg: Qwen3VLConfig) -> tuple[list[Any], float] | None:
        return depth_variants(self.name, model_cfg)

    def encode(self, module: VisionTransformer, samples: list, par: Any,
               device: torch.device | str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """-> (named outputs ``{name: [n, D]}`` of this rank's vision tokens (``outputs``), their index among the
        batch's (host): all of them in order, or under SP this rank's contiguous slice.

        Each sample's inputs in the family's order: its images, then its video clips."""
        patch_dim = module.cfg.patch_dim
        pixels = cat_to_device([torch.zeros(0, patch_dim)] + [p for s in samples for p in (  # pinned, non-blocking
            s.pixel_values, s.pixel_values_videos)], device)
        with host_metadata():
            grid = torch.cat([torch.zeros(0, 3, dtype=torch.long)] + [g for s in samples for g in (
                s.image_grid_thw, s.video_grid_thw)])
        if par is None or par.inner_kind != "sp":
            out = module(pixels, grid)
            with host_metadata():
                return out, torch.arange(next(iter(out.values())).shape[0])
        from dhp.models.qwen3_vl.sequence_parallel import shard_vision, sp_forward

        with host_metadata():
            shard = shard_vision(grid.cpu(), module.cfg, par.config.sp)[par.inner_rank]
        return sp_forward(module, pixels, shard, par.inner_group), shard.merged_index


VISION = Vision()


# ---- language model -----------------------------------------------------------------------------------


class Text(Qwen25Text):
    """The language model and its head; DeepStack features arrive beside the vision embeddings, by name."""

    def build(self, model_cfg: Qwen3VLConfig) -> TextModel:
        return TextModel(model_cfg.text, model_cfg.image_token_id, model_cfg.deepstack_levels)

    def inputs(self, model_cfg: Qwen3VLConfig) -> tuple[Input, ...]:
        """The main embeddings at the placeholders; DeepStack feature i added after decoder layer i."""
        return text_inputs(model_cfg.deepstack_levels)

    def parallelize(self, module: TextModel, par: Any, opts: ParallelizeOptions) -> None:
        """1. TP (with Megatron SP: DeepStack rows added on each rank's sequence shard), 2.-3. the defaults:
        activation checkpointing, FSDP2 (2D with TP)."""
        if par.inner_kind == "tp":
            from dhp.models.qwen3_vl.parallelize import parallelize_text

            parallelize_text(module, par.mesh["tp"], opts.sequence_parallel)
        LanguageModel.parallelize(self, module, par, opts)

    def flops(self, info: SampleInfo, model_cfg: Qwen3VLConfig) -> tuple[float, float]:
        return text_sample_flops(info, model_cfg)

    def depth_variants(self, model_cfg: Qwen3VLConfig) -> tuple[list[Any], float] | None:
        return depth_variants(self.name, model_cfg)


LANGUAGE = Text()


# ---- the whole model ----------------------------------------------------------------------------------


class Qwen3VLFamily(Qwen2_5_VLFamily):
    """Qwen3-VL (dense 2B/4B/8B/32B): one vision encoder (images and video, DeepStack) feeding the language model.
    Qwen2.5-VL's synthetic samples (the same merge and placeholder layout) and demo data (its tokenizer has the
    Qwen vision tokens) are inherited."""

    name = "qwen3_vl"
    encoders = (VISION,)
    language = LANGUAGE
    hf_model_types = ("qwen3_vl",)
    presets = tuple(PRESET_PREFIX + k for k in PRESETS)
    weights = WEIGHTS  # HF names (fused q/k/v and gate/up), tied embeddings, config.json (weights.py)

    def model_config(self, cfg: Any, tok: Any) -> Qwen3VLConfig:
        """From ``model.hf_path``'s config.json, or a preset with the tokenizer's token ids."""
        from dhp.models.qwen2_5_vl.family import check_tokenizer
        from dhp.models.qwen2_5_vl.processor import vision_token_ids  # the same spellings as Qwen2.5-VL's

        tokens = vision_token_ids(tok)
        if cfg.model.hf_path:
            model_cfg = read_hf_config(cfg.model.hf_path)
        elif cfg.model.preset.removeprefix(PRESET_PREFIX) == "tiny":
            from dhp.models.qwen3_vl.config import tiny

            model_cfg = tiny(vocab_size=64 * math.ceil(tok.vocab_size / 64), **tokens)
        else:
            model_cfg = preset(cfg.model.preset).with_tokens(**tokens)
        check_tokenizer(model_cfg, tok, tokens)
        return model_cfg

    def preset_config(self, name: str) -> Qwen3VLConfig:
        return read_hf_config(name) if Path(name).is_dir() else preset(name)

    def describe(self, model_cfg: Qwen3VLConfig) -> list[tuple[str, int, str]]:
        v, t = model_cfg.vision, model_cfg.text
        return [
            ("vision encoder + mergers", VISION.num_parameters(model_cfg),
             f"depth {v.depth}, hidden {v.hidden_size}, heads {v.num_heads}, DeepStack at "
             f"{list(v.deepstack_visual_indexes)}"),
            ("language model + lm_head", LANGUAGE.num_parameters(model_cfg),
             f"layers {t.num_hidden_layers}, hidden {t.hidden_size}, heads {t.num_attention_heads}/"
             f"{t.num_key_value_heads} kv x {t.head_dim}, vocab {t.vocab_size}, tied {t.tie_word_embeddings}"),
        ]

    def processor(self, data_cfg: Any, tokenizer: Any, model_cfg: Qwen3VLConfig) -> Any:
        """Images and videos (timestamps as text before each frame pair) as Qwen3VLProcessor, and M-RoPE."""
        from dhp.models.qwen3_vl.processor import Qwen3VLProcessor

        return Qwen3VLProcessor(data_cfg, tokenizer, model_cfg)

    def full_model(self, model_cfg: Qwen3VLConfig, state: dict[str, torch.Tensor]) -> Qwen3VL:
        model = Qwen3VL(model_cfg)
        load_into(model, dict(state), source="trained weights")
        return model


FAMILY = Qwen3VLFamily()
