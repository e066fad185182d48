"""Qwen2.5-VL as a dhp model family: a vision encoder (+ merger) feeding a language model.

Everything the runtime needs to know about Qwen2.5-VL is here (``FAMILY``, a ``dhp.models.spec.Family``):
how each module is built and parallelized, where its weights live, which placeholders it fills and
what a sample costs it (its model FLOPs, ``flops.py``). Generic code looks the
family up by name (``dhp.models.registry``) and never imports this file.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dhp.data.loader import cat_to_device
from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig, preset
from dhp.models.qwen2_5_vl.flops import text_sample_flops, vision_sample_flops
from dhp.models.qwen2_5_vl.model import Qwen2_5_VL
from dhp.models.qwen2_5_vl.text import TextModel, text_qkv_sizes
from dhp.models.qwen2_5_vl.vision import VisionTransformer, reset_rotary_buffers, vision_layout
from dhp.models.qwen2_5_vl.weights import WEIGHTS, load_into, read_hf_config
from dhp.models.spec import Encoder, Family, LanguageModel, LayoutTransform, ParallelizeOptions, SampleInfo
from dhp.ops.attention import host_metadata
from dhp.parallel.sharding import apply_activation_checkpointing, apply_fsdp
from dhp.parallel.tensor import heads_problem

# ---- vision encoder -----------------------------------------------------------------------------------


def parallelize_vision(module: VisionTransformer, par: Any, opts: ParallelizeOptions) -> None:
    """The vision encoder's layout, in the one fixed order."""
    # 1. sequence parallelism (Ulysses, dhp's choice for long vision sequences) or TP (the uniform-TP baseline)
    if par.inner_kind == "sp":
        from dhp.models.qwen2_5_vl.sequence_parallel import parallelize_vision_sp

        parallelize_vision_sp(module, par.inner_group)
    elif par.inner_kind == "tp":
        from dhp.models.qwen2_5_vl.parallelize import parallelize_vision_tp

        parallelize_vision_tp(module, par.mesh["tp"])
    # 2. activation checkpointing: each block recomputed in backward
    if opts.activation_checkpointing:
        apply_activation_checkpointing(module.blocks)
    # 3. FSDP2 (ZeRO-3): every block, the patch embedding and the merger are units of their own
    if opts.fsdp_mesh is not None:
        apply_fsdp(module, opts.fsdp_mesh, [module.patch_embed, *module.blocks, module.merger],
                   mp_policy=opts.mp_policy, forward_methods=("encode_rows",))


