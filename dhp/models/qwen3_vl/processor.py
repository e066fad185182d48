"""Qwen3-VL's data side: image and video preprocessing, timestamp text, placeholder counts, M-RoPE positions.

Images are bit-compatible with transformers' ``Qwen2VLImageProcessorPil`` as Qwen3-VL configures it: patch 16,
merge 2 (sides multiples of 32), mean = std = 0.5; the pixel budget is ``data.min_pixels`` / ``data.max_pixels``.

Videos follow ``Qwen3VLVideoProcessor`` (``do_sample_frames=True``, ``cap_pixels_per_frame=True``):

- n = int(N / r * ``data.video_fps``) frames of a clip of N frames at r fps, clamped to [``video_min_frames``,
  min(``video_max_frames``, N)] (not rounded to even: an odd count is padded with the last frame); frame indices
  ``linspace(0, N - 1, n).round()``;
- one size for every frame: the temporal ``smart_resize`` over the whole clip, its budget
  ``n * max(min(video_max_pixels, video_total_pixels // n), 1.05 * min_pixels)`` pixels;
- bicubic with antialiasing on the uint8 frames, (x - 127.5) / 127.5, patches of 2 frames x 16 x 16;
- **timestamps as text**: before frame pair k the tokens of ``"<{s:.1f} seconds>"``, with s the mean time of the
  pair's two frames (index / r), then ``<|vision_start|>``, the pads of one frame pair, ``<|vision_end|>``.

A frame list (already sampled images) is taken whole at ``data.video_fps``. As for Qwen2.5-VL, a sample's token
count is known from headers only, before any pixel is decoded.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from dhp.data.processor import TAGS, Media, Placeholder, Processor
from dhp.data.video import VideoError, decode_frames, frame_list_size, is_frame_list, read_header
from dhp.models.qwen2_5_vl import processor as qwen2_5_vl_processor
from dhp.models.qwen2_5_vl.processor import MAX_ASPECT_RATIO, smart_resize, vision_placeholders
from dhp.models.qwen2_5_vl.processor import check_geometry as qwen2_5_check_geometry

PATCH_SIZE = 16
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 32: resized sides are multiples of this
PATCH_DIM = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # 1536
MERGE_UNIT = MERGE_SIZE * MERGE_SIZE
MEAN = STD = (0.5, 0.5, 0.5)


# ---- images ------------------------------------------------------------------------------------------------


def image_grid(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int, int]:
    """(t, h, w) patch grid of an image of ``width x height`` pixels, without touching its pixels."""
    h, w = smart_resize(height, width, FACTOR, min_pixels, max_pixels)
    return 1, h // PATCH_SIZE, w // PATCH_SIZE


def patchify(frames: torch.Tensor) -> torch.Tensor:
    """[T, C, H, W] float (T even) -> [T/2 * gh * gw, C*2*16*16], 2x2-merge order (as transformers' patchify)."""
    n, c, height, width = frames.shape
    t, gh, gw = n // TEMPORAL_PATCH_SIZE, height // PATCH_SIZE, width // PATCH_SIZE
    m, p = MERGE_SIZE, PATCH_SIZE
    x = frames.reshape(t, TEMPORAL_PATCH_SIZE, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, gh', gw', mh, mw, C, T, ph, pw
    return x.reshape(t * gh * gw, c * TEMPORAL_PATCH_SIZE * p * p).contiguous()


def process_image(image: Image.Image, min_pixels: int, max_pixels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PIL image -> (pixel_values [h*w, 1536] float32, grid_thw [3] long), as Qwen3-VL's image processor."""
    image = image.convert("RGB")
    height, width = smart_resize(image.height, image.width, FACTOR, min_pixels, max_pixels)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * np.float32(1 / 255)
    mean = np.asarray(MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(STD, dtype=np.float32)[:, None, None]
    x = torch.from_numpy(np.ascontiguousarray(((arr - mean) / std).astype(np.float32)))
    pixels = patchify(x[None].expand(TEMPORAL_PATCH_SIZE, -1, -1, -1))  # a still image: 2 equal frames
    return pixels, torch.tensor([1, height // PATCH_SIZE, width // PATCH_SIZE], dtype=torch.long)


# ---- videos ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoSettings:
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 128 * 32 * 32  # transformers' size["shortest_edge"] (the whole clip's floor)
    max_pixels: int = 768 * 32 * 32  # per frame (max_video_tokens * 32 * 32)
    total_pixels: int = 768 * 32 * 32  # size["longest_edge"]: the clip's budget, shared by its frames

    @classmethod
    def from_data(cls, cfg: Any) -> VideoSettings:
        return cls(cfg.video_fps, cfg.video_min_frames, cfg.video_max_frames, cfg.min_pixels, cfg.video_max_pixels,
                   cfg.video_total_pixels)


@dataclass(frozen=True)
class VideoPlan:
    """What a clip becomes, known from its header: the frames taken, their size, the grid, the timestamps."""

    indices: tuple[int, ...]  # frames decoded (a frame list: all)
    height: int
    width: int
    grid: tuple[int, int, int]  # (t, h, w) patches
    timestamps: tuple[float, ...]  # seconds, one per frame pair (t of them)

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // MERGE_UNIT


def sample_indices(total: int, fps: float, settings: VideoSettings) -> tuple[int, ...]:
    """The frames Qwen3-VL samples from ``total`` frames at ``fps`` (``Qwen3VLVideoProcessor.sample_frames``)."""
    n = int(total / fps * settings.fps)
    n = min(max(n, settings.min_frames), settings.max_frames, total)
    if n < TEMPORAL_PATCH_SIZE:
        raise VideoError(f"the clip has {total} frame(s) and {n} would be sampled, fewer than {TEMPORAL_PATCH_SIZE}; "
                         "use a longer clip or raise data.video_max_frames")
    return tuple(np.linspace(0, total - 1, n).round().astype(int).tolist())


def timestamps(indices: Sequence[int], fps: float) -> tuple[float, ...]:
    """Seconds of each frame pair: the mean of its first and last frame's time (an odd count: the last repeated)."""
    idx = list(indices)
    if len(idx) % TEMPORAL_PATCH_SIZE:
        idx += [idx[-1]] * (TEMPORAL_PATCH_SIZE - len(idx) % TEMPORAL_PATCH_SIZE)
    secs = [i / fps for i in idx]
    return tuple((secs[i] + secs[i + TEMPORAL_PATCH_SIZE - 1]) / 2 for i in range(0, len(secs), TEMPORAL_PATCH_SIZE))


def video_size(n: int, height: int, width: int, settings: VideoSettings) -> tuple[int, int]:
    """The frames' resized (height, width): transformers' temporal ``smart_resize`` with the per-frame cap."""
    per_frame = max(min(settings.max_pixels, settings.total_pixels // n), int(settings.min_pixels * 1.05))
    max_pixels, min_pixels = per_frame * n, settings.min_pixels
    if height < FACTOR or width < FACTOR:
        scale = max(FACTOR / height, FACTOR / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise VideoError(f"frames of {width}x{height} have an aspect ratio above {MAX_ASPECT_RATIO}; crop them")
    h_bar, w_bar = round(height / FACTOR) * FACTOR, round(width / FACTOR) * FACTOR
    t_bar = round(n / TEMPORAL_PATCH_SIZE) * TEMPORAL_PATCH_SIZE
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(n * height * width / max_pixels)
        h_bar = max(FACTOR, math.floor(height / beta / FACTOR) * FACTOR)
        w_bar = max(FACTOR, math.floor(width / beta / FACTOR) * FACTOR)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (n * height * width))
        h_bar = math.ceil(height * beta / FACTOR) * FACTOR
        w_bar = math.ceil(width * beta / FACTOR) * FACTOR
    return h_bar, w_bar


def plan_video(total: int, fps: float, height: int, width: int, settings: VideoSettings,
               indices: tuple[int, ...] | None = None) -> VideoPlan:
    """The plan of a clip of ``total`` frames at ``fps`` (``indices`` given: those frames, a frame list's)."""
    indices = sample_indices(total, fps, settings) if indices is None else indices
    h, w = video_size(len(indices), height, width, settings)
    t = -(-len(indices) // TEMPORAL_PATCH_SIZE)
    return VideoPlan(indices, h, w, (t, h // PATCH_SIZE, w // PATCH_SIZE), timestamps(indices, fps))


def probe(source: Path | list[Path], settings: VideoSettings) -> VideoPlan:
    """The clip's plan from its container header (or the first frame image's), without decoding frames."""
    if is_frame_list(source):
        width, height = frame_list_size(source)
        if len(source) < TEMPORAL_PATCH_SIZE:
            raise VideoError(f"a frame list of {len(source)} image(s): Qwen3-VL needs at least {TEMPORAL_PATCH_SIZE}")
        return plan_video(len(source), settings.fps, height, width, settings, tuple(range(len(source))))
    total, fps, width, height = read_header(source)
    return plan_video(total, fps, height, width, settings)


def process_frames(frames: torch.Tensor, plan: VideoPlan) -> torch.Tensor:
    """uint8 frames [n, 3, H, W] -> pixel_values_videos [t*h*w, 1536] float32, as ``Qwen3VLVideoProcessor``."""
    if tuple(frames.shape[-2:]) != (plan.height, plan.width):
        frames = F.interpolate(frames, size=[plan.height, plan.width], mode="bicubic", align_corners=False,
                               antialias=True)
    mean, std = torch.tensor(MEAN) * 255.0, torch.tensor(STD) * 255.0
    x = (frames.float() - mean[None, :, None, None]) / std[None, :, None, None]
    if pad := -x.shape[0] % TEMPORAL_PATCH_SIZE:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    return patchify(x)


# ---- the processor -----------------------------------------------------------------------------------------


class Images(qwen2_5_vl_processor.Images):
    """Still images as Qwen2.5-VL reads them, cut in Qwen3-VL's 16 px patches: ``pixel_values`` [patches, 1536]."""

    patch_dim = PATCH_DIM
    merge_unit = MERGE_UNIT
    grid_of = staticmethod(image_grid)
    process = staticmethod(process_image)


class Videos(Media):
    """Video clips: a plan from the header, ``pixel_values_videos``, ``video_grid_thw`` (no seconds tensor: time
    is text in Qwen3-VL, ``Qwen3VLProcessor.blocks``)."""

    kind, noun = "video", "video"

    def __init__(self, placeholder: Placeholder, settings: VideoSettings) -> None:
        self.placeholder, self.settings = placeholder, settings

    def probe(self, source: Path | list[Path]) -> VideoPlan:
        return probe(source, self.settings)

    def num_tokens(self, fact: VideoPlan) -> int:
        return fact.num_tokens

    def decode(self, source: Path | list[Path], fact: VideoPlan) -> torch.Tensor:
        return process_frames(decode_frames(source, fact.indices), fact)

    def collate(self, facts: Sequence[Any], decoded: Sequence[Any] | None) -> dict[str, torch.Tensor]:
        return {"pixel_values_videos": torch.cat(list(decoded)) if decoded else torch.zeros(0, PATCH_DIM),
                "video_grid_thw": torch.tensor([f.grid for f in facts], dtype=torch.long).reshape(-1, 3),
                "second_per_grid_ts": torch.zeros(len(facts))}  # unused by Qwen3-VL; the Sample has the field

    def info(self, facts: Sequence[Any]) -> dict[str, tuple]:
        return {"image_grids": tuple(f.grid for f in facts)}  # the vision encoder's inputs: images, then clips

    def shrink_hint(self) -> str:
        return "lower data.video_max_pixels or data.video_fps"


def check_geometry(model_cfg: Any) -> None:
    """The model's vision config must be Qwen3-VL's patch geometry (patch 16)."""
    qwen2_5_check_geometry(model_cfg, (PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE, 3), "Qwen3-VL")


class Qwen3VLProcessor(Processor):
    """Images and videos (timestamp text before each frame pair), and M-RoPE position ids [3, L]."""

    family = "qwen3_vl"

    def __init__(self, data_cfg: Any, tokenizer: Any, model_cfg: Any = None) -> None:
        check_geometry(model_cfg)
        image, video = vision_placeholders(tokenizer)
        self.tokenizer = tokenizer  # the timestamps' text (picklable: a tokenizers.Tokenizer inside)
        self.media = (Images(image, data_cfg.min_pixels, data_cfg.max_pixels),
                      Videos(video, VideoSettings.from_data(data_cfg)))

    def video_block(self, plan: VideoPlan) -> list[int]:
        """A clip's tokens: per frame pair ``<s seconds>`` text, vision_start, its pads, vision_end."""
        ph = self.media[1].placeholder
        _, h, w = plan.grid
        out: list[int] = []
        for secs in plan.timestamps:
            out += self.tokenizer.encode(f"<{secs:.1f} seconds>") + ph.block(h * w // MERGE_UNIT)
        return out

    def blocks(self, facts: Mapping[str, Sequence[Any]]) -> dict[str, list[list[int]]]:
        out = super().blocks({k: v for k, v in facts.items() if k != "video"})
        if facts.get("video"):
            out[TAGS["video"]] = [self.video_block(plan) for plan in facts["video"]]
        return out

    def position_ids(self, sample: Any) -> torch.Tensor:
        from dhp.models.qwen3_vl.mrope import rope_index

        image, video = self.media[0].placeholder.pad, self.media[1].placeholder.pad
        videos = sample.video_grid_thw if sample.video_grid_thw.shape[0] else None
        return rope_index(sample.input_ids[None], sample.image_grid_thw, image_token_id=image, video_token_id=video,
                          spatial_merge_size=MERGE_SIZE, video_grid_thw=videos)[:, 0]
