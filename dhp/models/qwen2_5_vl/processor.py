"""Qwen2.5-VL's data side: image and video preprocessing, placeholder counts and M-RoPE positions of a sample.

Images are bit-compatible with transformers' ``Qwen2VLImageProcessor`` (PIL path); videos follow its
``Qwen2VLVideoProcessor`` (``do_sample_frames=True``, ``cap_pixels_per_frame=True``) and its PyAV loader
(``read_video_pyav``):

- the header gives the frame count N and the frame rate r (``stream.frames``, ``average_rate``);
- n = N / r * ``data.video_fps`` frames, clamped to [``video_min_frames``, min(``video_max_frames``, N)],
  rounded down to the temporal patch size 2; frame indices ``arange(0, N, N / n).int()``;
- every frame is resized to the same factor-28 smart size, with ``max_pixels = max(min(video_max_pixels,
  video_total_pixels * 2 // n), int(min_pixels * 1.05))`` (the per-frame share of the clip's pixel budget);
  bicubic with antialiasing on the uint8 frames (torchvision's CPU path, i.e. ``F.interpolate``);
- rescale and CLIP normalisation, then patches of 2 frames x 14 x 14 in 2x2-merge order, like images;
- ``second_per_grid_ts = 2 / sampled_fps`` with ``sampled_fps = n / N * r``.

A video may also be a list of frame images (already sampled): they are taken as they are, at
``data.video_fps``, an odd count padded with the last frame.

Why our own: the workers preprocess their own samples by id, and the token count of a sample must be
known *without decoding pixels* (from the image size or the container header only) so that batch plans
and length checks are exact before the first step. Tests pin the output to the reference processors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, ImageFile

from dhp.data.processor import Media, MediaError, Placeholder, Processor
from dhp.data.video import VideoError, decode_frames, frame_list_size, is_frame_list, read_header

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 28: resized sides are multiples of this
PATCH_DIM = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # 1176
MERGE_UNIT = MERGE_SIZE * MERGE_SIZE  # patches per placeholder token
MAX_ASPECT_RATIO = 200
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
TOKENS_PER_SECOND = 2  # Qwen2.5-VL's vision_config.tokens_per_second (every published checkpoint)


# ---- images ------------------------------------------------------------------------------------------------


def smart_resize(
    height: int, width: int, factor: int = FACTOR, min_pixels: int = 56 * 56, max_pixels: int = 28 * 28 * 1280
) -> tuple[int, int]:
    """The (height, width) Qwen resizes an image to: sides multiples of ``factor``, area in [min, max] pixels."""
    if min(height, width) <= 0:
        raise ValueError(f"image size {width}x{height} is empty")
    ratio = max(height, width) / min(height, width)
    if ratio > MAX_ASPECT_RATIO:
        raise ValueError(
            f"image of {width}x{height} pixels has aspect ratio {ratio:.1f}, above the limit of {MAX_ASPECT_RATIO}; "
            "crop or pad it to a less extreme shape"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def grid_thw_for_size(width: int, height: int, min_pixels: int, max_pixels: int) -> tuple[int, int, int]:
    """(t, h, w) patch grid of an image of ``width x height`` pixels, without touching its pixels."""
    h, w = smart_resize(height, width, FACTOR, min_pixels, max_pixels)
    return 1, h // PATCH_SIZE, w // PATCH_SIZE


def image_tokens(width: int, height: int, min_pixels: int, max_pixels: int) -> int:
    """Number of ``<|image_pad|>`` tokens (merged patches) for an image of this size."""
    t, h, w = grid_thw_for_size(width, height, min_pixels, max_pixels)
    return t * h * w // MERGE_UNIT


def process_image(image: Image.Image, min_pixels: int, max_pixels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """PIL image -> (pixel_values [t*h*w, 1176] float32, grid_thw [3] long), as Qwen2.5-VL's processor."""
    image = image.convert("RGB")
    height, width = smart_resize(image.height, image.width, FACTOR, min_pixels, max_pixels)
    if (height, width) != (image.height, image.width):
        image = image.resize((width, height), resample=Image.Resampling.BICUBIC)
    arr = np.asarray(image, dtype=np.float32).transpose(2, 0, 1) * np.float32(1 / 255)  # [C, H, W]
    mean = np.asarray(CLIP_MEAN, dtype=np.float32)[:, None, None]
    std = np.asarray(CLIP_STD, dtype=np.float32)[:, None, None]
    arr = (arr - mean) / std
    patches, gh, gw = _patchify(arr.astype(np.float32))
    return torch.from_numpy(np.ascontiguousarray(patches)), torch.tensor([1, gh, gw], dtype=torch.long)


