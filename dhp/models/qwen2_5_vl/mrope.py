"""M-RoPE position ids of Qwen2.5-VL (the data side computes them per sample: ``Qwen2_5_VLProcessor``).

Text tokens advance all three axes (t, h, w) together by one. A vision block of
``t x h x w`` merged tokens starts at the current position p: its tokens get
(p + temporal, p + row, p + col); the text after it continues at p + max(h, w).
An image's temporal position is its frame (0); a video's is ``int(frame *
tokens_per_second * second_per_grid_t)``: temporal positions count seconds, not
frames, so clips sampled at different rates share one time axis.
"""

from __future__ import annotations

import torch


def rope_index(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    image_token_id: int,
    vision_start_token_id: int,
    spatial_merge_size: int = 2,
    video_grid_thw: torch.Tensor | None = None,
    video_token_id: int | None = None,
    second_per_grid_ts: torch.Tensor | None = None,
    tokens_per_second: int = 2,
) -> torch.Tensor:
    """input_ids [B, L], image_grid_thw [I, 3], video_grid_thw [V, 3] (all of the batch, in order),
    second_per_grid_ts [V] -> position_ids [3, B, L].

    An image (a video) is a run of consecutive ``image_token_id`` (``video_token_id``) tokens; they are
    matched to the grid rows in order of appearance.
    """
    batch, seq = input_ids.shape
    out = torch.zeros(3, batch, seq, dtype=torch.long)
    grids = {image_token_id: iter([] if image_grid_thw is None else image_grid_thw.tolist())}
    seconds = None
    if video_token_id is not None:
        grids[video_token_id] = iter([] if video_grid_thw is None else video_grid_thw.tolist())
        n_videos = 0 if video_grid_thw is None else video_grid_thw.shape[0]
        if second_per_grid_ts is None:
            second_per_grid_ts = torch.ones(n_videos)
        seconds = iter(torch.as_tensor(second_per_grid_ts).reshape(-1).cpu())
    for b in range(batch):
        out[:, b] = _row_positions(input_ids[b].tolist(), grids, image_token_id, spatial_merge_size, seconds,
                                   tokens_per_second)
    return out.to(input_ids.device)


def _row_positions(ids: list[int], grids: dict, image_token_id: int, merge: int, seconds,
                   tokens_per_second: int) -> torch.Tensor:
    pieces: list[torch.Tensor] = []
    pos, i, n = 0, 0, len(ids)
    while i < n:
        j = i
        if ids[i] in grids:
            kind = ids[i]
            while j < n and ids[j] == kind:
                j += 1
            what = "image" if kind == image_token_id else "video"
            try:
                t, h, w = next(grids[kind])
            except StopIteration:
                raise ValueError(f"more {what} blocks in input_ids than rows in {what}_grid_thw") from None
            gh, gw = h // merge, w // merge
            if t * gh * gw != j - i:
                raise ValueError(f"{what} block of {j - i} tokens does not match grid (t={t}, h={h}, w={w})")
            temporal = torch.arange(t)
            if kind != image_token_id:  # transformers: (arange(t) * tokens_per_second * second_per_grid).long()
                temporal = (temporal * (tokens_per_second * next(seconds))).long()
            tt, hh, ww = torch.meshgrid(temporal, torch.arange(gh), torch.arange(gw), indexing="ij")
            pieces.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(gh, gw)
        else:
            while j < n and ids[j] not in grids:
                j += 1
            pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
            pos += j - i
        i = j
    return torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
