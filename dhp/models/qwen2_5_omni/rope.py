"""TMRoPE: the 3-D (temporal, height, width) position ids of Qwen2.5-Omni's language model.

Qwen2.5-VL's M-RoPE gives text tokens equal (t, h, w) positions that count up by one
per token, and gives a vision token its frame's time and its row and column in the
merged grid, all offset by the position where the image starts. Qwen2.5-Omni keeps
that and makes the temporal axis *absolute time*: ``position_id_per_seconds`` (25)
temporal ids per second, i.e. one per 40 ms.

- text, and every start/end token: the next position (the largest position of the
  previous block + 1), the same on the three axes;
- an audio clip (``<|audio_bos|> <|AUDIO|> * n <|audio_eos|>``): like text, one
  position per token. An audio token stands for 40 ms (4 mel frames of 10 ms), so its
  index is also its time in 1/25 s;
- an image: t = frame index * 25 (0 for a still image), h, w = merged-grid row and column;
- a video: t = frame-group index * ``second_per_grid`` * 25 (truncated to an integer), h, w as an image;
- a video with its own audio (``use_audio_in_video``): time-interleaved. The processor lays it out as
  ``<|vision_bos|> <|audio_bos|> [video chunk 0][audio chunk 0][video chunk 1][audio chunk 1] ...
  <|audio_eos|> <|vision_eos|>``, each chunk ``seconds_per_chunk`` (2 s = 50 temporal ids) long.
  Both start tokens share one position p, and video and audio both count time from p + 1: a video
  token at second s and an audio token at second s get the same temporal id, whatever their place in
  the sequence. Both end tokens share the position after the last chunk.

Placeholder counts come from the media (``image_grid_thw``, ``video_grid_thw``, ``audio_feature_lens``),
which are consumed in order of appearance, across the rows of the batch.

Two details are transformers' ``get_rope_index`` behaviour, reproduced on purpose: the position after a
block is the largest position *of the block's last part* + 1 (for an interleaved clip: of its last chunk,
video or audio), and chunks are cut where the time first reaches the next multiple of the chunk length,
the threshold moving one chunk per cut even when the time jumped over several.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from dhp.models.qwen2_5_omni.audio import audio_output_lengths
from dhp.models.qwen2_5_omni.config import Qwen2_5OmniConfig


class _Media:
    """The batch's images, videos and audio clips, handed out in order of appearance."""

    def __init__(self, image_grid_thw: torch.Tensor | None, video_grid_thw: torch.Tensor | None,
                 audio_feature_lens: torch.Tensor | None, second_per_grid_ts: torch.Tensor | None) -> None:
        self.images = _rows(image_grid_thw)
        self.videos = _rows(video_grid_thw)
        self.seconds = [1.0] * len(self.videos) if second_per_grid_ts is None else second_per_grid_ts.reshape(-1)
        self.audio_tokens = [] if audio_feature_lens is None else audio_output_lengths(
            audio_feature_lens.reshape(-1).cpu().long()).tolist()
        self.next_image = self.next_video = self.next_audio = 0

    def image(self) -> list[int]:
        self.next_image += 1
        return self.images[self.next_image - 1]

    def video(self) -> tuple[list[int], torch.Tensor]:
        self.next_video += 1
        i = self.next_video - 1
        seconds = self.seconds[i]
        return self.videos[i], torch.as_tensor(seconds).cpu().float()  # float32, as transformers computes

    def audio(self) -> int:
        """Audio tokens of the next clip."""
        self.next_audio += 1
        return int(self.audio_tokens[self.next_audio - 1])


def _rows(grid: torch.Tensor | None) -> list[list[int]]:
    return [] if grid is None else grid.reshape(-1, 3).tolist()


def _text(start: int, n: int) -> torch.Tensor:
    """[3, n]: n consecutive positions from ``start``, equal on the three axes."""
    return torch.arange(start, start + n).view(1, -1).expand(3, -1)


