"""Synthetic inputs of Qwen2.5-VL for the planner (``dhp plan``) and ``dhp bench --max-vision-tokens``.

A planner measures a layout by running the real code on a sample of a chosen size ("an image of N patches
and T text tokens"), not on a data set; what such a sample looks like is the family's knowledge, so it is
here: one image per sample, its ``(t, h, w)`` grid as square as the 2x2 merge allows, zeros for pixels, the
merged placeholder tokens in the sequence. The host metadata (grid, ids, positions) is made real even
inside a ``FakeTensorMode`` (``host_metadata``: the model reads it), the pixels are whatever the caller's
mode makes them (fake under the planner's shape-only run: no memory).

``depth_variants`` gives the planner two shallow copies of a deep module whose measured figures extend
linearly to the whole depth (every block of a stack holds and computes the same).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from dhp.ops.attention import host_metadata

VISION, TEXT = "vision", "text"  # this family's module names (``family.py``)
TEXT_STEP = 8  # text layers per depth step: at fewer, the peak sits at the loss rather than at the forward's end
TEXT_WHOLE_BELOW = 24  # a text stack this deep or shallower is measured whole


def image_grid(patches: int, merge: int = 2) -> tuple[int, int, int]:
    """(t, h, w) of one image of about ``patches`` patches (rounded up to whole merged tokens): h and w multiples
    of ``merge`` (the 2x2 merge), as square as possible."""
    unit = merge * merge
    n = max(unit, unit * math.ceil(patches / unit)) // unit  # merged tokens
    best = (1, n)
    for a in range(1, math.isqrt(n) + 1):
        if n % a == 0:
            best = (a, n // a)
    return (1, merge * best[0], merge * best[1])


def synthetic_sample(model_cfg: Any, media_tokens: dict[str, int], text_tokens: int, index: int = 0,
                     extra_placeholders: dict[int, int] | None = None) -> Any:
    """A decoded ``Sample``: one image of ``media_tokens["vision"]`` patches (none without the key), then
    ``extra_placeholders`` ({token id: count}: another encoder's placeholders, for families built on this one),
    then ``text_tokens`` text tokens (id 0). Labels supervise the text tokens only; positions are 1D (M-RoPE's
    three rows equal), which has the shapes of the real ones. Zeros, shapes exact."""
    from dhp.data.batch import Sample

    unknown = set(media_tokens) - {VISION}
    if unknown and extra_placeholders is None:
        raise ValueError(f"Qwen2.5-VL has no encoder {sorted(unknown)} (its encoders: {VISION})")
    patches = media_tokens.get(VISION, 0)
    grid = image_grid(patches, model_cfg.vision.spatial_merge_size) if patches else None
    n_img = grid[0] * grid[1] * grid[2] // model_cfg.vision.merge_unit if grid else 0
    with host_metadata():  # real host tensors even under the planner's FakeTensorMode: the model reads them
        ids = [torch.full((n_img,), model_cfg.image_token_id, dtype=torch.long)]
        ids += [torch.full((n,), tid, dtype=torch.long) for tid, n in (extra_placeholders or {}).items()]
        ids.append(torch.zeros(text_tokens, dtype=torch.long))
        input_ids = torch.cat(ids)
        n_ph = input_ids.shape[0] - text_tokens
        labels = input_ids.clone()
        labels[:n_ph] = -100  # placeholders are not supervised
        position_ids = torch.arange(input_ids.shape[0]).expand(3, -1).contiguous()
        grids = torch.tensor([grid] if grid else [], dtype=torch.long).reshape(-1, 3)
        patch_dim = model_cfg.vision.patch_dim
        sample = Sample(index=index, input_ids=input_ids, labels=labels, position_ids=position_ids,
                        pixel_values=torch.zeros(0, patch_dim), image_grid_thw=grids,
                        pixel_values_videos=torch.zeros(0, patch_dim),
                        video_grid_thw=torch.zeros(0, 3, dtype=torch.long), second_per_grid_ts=torch.zeros(0))
    if grid:  # the pixels: device data (fake under the planner's mode)
        sample.pixel_values = torch.zeros(grid[0] * grid[1] * grid[2], patch_dim)
    return sample


def depth_variants(module_name: str, model_cfg: Any) -> tuple[list[Any], float] | None:
    """Two shallower configs of the module, at one and two depth steps, and the whole depth in steps; None: run
    it whole. The text model: steps of 8 layers (above 24 layers). The vision encoder: steps of one period of
    its full-attention pattern (Qwen2.5-VL: 8 blocks, full attention at the period's last block), when the
    pattern is periodic and has at least three periods."""
    if module_name == TEXT:
        n = model_cfg.text.num_hidden_layers
        if n <= TEXT_WHOLE_BELOW:
            return None
        small = [replace(model_cfg, text=replace(model_cfg.text, num_hidden_layers=k * TEXT_STEP)) for k in (1, 2)]
        return small, n / TEXT_STEP  # 28 layers: 3.5 steps (the line holds between whole steps too)
    if module_name != VISION:
        return None
    v = model_cfg.vision
    full = list(v.fullatt_block_indexes)
    if len(full) < 3:
        return None
    period = full[0] + 1
    if any(b != period * (i + 1) - 1 for i, b in enumerate(full)) or v.depth != period * len(full):
        return None
    small = [replace(model_cfg, vision=replace(v, depth=period * k, fullatt_block_indexes=tuple(full[:k])))
             for k in (1, 2)]
    return small, float(len(full))
