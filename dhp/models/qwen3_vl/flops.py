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
from contextlib import contextmanager
from typing import Any

import torch

from dhp.models.qwen2_5_vl.flops import text_flops
from dhp.models.qwen3_vl.config import Qwen3VLConfig, VisionConfig


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


def text_sample_flops(info: Any, model_cfg: Qwen3VLConfig) -> tuple[float, float]:
    """The language model's FLOPs: one sample is one segment of the packed micro-batch."""
    return text_flops([info.num_tokens], model_cfg.text)


# ---- the same, counted -----------------------------------------------------------------------------


@contextmanager
def _shape_only_attention():
    from dhp.models.qwen3_vl import text, vision
    from dhp.observe.flops import shape_only_packed_attention

    saved = text.packed_attention, vision.packed_attention
    text.packed_attention = vision.packed_attention = shape_only_packed_attention
    try:
        yield
    finally:
        text.packed_attention, vision.packed_attention = saved


def count_vision(model_cfg: Qwen3VLConfig, grids: Sequence[Sequence[int]]) -> tuple[float, float]:
    """(forward, backward) FLOPs of the family's vision module on meta, counted by ``FlopCounterMode``."""
    from dhp.models.registry import get_family  # by name: the family imports this file
    from dhp.observe.flops import count_forward_backward

    with torch.device("meta"):
        module = get_family("qwen3_vl").module("vision").build(model_cfg)
    grid = torch.tensor([list(g) for g in grids], dtype=torch.long)
    pixels = torch.empty(int(sum(t * h * w for t, h, w in grids)), model_cfg.vision.patch_dim, device="meta")
    with _shape_only_attention():
        return count_forward_backward(lambda: module(pixels, grid))


def count_text(model_cfg: Qwen3VLConfig, segments: Sequence[int]) -> tuple[float, float]:
    """(forward, backward) FLOPs of the family's language module on meta over ``loss_sum`` and its backward."""
    from dhp.models.registry import get_family
    from dhp.observe.flops import count_forward_backward

    with torch.device("meta"):
        module = get_family("qwen3_vl").module("text").build(model_cfg)
    module.embed = lambda ids, media=None: module.embed_tokens(ids)  # placeholder checks need values
    tokens = int(sum(segments))
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    positions = torch.zeros(3, 1, tokens, dtype=torch.long, device="meta")
    targets = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    cu = torch.tensor([0, *torch.tensor(list(segments)).cumsum(0).tolist()], dtype=torch.long)
    with _shape_only_attention():
        return count_forward_backward(lambda: module.loss_sum(ids, positions, targets, None, cu))