def _patchify(image: np.ndarray) -> tuple[np.ndarray, int, int]:
    """[C, H, W] -> [gh*gw, C*T*P*P] in 2x2-merge order (the 4 patches of a merged token are adjacent)."""
    c, height, width = image.shape
    gh, gw = height // PATCH_SIZE, width // PATCH_SIZE
    m, p = MERGE_SIZE, PATCH_SIZE
    x = image.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)  # gh', gw', mh, mw, C, ph, pw
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], TEMPORAL_PATCH_SIZE, p, p))  # still image: 2 frames
    return x.reshape(gh * gw, c * TEMPORAL_PATCH_SIZE * p * p), gh, gw


# ---- videos ------------------------------------------------------------------------------------------------


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

    total: int  # frames of the clip (a file), or frame images (a frame list)
    count: int  # frames taken: the indices ``arange(0, total, total / count)`` (a frame list: all of them)
    height: int  # resized height and width (multiples of 28)
    width: int
    grid: tuple[int, int, int]  # (t, h, w) patches
    second_per_grid: float  # seconds covered by one temporal patch

    @property
    def indices(self) -> tuple[int, ...]:
        """The frame indices to decode (computed, so that a plan handed to every worker stays a few numbers)."""
        return frame_indices(self.total, self.count)

    @property
    def num_tokens(self) -> int:
        t, h, w = self.grid
        return t * h * w // MERGE_UNIT


def probe(source: Path | list[Path], settings: VideoSettings) -> VideoPlan:
    """The clip's plan from its container header (or the first frame image's header), without decoding frames."""
    if is_frame_list(source):
        width, height = frame_list_size(source)
        return _plan(len(source), len(source), height, width, settings.fps, settings)
    total, fps, width, height = read_header(source)
    count = sample_count(total, fps, settings)
    sampled_fps = count / total * fps  # transformers' VideoMetadata.sampled_fps
    return _plan(total, count, height, width, sampled_fps, settings)


def frame_indices(total: int, count: int) -> tuple[int, ...]:
    """The ``count`` frame indices taken from ``total`` frames, evenly spaced (``arange(0, N, N / n).int()``)."""
    return tuple(torch.arange(0, total, total / count).int().tolist())


def sample_count(total: int, fps: float, settings: VideoSettings) -> int:
    """How many frames Qwen2.5-VL samples from a clip of ``total`` frames at ``fps`` (``Qwen2VLVideoProcessor``)."""
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
    return int(n)