def encode_vision(module: VisionTransformer, samples: list, par: Any,
                  device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (embeddings of this rank's merged vision tokens [n, D], their index among the batch's vision tokens).

    Each sample's inputs in the family's order: its images, then its video clips (``token_counts``). The index is
    host metadata (a CPU tensor, from the grids): the engine cuts it per sample without reading the device."""
    patch_dim = module.cfg.patch_dim
    pixels = cat_to_device([torch.zeros(0, patch_dim)] + [p for s in samples for p in (  # pinned, non-blocking
        s.pixel_values, s.pixel_values_videos)], device)
    with host_metadata():  # image shapes: host metadata
        grid = torch.cat([torch.zeros(0, 3, dtype=torch.long)] + [g for s in samples for g in (
            s.image_grid_thw, s.video_grid_thw)])
    if par.inner_kind != "sp":
        out = module(pixels, grid)  # [N/4, D] image order
        with host_metadata():
            return out, torch.arange(out.shape[0])
    from dhp.models.qwen2_5_vl.sequence_parallel import shard_vision, sp_forward

    with host_metadata():
        shard = shard_vision(vision_layout(grid.cpu(), module.cfg), par.config.sp)[par.inner_rank]
    out = sp_forward(module, pixels, shard, par.inner_group)  # [S_local/4, D] window order
    return out, shard.merged_index


def fused_rows_transform(sizes: Sequence[int], tp: int) -> LayoutTransform:
    """A fused Linear's rows (parts of ``sizes`` rows) grouped by TP rank (``FusedColwise``) <-> HF order."""
    from dhp.models.qwen2_5_vl.parallelize import rows_from_rank_order, rows_to_rank_order

    return LayoutTransform(to_canonical=functools.partial(rows_from_rank_order, sizes=tuple(sizes), tp=tp),
                           from_canonical=functools.partial(rows_to_rank_order, sizes=tuple(sizes), tp=tp))


def _fused_transforms(module: nn.Module, suffix: str, sizes: Sequence[int], tp: int) -> dict[str, LayoutTransform]:
    """The transform of every fused ``<suffix>.weight`` / ``.bias`` of ``module`` under TP: rows grouped by rank
    (and of its LoRA ``lora_B``, whose rows are the base's)."""
    transform = fused_rows_transform(sizes, tp)
    return {name.replace("._checkpoint_wrapped_module", ""): transform for name, _ in module.named_parameters()
            if name.endswith((f"{suffix}.weight", f"{suffix}.bias", f"{suffix}.lora_B.weight"))}


def vision_layout_transforms(module: nn.Module, par: Any) -> dict[str, LayoutTransform]:
    """Under the uniform-TP baseline the fused qkv and gate/up rows are grouped by rank (``FusedColwise``): the
    global DTensor is not in HF order, and where tp does not divide the MLP width the gate/up halves carry zero
    padding rows (its global shape is larger than HF's; ``to_canonical`` drops them). Every other layout, and
    every other parameter (down_proj too: DTensor's own uneven ``Shard(1)``), is canonical as it is."""
    if par.inner_kind != "tp":
        return {}
    cfg, tp = module.cfg, par.config.tp
    return (_fused_transforms(module, "attn.qkv", (cfg.hidden_size,) * 3, tp)
            | _fused_transforms(module, "mlp.gate_up_proj", (cfg.intermediate_size,) * 2, tp))


def language_layout_transforms(module: nn.Module, par: Any) -> dict[str, LayoutTransform]:
    """Under text TP the fused q/k/v (unequal parts: GQA) and gate/up rows are grouped by rank
    (``FusedColwise``); every other parameter, and every other layout, is canonical as it is."""
    if par.inner_kind != "tp":
        return {}
    cfg, tp = module.cfg, par.config.tp
    return (_fused_transforms(module, "self_attn.qkv_proj", text_qkv_sizes(cfg), tp)
            | _fused_transforms(module, "mlp.gate_up_proj", (cfg.intermediate_size,) * 2, tp))


def check_vision_layout(model_cfg: Qwen2_5_VLConfig, sp: int, tp: int, uneven_mlp: bool = True) -> str | None:
    """Ulysses SP and TP keep whole heads on a rank: both must divide the vision heads. The MLP width need not
    divide tp (3420 at tp 8): this family's plan cuts its gate/up halves as ``torch.chunk`` cuts them and pads
    them (uneven ``FusedColwise``, ``UnevenRowwise``). ``uneven_mlp=False``: a plan that shards the MLP evenly
    only (a family that reuses this check with a plan of its own), so tp must divide the width too."""
    heads = model_cfg.vision.num_heads
    return (heads_problem("vision.parallel.sp", sp, heads, "vision heads")
            or heads_problem("vision.parallel.tp", tp, heads, "vision heads")
            or (None if uneven_mlp else
                heads_problem("vision.parallel.tp", tp, model_cfg.vision.intermediate_size, "vision MLP width")))


class Vision(Encoder):
    """The vision encoder and its merger: images and video clips into merged vision tokens."""

    name = "vision"
    weight_prefix = "visual"
    seed_offset = 0
    inner = ("sp", "tp")
    projector_prefixes = ("merger.",)
    forward_methods = ("encode_rows",)
    modalities = ("image", "video")

    def build(self, model_cfg: Qwen2_5_VLConfig) -> VisionTransformer:
        return VisionTransformer(model_cfg.vision)

    def reset_buffers(self, module: nn.Module) -> None:
        reset_rotary_buffers(module)

    def set_train_options(self, module: VisionTransformer, train: Any) -> None:
        module.attention_kernel = train.attention  # packed attention's kernel (auto, sdpa, varlen)

    def placeholder_ids(self, model_cfg: Qwen2_5_VLConfig) -> tuple[int, ...]:
        return (model_cfg.image_token_id, model_cfg.video_token_id)  # images' embeddings first, then videos'

    def check_layout(self, model_cfg: Qwen2_5_VLConfig, sp: int, tp: int) -> str | None:
        # uneven MLP shards are this family's plan's (parallelize_vision); a subclass with its own plan (Qwen3-VL)
        # keeps the even rule until its plan shards unevenly too
        return check_vision_layout(model_cfg, sp, tp, uneven_mlp=type(self).parallelize is Vision.parallelize)

    def parallelize(self, module: VisionTransformer, par: Any, opts: ParallelizeOptions) -> None:
        parallelize_vision(module, par, opts)

    def layout_transforms(self, module: nn.Module, par: Any) -> dict[str, LayoutTransform]:
        return vision_layout_transforms(module, par)

    def flops(self, info: SampleInfo, model_cfg: Qwen2_5_VLConfig) -> tuple[float, float]:
        return vision_sample_flops(info, model_cfg)

    def depth_variants(self, model_cfg: Qwen2_5_VLConfig) -> tuple[list[Any], float] | None:
        from dhp.models.qwen2_5_vl.synthetic import depth_variants

        return depth_variants(self.name, model_cfg)

    def encode(self, module: VisionTransformer, samples: list, par: Any,
               device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        return encode_vision(module, samples, par, device)


VISION = Vision()


# ---- language model -----------------------------------------------------------------------------------


def parallelize_language(module: TextModel, par: Any, opts: ParallelizeOptions) -> None:
    """The language model's layout, in the one fixed order."""
    # 1. tensor parallelism (and Megatron sequence parallelism inside it)
    if par.inner_kind == "tp":
        from dhp.models.qwen2_5_vl.parallelize import parallelize_text

        parallelize_text(module, par.mesh["tp"], opts.sequence_parallel)
    # 2. activation checkpointing of the decoder layers
    if opts.activation_checkpointing:
        apply_activation_checkpointing(module.layers)
    # 3. FSDP2 over the data-parallel replicas (2D with TP): each decoder layer a unit, the root the rest
    if opts.fsdp_mesh is not None:
        apply_fsdp(module, opts.fsdp_mesh, list(module.layers), mp_policy=opts.mp_policy,
                   forward_methods=("loss_sum",))


def check_text_layout(model_cfg: Qwen2_5_VLConfig, sp: int, tp: int) -> str | None:
    return heads_problem("text.parallel.tp", tp, model_cfg.text.num_key_value_heads, "key/value heads")


class Text(LanguageModel):
    """The language model and its head."""

    name = "text"
    weight_prefix = "language"
    seed_offset = 1
    inner = ("tp",)
    sequence_parallel = True

    def build(self, model_cfg: Qwen2_5_VLConfig) -> TextModel:
        return TextModel(model_cfg.text, model_cfg.image_token_id)

    def reset_buffers(self, module: nn.Module) -> None:
        reset_rotary_buffers(module)

    def set_train_options(self, module: TextModel, train: Any) -> None:
        module.attention_kernel = train.attention  # packed attention's kernel (auto, sdpa, varlen)
        module.loss_chunk_tokens = train.loss_chunk_tokens  # the head's logits in chunks of this many rows

    def check_layout(self, model_cfg: Qwen2_5_VLConfig, sp: int, tp: int) -> str | None:
        return check_text_layout(model_cfg, sp, tp)

    def parallelize(self, module: TextModel, par: Any, opts: ParallelizeOptions) -> None:
        parallelize_language(module, par, opts)

    def layout_transforms(self, module: nn.Module, par: Any) -> dict[str, LayoutTransform]:
        return language_layout_transforms(module, par)

    def flops(self, info: SampleInfo, model_cfg: Qwen2_5_VLConfig) -> tuple[float, float]:
        return text_sample_flops(info, model_cfg)

    def depth_variants(self, model_cfg: Qwen2_5_VLConfig) -> tuple[list[Any], float] | None:
        from dhp.models.qwen2_5_vl.synthetic import depth_variants

        return depth_variants(self.name, model_cfg)


LANGUAGE = Text()


# ---- the whole model ----------------------------------------------------------------------------------


class Qwen2_5_VLFamily(Family):
    """Qwen2.5-VL: one vision encoder (images and video) feeding the language model."""

    name = "qwen2_5_vl"
    encoders = (VISION,)
    language = LANGUAGE
    hf_model_types = ("qwen2_5_vl",)
    presets = ("tiny", "3b", "7b", "32b", "72b")

    def model_config(self, cfg: Any, tok: Any) -> Qwen2_5_VLConfig:
        """From ``model.hf_path``'s config.json, or a preset with the tokenizer's token ids."""
        from dhp.models.qwen2_5_vl.processor import vision_token_ids

        tokens = vision_token_ids(tok)
        if cfg.model.hf_path:
            model_cfg = read_hf_config(cfg.model.hf_path)
        elif cfg.model.preset == "tiny":
            from dhp.models.qwen2_5_vl.config import tiny

            model_cfg = tiny(vocab_size=64 * math.ceil(tok.vocab_size / 64), **tokens)
        else:
            model_cfg = preset(cfg.model.preset).with_tokens(**tokens)
        check_tokenizer(model_cfg, tok, tokens)
        return model_cfg

    def preset_config(self, name: str) -> Qwen2_5_VLConfig:
        return read_hf_config(name) if Path(name).is_dir() else preset(name)

    def describe(self, model_cfg: Qwen2_5_VLConfig) -> list[tuple[str, int, str]]:
        v, t = model_cfg.vision, model_cfg.text
        return [
            ("vision encoder + merger", VISION.num_parameters(model_cfg),
             f"depth {v.depth}, hidden {v.hidden_size}, heads {v.num_heads}, full attention at "
             f"{list(v.fullatt_block_indexes)}"),
            ("language model + lm_head", LANGUAGE.num_parameters(model_cfg),
             f"layers {t.num_hidden_layers}, hidden {t.hidden_size}, heads {t.num_attention_heads}/"
             f"{t.num_key_value_heads} kv, vocab {t.vocab_size}, tied {t.tie_word_embeddings}"),
        ]

    def processor(self, data_cfg: Any, tokenizer: Any, model_cfg: Qwen2_5_VLConfig) -> Any:
        """Images and video clips as Qwen2.5-VL's processor turns them into patches, and M-RoPE positions."""
        from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor

        return Qwen2_5_VLProcessor(data_cfg, tokenizer, model_cfg)

    def synthetic_sample(self, model_cfg: Qwen2_5_VLConfig, media_tokens: dict[str, int], text_tokens: int,
                         index: int = 0) -> Any:
        """One image of ``media_tokens["vision"]`` patches and ``text_tokens`` text tokens (``synthetic.py``)."""
        from dhp.models.qwen2_5_vl.synthetic import synthetic_sample

        return synthetic_sample(model_cfg, media_tokens, text_tokens, index)

    def demo_data(self) -> Path:
        """The digits demo set (generated once into the cache)."""
        from dhp.data.demo import ensure_demo_dataset

        return ensure_demo_dataset()

    def full_model(self, model_cfg: Qwen2_5_VLConfig, state: dict[str, torch.Tensor]) -> Qwen2_5_VL:
        model = Qwen2_5_VL(model_cfg)
        load_into(model, dict(state), source="trained weights")
        return model

    weights = WEIGHTS  # HF names (fused q/k/v and gate/up), tied embeddings, config.json (weights.py)


def check_tokenizer(model_cfg: Any, tok: Any, tokens: dict[str, int]) -> None:
    """Raises ValueError naming the key when the tokenizer does not fit the model (vocabulary, token ids)."""
    if tok.vocab_size > model_cfg.text.vocab_size:
        raise ValueError(f"data.tokenizer: {tok.path} has {tok.vocab_size} tokens but the model's vocabulary has "
                         f"{model_cfg.text.vocab_size}; use the model's own tokenizer")
    for name, tid in tokens.items():
        if getattr(model_cfg, name) != tid:
            raise ValueError(f"data.tokenizer: {tok.path} gives {name}={tid} but the model expects "
                             f"{getattr(model_cfg, name)}; use the model's own tokenizer")


FAMILY = Qwen2_5_VLFamily()
