"""Qwen2.5-VL as a dhp model family: a vision encoder (+ merger) feeding a language model.

Everything the runtime needs to know about Qwen2.5-VL is here, as data (``FAMILY``):
how each module is built, initialised and parallelized, where its weights live,
which samples it works on and what a sample costs it. Generic code looks the
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

from dhp.models.layers import host_metadata
from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig, TextConfig, VisionConfig, preset
from dhp.models.qwen2_5_vl.flops import text_sample_flops, vision_sample_flops
from dhp.models.qwen2_5_vl.model import Qwen2_5_VL, count_parameters, init_qwen
from dhp.models.qwen2_5_vl.text import TextModel
from dhp.models.qwen2_5_vl.vision import VisionTransformer, reset_rotary_buffers, vision_layout
from dhp.models.qwen2_5_vl.weights import (
    dhp_to_hf_key,
    load_hf_state_dict,
    load_into,
    read_hf_config,
    save_hf_checkpoint,
)
from dhp.models.spec import EncoderSpec, FamilySpec, LanguageSpec, LayoutTransform, ParallelizeOptions, SampleInfo
from dhp.parallel.sharding import apply_activation_checkpointing, apply_fsdp

# ---- vision encoder -----------------------------------------------------------------------------------


def build_vision(model_cfg: Qwen2_5_VLConfig) -> VisionTransformer:
    return VisionTransformer(model_cfg.vision)


def init_module(module: nn.Module, seed: int, transforms: dict | None = None) -> None:
    """Normal(0, 0.02) weights, zero biases, unit norms, each parameter from ``(seed, its name)``, on whatever
    shard this rank holds: the weights ``build_model(cfg, seed)`` gives the same module, in every layout.
    ``transforms``: the layout's non-canonical parameters (``layout_transforms``)."""
    init_qwen(module, seed, transforms)


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
    pixels = torch.cat([torch.zeros(0, patch_dim)] + [p for s in samples for p in (
        s.pixel_values, s.pixel_values_videos)]).to(device)
    with host_metadata():  # image shapes: host metadata
        grid = torch.cat([torch.zeros(0, 3, dtype=torch.long)] + [g for s in samples for g in (
            s.image_grid_thw, s.video_grid_thw)])
    if par.inner_kind != "sp":
        out = module(pixels, grid)  # [N/4, D] image order
        with host_metadata():
            return out, torch.arange(out.shape[0])
    from dhp.models.qwen2_5_vl.sequence_parallel import shard_vision, sp_forward

    with host_metadata():
        shard = shard_vision(vision_layout(grid.cpu(), module.cfg), par.spec.sp)[par.inner_rank]
    out = sp_forward(module, pixels, shard, par.inner_group)  # [S_local/4, D] window order
    return out, shard.merged_index


def fused_rows_transform(sizes: Sequence[int], tp: int) -> LayoutTransform:
    """A fused Linear's rows (parts of ``sizes`` rows) grouped by TP rank (``FusedColwise``) <-> HF order."""
    from dhp.models.qwen2_5_vl.parallelize import rows_from_rank_order, rows_to_rank_order

    return LayoutTransform(to_canonical=functools.partial(rows_from_rank_order, sizes=tuple(sizes), tp=tp),
                           from_canonical=functools.partial(rows_to_rank_order, sizes=tuple(sizes), tp=tp))


def _gate_up_transforms(module: nn.Module, intermediate_size: int, tp: int) -> dict[str, LayoutTransform]:
    """The fused gate/up weights (and biases) of every SwiGLU under TP: rows grouped by rank."""
    transform = fused_rows_transform((intermediate_size, intermediate_size), tp)
    return {name.replace("._checkpoint_wrapped_module", ""): transform for name, _ in module.named_parameters()
            if name.endswith(("mlp.gate_up_proj.weight", "mlp.gate_up_proj.bias"))}


