"""Qwen2.5-VL image preprocessing, bit-compatible with transformers' ``Qwen2VLImageProcessor`` (PIL path).

Why our own: the workers preprocess their own samples by id, and the token
count of a sample must be known *without decoding pixels* (``image_tokens``
from the image size only) so that batch plans and length checks are exact
before the first step. Tests pin the output to the reference processor.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from PIL import Image

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE  # 28: resized sides are multiples of this
PATCH_DIM = 3 * TEMPORAL_PATCH_SIZE * PATCH_SIZE * PATCH_SIZE  # 1176
MAX_ASPECT_RATIO = 200
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


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
    return t * h * w // (MERGE_SIZE * MERGE_SIZE)


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
