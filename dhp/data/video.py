"""Qwen2.5-VL video preprocessing: PyAV decoding, frame sampling, smart resize, patches.

Follows transformers' ``Qwen2VLVideoProcessor`` (``do_sample_frames=True``,
``cap_pixels_per_frame=True``) and its PyAV loader (``read_video_pyav``):

- the header gives the frame count N and the frame rate r (``stream.frames``, ``average_rate``);
- n = N / r * ``data.video_fps`` frames, clamped to [``video_min_frames``, min(``video_max_frames``, N)],
  rounded down to the temporal patch size 2; frame indices ``arange(0, N, N / n).int()``;
- every frame is resized to the same factor-28 smart size, with ``max_pixels = max(min(video_max_pixels,
  video_total_pixels * 2 // n), int(min_pixels * 1.05))`` (the per-frame share of the clip's pixel budget);
  bicubic with antialiasing on the uint8 frames (torchvision's CPU path, i.e. ``F.interpolate``);
- rescale and CLIP normalisation, then patches of 2 frames x 14 x 14 in 2x2-merge order, like images;
- ``second_per_grid_ts = 2 / sampled_fps`` with ``sampled_fps = n / N * r``.

A video may also be a list of frame images (already sampled): they are taken as they are, at
``data.video_fps``, an odd count padded with the last frame. The grid of a clip comes from its
header alone (``probe``), so validation and the text side never decode frames.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from dhp.data.processor import CLIP_MEAN, CLIP_STD, FACTOR, MERGE_SIZE, PATCH_SIZE, TEMPORAL_PATCH_SIZE, smart_resize

VIDEO_PLACEHOLDER = "<video>"
VIDEO_SUFFIXES = (".mp4", ".webm", ".avi", ".mkv", ".mov", ".m4v")
TOKENS_PER_SECOND = 2  # Qwen2.5-VL's vision_config.tokens_per_second (every published checkpoint)


class VideoError(ValueError):
    """A video that cannot be used: undecodable, empty, too short. The message says what and how to fix it."""


@dataclass(frozen=True)
class VideoSettings:
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 56 * 56
    max_pixels: int = 768 * 28 * 28
    total_pixels: int = int(128000 * 28 * 28 * 0.9)

    @classmethod
    def from_data(cls, cfg) -> VideoSettings:
        return cls(cfg.video_fps, cfg.video_min_frames, cfg.video_max_frames, cfg.min_pixels, cfg.video_max_pixels,
                   cfg.video_total_pixels)


@dataclass(frozen=True)
class VideoPlan:
    """What a clip becomes, known from its header: frames to take, their size, the grid and the time step."""

    indices: tuple[int, ...]  # frame indices to decode (a file), or all frames (a frame list)
    height: int  # resized height and width (multiples of 28)
    width: int
    grid: tuple[int, int, int]  # (t, h, w) patches
    second_per_grid: float  # seconds covered by one temporal patch

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // (MERGE_SIZE * MERGE_SIZE)


def is_frame_list(source) -> bool:
    return isinstance(source, (list, tuple))


def probe(source: Path | list[Path], settings: VideoSettings) -> VideoPlan:
    """The clip's plan from its container header (or the first frame image's header), without decoding frames."""
    if is_frame_list(source):
        from PIL import Image

        if not source:
            raise VideoError("an empty list of frames; give at least one frame image")
        with Image.open(source[0]) as img:
            width, height = img.size
        return _plan(tuple(range(len(source))), height, width, settings.fps, settings)
    total, fps, width, height = _header(source)
    indices = sample_indices(total, fps, settings)
    sampled_fps = len(indices) / total * fps  # transformers' VideoMetadata.sampled_fps
    return _plan(indices, height, width, sampled_fps, settings)


def sample_indices(total: int, fps: float, settings: VideoSettings) -> tuple[int, ...]:
    """Frame indices Qwen2.5-VL samples from a clip of ``total`` frames at ``fps`` (``Qwen2VLVideoProcessor``)."""
    if total < max(settings.min_frames, TEMPORAL_PATCH_SIZE):
        raise VideoError(f"the clip has {total} frame(s), fewer than data.video_min_frames={settings.min_frames} "
                         f"(and at least {TEMPORAL_PATCH_SIZE}) allows; use a longer clip or lower "
                         "data.video_min_frames")
    tps = TEMPORAL_PATCH_SIZE
    max_frames = math.floor(min(settings.max_frames, total) / tps) * tps
    n = total / fps * settings.fps
    n = min(max(n, settings.min_frames), max_frames, total)
    n = math.floor(n / tps) * tps
    if n < tps:
        raise VideoError(f"data.video_max_frames={settings.max_frames} leaves fewer than {tps} frames to sample")
    return tuple(torch.arange(0, total, total / n).int().tolist())


def _plan(indices: tuple[int, ...], height: int, width: int, sampled_fps: float, settings: VideoSettings) -> VideoPlan:
    n = len(indices)
    max_pixels = max(min(settings.max_pixels, settings.total_pixels * TEMPORAL_PATCH_SIZE // n),
                     int(settings.min_pixels * 1.05))
    try:
        h, w = smart_resize(height, width, FACTOR, settings.min_pixels, max_pixels)
    except ValueError as e:
        raise VideoError(f"frames of {width}x{height}: {e}") from None
    t = -(-n // TEMPORAL_PATCH_SIZE)
    return VideoPlan(indices, h, w, (t, h // PATCH_SIZE, w // PATCH_SIZE), TEMPORAL_PATCH_SIZE / sampled_fps)


def _header(path: Path) -> tuple[int, float, int, int]:
    """(frames, fps, width, height) from the container; counts packets (no decoding) if the header has no count."""
    import av

    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise VideoError(f"video {path} has no video stream; give a video file (mp4, webm, avi)")
            stream = container.streams.video[0]
            total = int(stream.frames or 0)
            rate = stream.average_rate or stream.guessed_rate
            width, height = stream.codec_context.width, stream.codec_context.height
            if total == 0:
                total = sum(1 for packet in container.demux(stream) if packet.size)
    except VideoError:
        raise
    except Exception as e:  # PyAV raises many error types for broken files
        raise VideoError(f"video {path} cannot be read ({type(e).__name__}: {e}); replace the file") from None
    if total == 0:
        raise VideoError(f"video {path} has no frames; replace the file or drop the sample")
    if not rate or not width or not height:
        raise VideoError(f"video {path} has no frame rate or frame size in its header; re-encode it")
    return total, float(rate), int(width), int(height)


def decode_frames(source: Path | list[Path], indices: tuple[int, ...]) -> torch.Tensor:
    """The chosen frames as uint8 [T, 3, H, W] (RGB); a frame list: every image, converted to RGB."""
    if is_frame_list(source):
        from PIL import Image

        frames = []
        for p in source:
            with Image.open(p) as img:
                frames.append(np.asarray(img.convert("RGB")))
        sizes = {f.shape for f in frames}
        if len(sizes) > 1:
            raise VideoError(f"frames of different sizes ({sorted(sizes)}); give frames of one size")
        return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()
    import av

    wanted = set(indices)
    frames = []
    try:
        with av.open(str(source)) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i > indices[-1]:
                    break
                if i in wanted:
                    frames.append(frame.to_ndarray(format="rgb24"))
    except Exception as e:
        raise VideoError(f"video {source} cannot be decoded ({type(e).__name__}: {e}); replace the file") from None
    if len(frames) != len(indices):
        raise VideoError(f"video {source}: its header promises frame {indices[-1]} but only {len(frames)} of the "
                         f"{len(indices)} sampled frames decode; re-encode the file")
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2).contiguous()


def process_frames(frames: torch.Tensor, plan: VideoPlan) -> torch.Tensor:
    """uint8 frames [T, 3, H, W] -> pixel_values_videos [t*h*w, 1176] float32, as ``Qwen2VLVideoProcessor``."""
    if tuple(frames.shape[-2:]) != (plan.height, plan.width):
        frames = F.interpolate(frames, size=[plan.height, plan.width], mode="bicubic", align_corners=False,
                               antialias=True)  # torchvision's uint8 CPU path
    x = frames.float()
    mean = torch.tensor(CLIP_MEAN) * 255.0
    std = torch.tensor(CLIP_STD) * 255.0
    x = (x - mean[None, :, None, None]) / std[None, :, None, None]  # fused rescale + normalize
    if pad := -x.shape[0] % TEMPORAL_PATCH_SIZE:
        x = torch.cat([x, x[-1:].expand(pad, -1, -1, -1)])
    n, c, height, width = x.shape
    t, gh, gw = n // TEMPORAL_PATCH_SIZE, height // PATCH_SIZE, width // PATCH_SIZE
    m, p = MERGE_SIZE, PATCH_SIZE
    x = x.view(t, TEMPORAL_PATCH_SIZE, c, gh // m, m, p, gw // m, m, p)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, gh', gw', mh, mw, C, T, ph, pw
    return x.reshape(t * gh * gw, c * TEMPORAL_PATCH_SIZE * p * p).contiguous()


def process_video(source: Path | list[Path], settings: VideoSettings) -> tuple[torch.Tensor, VideoPlan]:
    """A clip (file or frame list) -> (pixel_values_videos [t*h*w, 1176], its plan: grid and time step)."""
    plan = probe(source, settings)
    return process_frames(decode_frames(source, plan.indices), plan), plan


def write_clip(path: Path, frames: np.ndarray, fps: int = 4, codec: str = "mpeg4") -> Path:
    """Write uint8 RGB frames [T, H, W, 3] (or gray [T, H, W]) as a video file (PyAV); sides must be even."""
    import av

    if frames.ndim == 3:
        frames = np.repeat(frames[..., None], 3, axis=-1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), mode="w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width, stream.height = int(frames.shape[2]), int(frames.shape[1])
        stream.pix_fmt = "yuv420p"
        stream.options = {"qscale": "2"} if codec == "mpeg4" else {}
        for arr in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(arr), format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return path