def vision_layout_transforms(module: nn.Module, par: Any) -> dict[str, LayoutTransform]:
    """Under the uniform-TP baseline the fused qkv and gate/up rows are grouped by rank (``FusedQKVColwise``,
    ``FusedColwise``): the global DTensor is not in HF order. Every other layout, and every other parameter, is
    canonical as it is."""
    if par.inner_kind != "tp":
        return {}
    from dhp.models.qwen2_5_vl.parallelize import qkv_rows_from_rank_order, qkv_rows_to_rank_order

    heads, tp = module.cfg.num_heads, par.spec.tp
    transform = LayoutTransform(to_canonical=functools.partial(qkv_rows_from_rank_order, num_heads=heads, tp=tp),
                                from_canonical=functools.partial(qkv_rows_to_rank_order, num_heads=heads, tp=tp))
    qkv = {name.replace("._checkpoint_wrapped_module", ""): transform for name, _ in module.named_parameters()
           if name.endswith(("attn.qkv.weight", "attn.qkv.bias"))}
    return qkv | _gate_up_transforms(module, module.cfg.intermediate_size, tp)


def language_layout_transforms(module: nn.Module, par: Any) -> dict[str, LayoutTransform]:
    """Under text TP the fused gate/up rows are grouped by rank (``FusedColwise``); every other parameter, and
    every other layout, is canonical as it is."""
    if par.inner_kind != "tp":
        return {}
    return _gate_up_transforms(module, module.cfg.intermediate_size, par.spec.tp)


def check_vision_layout(model_cfg: Qwen2_5_VLConfig, sp: int, tp: int) -> str | None:
    heads = model_cfg.vision.num_heads
    if sp > 1 and heads % sp:
        return f"vision.parallel.sp={sp} must divide the vision heads ({heads})"
    if tp > 1 and heads % tp:
        return f"vision.parallel.tp={tp} must divide the vision heads ({heads})"
    return None


