"""Model FLOPs of Qwen3-VL's modules in closed form, and the same counted by ``FlopCounterMode`` on meta.

Counted as ``dhp.observe.flops`` defines model FLOPs (matmuls only, attention over the full square of each
segment, backward twice the forward except where an input needs no gradient). ``tests/unit/test_qwen3_vl.py``
checks the closed forms against the counter.

Vision encoder, images/clips of ``t`` frame pairs of ``h x w`` patches (``P = t*h*w``), width ``C``, MLP width
``I`` (not gated), ``K`` DeepStack mergers; every block attends over each frame (no windows):

    forward  = depth * (2P (4C^2 + 2CI) + 4C t (h*w)^2)        qkv, proj, MLP; QK^T and AV per frame
             + 2P * patch_dim * C                               patch embedding
             + (1 + K) * 2 (P/4) (4C * 4C + 4C * out)          merger and DeepStack mergers
    backward = 2 * forward - 2P * patch_dim * C                 (the pixels need no gradient)

The language model is Qwen2.5-VL's count (``text_flops``) with Qwen3-VL's explicit ``head_dim``: q/k norms and
the DeepStack additions are no matmuls.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dhp.models.qwen2_5_vl import flops as qwen2_5_flops
from dhp.models.qwen2_5_vl.flops import text_flops, text_sample_flops
from dhp.models.qwen3_vl.config import Qwen3VLConfig, VisionConfig

__all__ = ["count_text", "count_vision", "text_flops", "text_sample_flops", "vision_flops", "vision_sample_flops"]


def vision_flops(grids: Sequence[Sequence[int]], cfg: VisionConfig) -> tuple[float, float]:
    """(forward, backward) model FLOPs of the vision encoder (mergers included) on images of shapes ``grids``."""
    c, i, unit = cfg.hidden_size, cfg.intermediate_size, cfg.merge_unit
    mergers = 1 + len(cfg.deepstack_visual_indexes)
    fwd = embed = 0.0
    for t, h, w in grids:
        p = t * h * w
        fwd += cfg.depth * (2 * p * (4 * c * c + 2 * c * i) + 4 * c * t * (h * w) ** 2)
        fwd += mergers * 2 * (p // unit) * (unit * c * unit * c + unit * c * cfg.out_hidden_size)
        embed += 2 * p * cfg.patch_dim * c
    return float(fwd + embed), float(2 * fwd + embed)


def vision_sample_flops(info: Any, model_cfg: Qwen3VLConfig) -> tuple[float, float]:
    """The vision module's FLOPs on a sample's images and clips (0 for a text-only sample)."""
    return vision_flops(info.image_grids, model_cfg.vision)


# ---- the same, counted (Qwen2.5-VL's counters: the attention classes are its) ----------------------------


def count_vision(model_cfg: Qwen3VLConfig, grids: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(forward, backward) FLOPs of the family's vision module on meta, counted by ``FlopCounterMode``."""
    return qwen2_5_flops.count_vision(model_cfg, grids, family="qwen3_vl")


def count_text(model_cfg: Qwen3VLConfig, segments: Sequence[int]) -> tuple[float, float]:
    """(forward, backward) FLOPs of the family's language module on meta over ``loss_sum`` and its backward."""
    return qwen2_5_flops.count_text(model_cfg, segments, family="qwen3_vl")