def _plan(total: int, n: int, height: int, width: int, sampled_fps: float, settings: VideoSettings) -> VideoPlan:
    max_pixels = max(min(settings.max_pixels, settings.total_pixels * TEMPORAL_PATCH_SIZE // n),
                     int(settings.min_pixels * 1.05))
    try:
        h, w = smart_resize(height, width, FACTOR, settings.min_pixels, max_pixels)
    except ValueError as e:
        raise VideoError(f"frames of {width}x{height}: {e}") from None
    t = -(-n // TEMPORAL_PATCH_SIZE)
    return VideoPlan(total, n, h, w, (t, h // PATCH_SIZE, w // PATCH_SIZE), TEMPORAL_PATCH_SIZE / sampled_fps)


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


# ---- the processor -----------------------------------------------------------------------------------------


class Images(Media):
    """Still images: a patch grid from the header, ``pixel_values`` [patches, 1176] and ``image_grid_thw`` [I, 3].

    The patch geometry is four class attributes, so that a family with other patches (Qwen3-VL's 16 px) subclasses
    it with its own resize and patchify and keeps the rest."""

    kind, noun = "image", "image"
    patch_dim = PATCH_DIM  # values per patch
    merge_unit = MERGE_UNIT  # patches per placeholder token
    grid_of = staticmethod(grid_thw_for_size)  # (width, height, min_pixels, max_pixels) -> (t, h, w)
    process = staticmethod(process_image)  # (PIL image, min_pixels, max_pixels) -> (pixels, grid)

    def __init__(self, placeholder: Placeholder, min_pixels: int, max_pixels: int) -> None:
        self.placeholder, self.min_pixels, self.max_pixels = placeholder, min_pixels, max_pixels

    def probe(self, source: Path) -> tuple[int, int, int]:
        return self._grid(source, verify=True)

    def probe_header(self, source: Path) -> tuple[int, int, int]:
        return self._grid(source, verify=False)

    def _grid(self, source: Path, verify: bool) -> tuple[int, int, int]:
        """The patch grid from the header; ``verify``: the whole file read through first: PIL's ``verify`` where
        the format has one (PNG: every chunk's CRC), else decoded (JPEG, WebP...: their ``verify`` checks nothing,
        and a truncated JPEG passed it)."""
        try:
            with Image.open(source) as img:
                width, height = img.size
                if verify and type(img).verify is ImageFile.ImageFile.verify:
                    img.load()
                elif verify:
                    img.verify()
        except Exception as e:  # PIL raises many types for corrupt files
            fix = "the cell's bytes" if "(inline bytes" in str(source) else "the file"
            raise MediaError(f"image {source} is unreadable or corrupt ({type(e).__name__}: {e}); replace {fix}") \
                from None
        try:
            return self.grid_of(width, height, self.min_pixels, self.max_pixels)
        except ValueError as e:
            raise MediaError(f"image {source}: {e}") from None

    def num_tokens(self, fact: tuple[int, int, int]) -> int:
        t, h, w = fact
        return t * h * w // self.merge_unit

    def decode(self, source: Path, fact: tuple[int, int, int]) -> torch.Tensor:
        with Image.open(source) as img:
            pixels, grid = self.process(img, self.min_pixels, self.max_pixels)
        if tuple(grid.tolist()) != tuple(fact):
            raise MediaError(f"image {source} changed since validation (grid {tuple(grid.tolist())}, {fact} before)")
        return pixels

    def collate(self, facts: Sequence[Any], decoded: Sequence[Any] | None) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.cat(list(decoded)) if decoded else torch.zeros(0, self.patch_dim),
                "image_grid_thw": torch.tensor(list(facts), dtype=torch.long).reshape(-1, 3)}

    def info(self, facts: Sequence[Any]) -> dict[str, tuple]:
        return {"image_grids": tuple(tuple(f) for f in facts)}  # what the vision encoder's cost reads

    def shrink_hint(self) -> str:
        return "lower data.max_pixels"


class Videos(Media):
    """Video clips: a frame plan from the header, ``pixel_values_videos``, ``video_grid_thw``,
    ``second_per_grid_ts``."""

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
                "second_per_grid_ts": torch.tensor([f.second_per_grid for f in facts], dtype=torch.float32)}

    def info(self, facts: Sequence[Any]) -> dict[str, tuple]:
        return {"image_grids": tuple(f.grid for f in facts)}  # the vision encoder's inputs: images, then clips

    def shrink_hint(self) -> str:
        return "lower data.video_max_pixels or data.video_fps"


# the model config's vision token ids -> their spellings: Qwen2.5-VL's, then Qwen2.5-Omni's names for the same ids
VISION_TOKENS = {
    "image_token_id": ("<|image_pad|>", "<|IMAGE|>"),
    "video_token_id": ("<|video_pad|>", "<|VIDEO|>"),
    "vision_start_token_id": ("<|vision_start|>", "<|vision_bos|>"),
    "vision_end_token_id": ("<|vision_end|>", "<|vision_eos|>"),
}


def vision_token_ids(tokenizer: Any) -> dict[str, int]:
    """The vision token ids of a model config (``Qwen2_5_VLConfig.with_tokens(**vision_token_ids(tok))``), from the
    tokenizer; raises TokenizerError naming a missing token."""
    return tokenizer.ids(VISION_TOKENS, "use a Qwen2.5-VL or Qwen2.5-Omni tokenizer or add the token")


def vision_placeholders(tokenizer: Any) -> tuple[Placeholder, Placeholder]:
    """The image and video blocks: ``<|vision_start|>``, the pad token per merged patch, ``<|vision_end|>``."""
    ids = vision_token_ids(tokenizer)
    start, end = (ids["vision_start_token_id"],), (ids["vision_end_token_id"],)
    return Placeholder(ids["image_token_id"], start, end), Placeholder(ids["video_token_id"], start, end)


def check_geometry(model_cfg: Any, want: tuple[int, int, int, int] = (PATCH_SIZE, TEMPORAL_PATCH_SIZE, MERGE_SIZE, 3),
                   family: str = "Qwen2.5-VL") -> None:
    """The model's vision config must be the geometry this processor cuts patches for: ``want`` = (patch size,
    temporal patch size, merge size, channels), ``family``'s (another family's processor passes its own)."""
    v = getattr(model_cfg, "vision", None)
    if v is None:
        return
    have = (v.patch_size, v.temporal_patch_size, v.spatial_merge_size, v.in_channels)
    if have != tuple(want):
        raise ValueError(f"vision config (patch_size, temporal_patch_size, spatial_merge_size, in_channels) = {have}; "
                         f"the {family} processor cuts {tuple(want)}: use a {family} checkpoint's config")


class Qwen2_5_VLProcessor(Processor):
    """Images and videos, and M-RoPE position ids [3, L] (``mrope.rope_index``)."""

    family = "qwen2_5_vl"

    def __init__(self, data_cfg: Any, tokenizer: Any, model_cfg: Any = None) -> None:
        check_geometry(model_cfg)
        image, video = vision_placeholders(tokenizer)
        self.media = (Images(image, data_cfg.min_pixels, data_cfg.max_pixels),
                      Videos(video, VideoSettings.from_data(data_cfg)))
        self.vision_start_id = image.start[0]
        vision = getattr(model_cfg, "vision", None)
        self.tokens_per_second = vision.tokens_per_second if vision is not None else TOKENS_PER_SECOND

    def position_ids(self, sample: Any) -> torch.Tensor:
        from dhp.models.qwen2_5_vl.mrope import rope_index

        image, video = self.media[0].placeholder.pad, self.media[1].placeholder.pad
        return rope_index(sample.input_ids[None], sample.image_grid_thw, image, self.vision_start_id,
                          MERGE_SIZE, video_grid_thw=sample.video_grid_thw, video_token_id=video,
                          second_per_grid_ts=sample.second_per_grid_ts,
                          tokens_per_second=self.tokens_per_second)[:, 0]


# ---- counts of a decoded sample (from its grids: a sample loaded without pixels has them too) ----------------


def num_patches(sample: Any) -> int:
    """Patches of all the sample's images."""
    return int(sample.image_grid_thw.prod(-1).sum()) if sample.image_grid_thw.shape[0] else 0


def num_image_tokens(sample: Any) -> int:
    """Merged vision tokens (``<|image_pad|>`` slots) of its images: patches / 4."""
    return num_patches(sample) // MERGE_UNIT


def num_video_patches(sample: Any) -> int:
    """Patches of all the sample's video clips."""
    return int(sample.video_grid_thw.prod(-1).sum()) if sample.video_grid_thw.shape[0] else 0


def num_video_tokens(sample: Any) -> int:
    """Merged video tokens (``<|video_pad|>`` slots)."""
    return num_video_patches(sample) // MERGE_UNIT
