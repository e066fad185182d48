"""Model FLOPs of Qwen2.5-VL's modules in closed form, and the same counted by ``FlopCounterMode`` on meta.

Counted as ``dhp.observe.flops`` defines model FLOPs (matmuls only, attention over the full square of
each segment, backward twice the forward except where an input needs no gradient). A test checks the
closed forms equal the counter on the tiny and 7B presets (``tests/unit/test_flops.py``).

Vision encoder, images of ``t`` frames of ``h x w`` patches (``P = t*h*w`` per image), width ``C``, MLP
width ``I``, ``H*hd = C``:

    forward  = depth * 2P (4C^2 + 3CI)                    qkv, proj, SwiGLU of every block
             + 4C (n_window * sum_windows s^2 + n_full * t (h*w)^2)    QK^T and AV per segment
             + 2P * patch_dim * C                         patch embedding
             + 2 (P/4) (4C * 4C + 4C * out)               merger
    backward = 2 * forward - 2P * patch_dim * C           (the pixels need no gradient: weight gradient only)

Language model, a packed micro-batch of segments ``s_i`` (``T = sum s_i``), ``W = C*(H*hd) + 2*C*(kv*hd) +
(H*hd)*C + 3*C*I`` weights per layer:

    forward  = layers * (2T W + 4 (H*hd) sum s_i^2) + 2T C vocab
    backward = 2 * forward
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from typing import Any

import torch

from dhp.models.qwen2_5_vl.config import Qwen2_5_VLConfig, TextConfig, VisionConfig


def _chunks(n: int, size: int) -> list[int]:
    return [size] * (n // size) + ([n % size] if n % size else [])


def vision_flops(grids: Sequence[Sequence[int]], cfg: VisionConfig) -> tuple[float, float]:
    """(forward, backward) model FLOPs of the vision encoder (and merger) on images of shapes ``grids``."""
    c, i, unit, hd = cfg.hidden_size, cfg.intermediate_size, cfg.merge_unit, cfg.head_dim
    width = cfg.num_heads * hd
    n_full = len(cfg.fullatt_block_indexes)
    n_window = cfg.depth - n_full
    fwd = embed = 0.0
    for t, h, w in grids:
        p = t * h * w
        gh, gw = h // cfg.spatial_merge_size, w // cfg.spatial_merge_size
        win_sq = t * unit**2 * sum(a * a for a in _chunks(gh, cfg.window_merged)) * sum(
            b * b for b in _chunks(gw, cfg.window_merged))
        full_sq = t * (h * w) ** 2
        fwd += cfg.depth * 2 * p * (c * 3 * width + width * c + 3 * c * i)
        fwd += 4 * width * (n_window * win_sq + n_full * full_sq)
        fwd += 2 * (p // unit) * (unit * c * unit * c + unit * c * cfg.out_hidden_size)
        embed += 2 * p * cfg.patch_dim * c
    return float(fwd + embed), float(2 * fwd + embed)


def text_flops(segments: Sequence[int], cfg: TextConfig) -> tuple[float, float]:
    """(forward, backward) model FLOPs of the language model (with ``lm_head``) on one packed micro-batch of
    samples of ``segments`` tokens each."""
    c, i = cfg.hidden_size, cfg.intermediate_size
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    weights = c * q + 2 * c * kv + q * c + 3 * c * i
    tokens = sum(segments)
    sq = sum(s * s for s in segments)
    fwd = cfg.num_hidden_layers * (2 * tokens * weights + 4 * q * sq) + 2 * tokens * c * cfg.vocab_size
    return float(fwd), float(2 * fwd)


def vision_sample_flops(info: Any, model_cfg: Qwen2_5_VLConfig) -> tuple[float, float]:
    """``ModuleSpec.flops`` of the vision module: a sample's images (0 for a text-only sample)."""
    return vision_flops(info.image_grids, model_cfg.vision)


def text_sample_flops(info: Any, model_cfg: Qwen2_5_VLConfig) -> tuple[float, float]:
    """``ModuleSpec.flops`` of the language model: one sample is one segment of the packed micro-batch."""
    return text_flops([info.num_tokens], model_cfg.text)


# ---- the same, counted -----------------------------------------------------------------------------


@contextmanager
def _shape_only_attention():
    """Qwen's attention through ``shape_only_packed_attention`` (meta-safe, same SDPA calls)."""
    from dhp.models.qwen2_5_vl import text, vision
    from dhp.observe.flops import shape_only_packed_attention

    saved = text.packed_attention, vision.packed_attention
    text.packed_attention = vision.packed_attention = shape_only_packed_attention
    try:
        yield
    finally:
        text.packed_attention, vision.packed_attention = saved


def count_vision(model_cfg: Qwen2_5_VLConfig, grids: Sequence[Sequence[int]],
                 family: str = "qwen2_5_vl") -> tuple[float, float]:
    """(forward, backward) FLOPs of the vision module built by the family on the meta device, counted by
    ``FlopCounterMode`` over a forward and backward of a packed batch of images ``grids``. ``family``: another
    family whose encoder uses these attention classes (Qwen3-VL)."""
    from dhp.models.registry import get_family  # by name: the family imports this file
    from dhp.observe.flops import count_forward_backward

    with torch.device("meta"):
        module = get_family(family).module("vision").build(model_cfg)
    grid = torch.tensor([list(g) for g in grids], dtype=torch.long)  # on the CPU: the layout is computed there
    patches = int(sum(t * h * w for t, h, w in grids))
    pixels = torch.empty(patches, model_cfg.vision.patch_dim, device="meta")
    with _shape_only_attention():
        return count_forward_backward(lambda: module(pixels, grid))


def count_text(model_cfg: Qwen2_5_VLConfig, segments: Sequence[int], family: str = "qwen2_5_vl") -> tuple[float, float]:
    """(forward, backward) FLOPs of the language module built by the family on the meta device, counted by
    ``FlopCounterMode`` over ``loss_sum`` and its backward on one packed micro-batch of ``segments``. ``family``:
    another family whose decoder subclasses this one's (Qwen3-VL)."""
    from dhp.models.registry import get_family  # by name: the family imports this file
    from dhp.observe.flops import count_forward_backward

    with torch.device("meta"):
        module = get_family(family).module("text").build(model_cfg)
    module.embed = lambda ids, media=None: module.embed_tokens(ids)  # placeholder checks need values
    tokens = int(sum(segments))
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    positions = torch.zeros(3, 1, tokens, dtype=torch.long, device="meta")
    targets = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    cu = torch.tensor([0, *torch.tensor(list(segments)).cumsum(0).tolist()], dtype=torch.long)
    with _shape_only_attention():
        return count_forward_backward(lambda: module.loss_sum(ids, positions, targets, None, cu))