def _chunks(n: int, size: int) -> list[int]:
    """``n`` cut into pieces of ``size`` (the last one shorter): the window extents along one axis."""
    return [size] * (n // size) + ([n % size] if n % size else [])


def vision_flops(grids: Sequence[tuple[int, int, int]], cfg: VisionConfig) -> float:
    """Forward FLOPs of the vision encoder on one sample's images (0.0 for a text-only sample).

    Per image of ``t`` frames of ``h x w`` patches (``P = t*h*w``), width ``C``, MLP width ``I``:

    * linear layers, every block: ``2 * P * (4*C^2 + 3*C*I)`` (qkv + proj, SwiGLU), ``depth`` blocks;
    * attention, ``4 * C * sum(s^2)`` per block over its segments ``s`` (QK^T and AV):
      window blocks attend within windows of ``window_merged^2`` merged tokens
      (64 patches for Qwen2.5-VL; edge windows are smaller), the ``len(fullatt_block_indexes)``
      full-attention blocks within each frame (``s = h*w``), which makes the cost quadratic;
    * the patch embedding ``2 * P * patch_dim * C`` and the merger ``2 * P/4 * (4C * 4C + 4C * out)``.

    Divided by ``2 * depth * (4*C^2 + 3*C*I)`` it reads ``P + n_full * 2C * (h*w) * P / (depth * (4C^2 + 3CI))
    + (window term) + (embed, merger)``: patches plus a quadratic term whose weight grows as the width
    shrinks (small at the real width for a few thousand patches, dominant at the tiny width).
    Backward costs about twice the forward of the same ops, so the ratios between samples hold for training.
    """
    c, i, unit = cfg.hidden_size, cfg.intermediate_size, cfg.merge_unit
    n_full = len(cfg.fullatt_block_indexes)
    n_window = cfg.depth - n_full
    total = 0.0
    for t, h, w in grids:
        p = t * h * w
        gh, gw = h // cfg.spatial_merge_size, w // cfg.spatial_merge_size
        # sum over windows of (patches in the window)^2 = unit^2 * (sum_a a^2) * (sum_b b^2), per frame
        win_sq = t * unit**2 * sum(a * a for a in _chunks(gh, cfg.window_merged)) * sum(
            b * b for b in _chunks(gw, cfg.window_merged)
        )
        full_sq = t * (h * w) ** 2
        total += cfg.depth * 2 * p * (4 * c * c + 3 * c * i)
        total += 4 * c * (n_window * win_sq + n_full * full_sq)
        total += 2 * p * cfg.patch_dim * c + 2 * (p // unit) * (unit * c * unit * c + unit * c * cfg.out_hidden_size)
    return float(total)


def text_flops(tokens: int, cfg: TextConfig) -> float:
    """Forward FLOPs of the language model on one packed sample of ``tokens`` tokens (images' tokens included).

    Per layer: ``2 * T * W`` for the weights ``W = C*(C + 2*kv*hd) + C*C + 3*C*I`` (q, k, v, o with GQA, SwiGLU)
    and ``2 * C * T^2`` for causal attention (QK^T and AV over half the T x T scores); plus the
    LM head ``2 * T * C * vocab``. Divided by ``2 * layers * W`` it reads ``T + T^2 * C / W`` (+ head):
    for a dense model with a 4x MLP (``W = 12 C^2``) that is ``T + T^2 / (12 C)``.
    """
    c, i = cfg.hidden_size, cfg.intermediate_size
    kv = cfg.num_key_value_heads * cfg.head_dim
    weights = c * (c + 2 * kv) + c * c + 3 * c * i
    per_layer = 2 * tokens * weights + 2 * c * tokens * tokens
    return float(cfg.num_hidden_layers * per_layer + 2 * tokens * c * cfg.vocab_size)


def vision_cost(info: SampleInfo, model_cfg: Qwen2_5_VLConfig) -> float:
    """What the vision group balances: the forward FLOPs of the sample's images and video clips (``image_grids``
    holds both; backward is a fixed multiple)."""
    return vision_flops(info.image_grids, model_cfg.vision)


def vision_tokens(info: SampleInfo, model_cfg: Qwen2_5_VLConfig) -> int:
    unit = model_cfg.vision.merge_unit
    return sum(t * h * w // unit for t, h, w in info.image_grids)


VISION = EncoderSpec(
    name="vision",
    weight_prefix="visual",
    build=build_vision,
    init=init_module,
    parallelize=parallelize_vision,
    seed_offset=0,
    inner=("sp", "tp"),
    check_layout=check_vision_layout,
    projector_prefixes=("merger.",),
    forward_methods=("encode_rows",),
    layout_transforms=vision_layout_transforms,
    reset_buffers=reset_rotary_buffers,
    cost=vision_cost,
    flops=vision_sample_flops,
    num_tokens=lambda sample, model_cfg: sample.num_image_tokens + sample.num_video_tokens,
    token_id=lambda model_cfg: model_cfg.image_token_id,
    token_ids=lambda model_cfg: (model_cfg.image_token_id, model_cfg.video_token_id),
    token_counts=lambda sample, model_cfg: (sample.num_image_tokens, sample.num_video_tokens),
    encode=encode_vision,
    info_tokens=vision_tokens,
    modalities=("image", "video"),
)


# ---- language model -----------------------------------------------------------------------------------


def build_text(model_cfg: Qwen2_5_VLConfig) -> TextModel:
    return TextModel(model_cfg.text, model_cfg.image_token_id)


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
    kv = model_cfg.text.num_key_value_heads
    if tp > 1 and kv % tp:
        return f"text.parallel.tp={tp} must divide the key/value heads ({kv})"
    return None


def text_cost(info: SampleInfo, model_cfg: Qwen2_5_VLConfig) -> float:
    """What the text group balances: the forward FLOPs of the sample's tokens (linear plus causal attention)."""
    return text_flops(info.num_tokens, model_cfg.text)


LANGUAGE = LanguageSpec(
    name="text",
    weight_prefix="language",
    build=build_text,
    init=init_module,
    parallelize=parallelize_language,
    seed_offset=1,
    inner=("tp",),
    sequence_parallel=True,
    check_layout=check_text_layout,
    forward_methods=("loss_sum",),
    layout_transforms=language_layout_transforms,
    reset_buffers=reset_rotary_buffers,
    cost=text_cost,
    flops=text_sample_flops,
)


# ---- the whole model ----------------------------------------------------------------------------------


def model_config(cfg: Any, tok: Any) -> Qwen2_5_VLConfig:
    """The model config: from ``model.hf_path``'s config.json, or a preset with the tokenizer's token ids.

    Raises ValueError naming the key when the tokenizer does not fit the model."""
    tokens = tok.special_token_ids()
    if cfg.model.hf_path:
        model_cfg = read_hf_config(cfg.model.hf_path)
    elif cfg.model.preset == "tiny":
        from dhp.models.qwen2_5_vl.config import tiny

        model_cfg = tiny(vocab_size=64 * math.ceil(tok.vocab_size / 64), **tokens)
    else:
        model_cfg = preset(cfg.model.preset).with_tokens(**tokens)
    if tok.vocab_size > model_cfg.text.vocab_size:
        raise ValueError(f"data.tokenizer: {tok.path} has {tok.vocab_size} tokens but the model's vocabulary has "
                         f"{model_cfg.text.vocab_size}; use the model's own tokenizer")
    for name, tid in tokens.items():
        if getattr(model_cfg, name) != tid:
            raise ValueError(f"data.tokenizer: {tok.path} gives {name}={tid} but the model expects "
                             f"{getattr(model_cfg, name)}; use the model's own tokenizer")
    return model_cfg


def full_model(model_cfg: Qwen2_5_VLConfig, state: dict[str, torch.Tensor]) -> Qwen2_5_VL:
    model = Qwen2_5_VL(model_cfg)
    load_into(model, dict(state), source="trained weights")
    return model


def save_hf(model: nn.Module, out: Path) -> None:
    save_hf_checkpoint(model, out)


def describe(model_cfg: Qwen2_5_VLConfig) -> list[tuple[str, int, str]]:
    with torch.device("meta"):
        vision, text = build_vision(model_cfg), build_text(model_cfg)
    v, t = model_cfg.vision, model_cfg.text
    return [
        ("vision encoder + merger", count_parameters(vision),
         f"depth {v.depth}, hidden {v.hidden_size}, heads {v.num_heads}, full attention at "
         f"{list(v.fullatt_block_indexes)}"),
        ("language model + lm_head", count_parameters(text),
         f"layers {t.num_hidden_layers}, hidden {t.hidden_size}, heads {t.num_attention_heads}/"
         f"{t.num_key_value_heads} kv, vocab {t.vocab_size}, tied {t.tie_word_embeddings}"),
    ]


def demo_data() -> Path:
    """The digits demo set (generated once into the cache)."""
    from dhp.data.demo import ensure_demo_dataset

    return ensure_demo_dataset()


FAMILY = FamilySpec(
    name="qwen2_5_vl",
    encoders=(VISION,),
    language=LANGUAGE,
    hf_model_types=("qwen2_5_vl",),
    presets=("tiny", "3b", "7b", "32b", "72b"),
    model_config=model_config,
    load_hf_state=load_hf_state_dict,
    full_model=full_model,
    save_hf=save_hf,
    describe=describe,
    hf_key=dhp_to_hf_key,
    hf_config=lambda model_cfg, dtype: model_cfg.to_hf_dict() | {"dtype": str(dtype).removeprefix("torch.")},
    tied=lambda model_cfg: ({"language.lm_head.weight": "language.embed_tokens.weight"}
                            if model_cfg.text.tie_word_embeddings else {}),
    preset_config=lambda name: read_hf_config(name) if Path(name).is_dir() else preset(name),
    demo_data=demo_data,
)