def _grid(start: int, times: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """[3, len(times) * h * w]: frame-major (t, row, column) positions of a merged grid, offset by ``start``."""
    t = times.view(-1, 1, 1).expand(-1, h, w)
    hh = torch.arange(h).view(1, -1, 1).expand(len(times), -1, w)
    ww = torch.arange(w).view(1, 1, -1).expand(len(times), h, -1)
    return torch.stack([t, hh, ww]).reshape(3, -1) + start


def _vision(start: int, grid_thw: list[int], frame_times: torch.Tensor, merge: int) -> torch.Tensor:
    _, h, w = grid_thw
    return _grid(start, frame_times, h // merge, w // merge)


def _chunks(times: list[int], per_chunk: int) -> list[tuple[int, int]]:
    """[start, end) index ranges of ``times`` (ascending) cut into time chunks of ``per_chunk`` ids.

    A cut falls before the first element whose time reaches the next threshold; the threshold then moves on by
    one chunk (transformers' ``get_chunked_index``: a time that jumps over several thresholds makes one cut)."""
    bounds, start, threshold = [], 0, per_chunk
    for i, t in enumerate(times):
        if t >= threshold:
            bounds.append((start, i))
            start, threshold = i, threshold + per_chunk
    bounds.append((start, len(times)))
    return bounds


def _interleave(video: torch.Tensor, audio: torch.Tensor, per_chunk: int, start: int) -> list[torch.Tensor]:
    """The parts of a video-with-audio, in sequence order: video chunk 0, audio chunk 0, video chunk 1, ..."""
    v_chunks = _chunks((video[0] - start).tolist(), per_chunk)
    a_chunks = _chunks((audio[0] - start).tolist(), per_chunk)
    parts = []
    for j in range(max(len(v_chunks), len(a_chunks))):
        if j < len(v_chunks):
            parts.append(video[:, v_chunks[j][0]: v_chunks[j][1]])
        if j < len(a_chunks):
            parts.append(audio[:, a_chunks[j][0]: a_chunks[j][1]])
    return parts


def _row_blocks(ids: list[int], media: _Media, cfg: Qwen2_5OmniConfig, use_audio_in_video: bool
                ) -> Iterator[torch.Tensor]:
    """The positions of one row, as consecutive blocks [3, n] whose lengths add up to len(ids)."""
    merge, rate = cfg.vision.spatial_merge_size, cfg.position_id_per_seconds
    nxt = 0  # the next free position: the largest position of the last part + 1
    i = 0
    while i < len(ids):
        tok = ids[i]
        if use_audio_in_video and tok == cfg.vision_start_token_id and ids[i + 1: i + 2] == [cfg.audio_start_token_id]:
            grid, seconds = media.video()
            video = _vision(nxt + 1, grid, (torch.arange(grid[0]) * seconds * rate).long(), merge)
            audio = _text(nxt + 1, media.audio())
            parts = _interleave(video, audio, int(rate * cfg.seconds_per_chunk), nxt + 1)
            end = int(parts[-1].max()) + 1
            block = torch.cat([_text(nxt, 1), _text(nxt, 1), *parts, _text(end, 1), _text(end, 1)], dim=1)
            nxt = end + 1
        elif tok == cfg.image_token_id:
            grid = media.image()
            block = _vision(nxt, grid, (torch.arange(grid[0]) * rate).long(), merge)
            nxt = int(block.max()) + 1
        elif tok == cfg.video_token_id and not use_audio_in_video:
            grid, seconds = media.video()
            block = _vision(nxt, grid, (torch.arange(grid[0]) * seconds * rate).long(), merge)
            nxt = int(block.max()) + 1
        else:
            if tok == cfg.audio_start_token_id:  # a clip on its own: its tokens count up like text
                media.audio()
            block = _text(nxt, 1)
            nxt += 1
        yield block
        i += block.shape[1]


def omni_rope_index(
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None,
    video_grid_thw: torch.Tensor | None,
    audio_feature_lens: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None,
    cfg: Qwen2_5OmniConfig,
    use_audio_in_video: bool = False,
) -> torch.Tensor:
    """TMRoPE position ids [3, B, L] of ``input_ids [B, L]`` (no padding), as transformers' ``get_rope_index``.

    ``image_grid_thw [I, 3]``, ``video_grid_thw [V, 3]``: patches per image/video; ``audio_feature_lens [A]``: mel
    frames per audio clip (clips inside videos included, in order of appearance); ``second_per_grid_ts [V]``:
    seconds per temporal patch of each video (1.0 when not given). ``use_audio_in_video``: every video is laid out
    interleaved with its audio (see the module docstring)."""
    media = _Media(image_grid_thw, video_grid_thw, audio_feature_lens, second_per_grid_ts)
    rows = []
    for row in input_ids.cpu().tolist():
        positions = torch.cat(list(_row_blocks(row, media, cfg, use_audio_in_video)), dim=1)[:, : len(row)]
        rows.append(positions)
    return torch.stack(rows, dim=1).to(device=input_ids.device, dtype=torch.long)
