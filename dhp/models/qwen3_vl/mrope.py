"""Qwen3-VL's M-RoPE positions (transformers' ``Qwen3VLModel.get_rope_index``), from the ids and the grids.

Differences from Qwen2.5-VL: a video's frames are separate runs of ``<|video_pad|>`` (each frame pair has its own
``<t seconds>`` text and vision_start/end around it), so each video grid is split into ``t`` grids of ``t = 1``;
no ``second_per_grid_ts`` (time is text now); after a vision run the next position is
``start + max(h, w) / merge``. Here a run is found from the ids themselves (the placeholder ids play the part of
transformers' ``mm_token_type_ids``), and a run whose length is not its grid's is an error naming both.
"""

from __future__ import annotations

import torch


def split_video_grids(video_grid_thw: torch.Tensor | None) -> torch.Tensor | None:
    """``[V, 3]`` -> ``[sum t, 3]``: each clip as ``t`` single-frame-pair grids (``t = 1``)."""
    if video_grid_thw is None:
        return None
    grids = torch.repeat_interleave(video_grid_thw, video_grid_thw[:, 0], dim=0).clone()
    grids[:, 0] = 1
    return grids


def _runs(ids: list[int], wanted: dict[int, int]) -> list[tuple[int, int, int]]:
    """(kind, start, end) of the maximal runs of equal kind; kind 0 text, else ``wanted[id]``."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    kinds = [wanted.get(t, 0) for t in ids]
    for i in range(1, len(ids) + 1):
        if i == len(ids) or kinds[i] != kinds[start]:
            runs.append((kinds[start], start, i))
            start = i
    return runs


def rope_index(input_ids: torch.Tensor, image_grid_thw: torch.Tensor | None, *, image_token_id: int,
               video_token_id: int, spatial_merge_size: int,
               video_grid_thw: torch.Tensor | None = None) -> torch.Tensor:
    """input_ids [B, L] -> position_ids [3, B, L]; images then videos are consumed in order across the batch."""
    grids = {1: iter([] if image_grid_thw is None else image_grid_thw.tolist()),
             2: iter([] if video_grid_thw is None else split_video_grids(video_grid_thw).tolist())}
    out = torch.zeros(3, *input_ids.shape, dtype=torch.long)
    m = spatial_merge_size
    for b, row in enumerate(input_ids.tolist()):
        pieces, pos = [], 0
        for kind, start, end in _runs(row, {image_token_id: 1, video_token_id: 2}):
            if kind == 0:
                pieces.append(torch.arange(end - start).view(1, -1).expand(3, -1) + pos)
                pos += end - start
                continue
            grid = next(grids[kind], None)
            name = "image" if kind == 1 else "video frame"
            if grid is None:
                raise ValueError(f"row {b}: a run of {name} placeholders at {start} but no {name} grid left")
            t, h, w = grid
            if t * h * w // (m * m) != end - start:
                raise ValueError(f"row {b}: {end - start} {name} placeholders at {start} but its grid {grid} "
                                 f"gives {t * h * w // (m * m)}")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h // m), torch.arange(w // m), indexing="ij")
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(h, w) // m
        if pieces:
            out[:, b] = torch.cat(pieces, dim=1)
    return out.to(input_ids.device)
