"""M-RoPE position ids of Qwen2.5-VL.

Text tokens advance all three axes (t, h, w) together by one. An image block of
``t x h x w`` merged tokens starts at the current position p: its tokens get
(p + frame, p + row, p + col); the text after it continues at p + max(h, w),
as the reference does for still images.
"""

from __future__ import annotations

import torch


def rope_index(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int = 2,
) -> torch.Tensor:
    """input_ids [B, L], image_grid_thw [I, 3] (all images of the batch, in order) -> position_ids [3, B, L].

    An image is a run of consecutive ``image_token_id`` tokens (after ``vision_start_token_id``);
    images are matched to ``image_grid_thw`` rows in order of appearance.
    """
    batch, seq = input_ids.shape
    out = torch.zeros(3, batch, seq, dtype=torch.long)
    grids = iter([] if image_grid_thw is None else image_grid_thw.tolist())
    for b in range(batch):
        out[:, b] = _row_positions(input_ids[b].tolist(), grids, image_token_id, spatial_merge_size)
    return out.to(input_ids.device)


def _row_positions(ids: list[int], grids, image_token_id: int, merge: int) -> torch.Tensor:
    pieces: list[torch.Tensor] = []
    pos, i, n = 0, 0, len(ids)
    while i < n:
        j = i
        if ids[i] == image_token_id:
            while j < n and ids[j] == image_token_id:
                j += 1
            try:
                t, h, w = next(grids)
            except StopIteration:
                raise ValueError("more image blocks in input_ids than rows in image_grid_thw") from None
            gh, gw = h // merge, w // merge
            if t * gh * gw != j - i:
                raise ValueError(f"image block of {j - i} tokens does not match grid (t={t}, h={h}, w={w})")
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(gh, gw)
        else:
            while j < n and ids[j] != image_token_id:
                j += 1
            pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
        i = j
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
