"""Image preprocessing equals transformers' Qwen2VLImageProcessor (PIL backend) on many image shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from dhp.models.qwen2_5_vl.processor import PATCH_DIM, image_tokens, process_image, smart_resize

MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64


def _reference(min_pixels: int, max_pixels: int):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB").convert(mode)


@pytest.mark.parametrize(
    ("width", "height", "mode"),
    [(8, 8, "L"), (56, 56, "RGB"), (100, 37, "RGB"), (33, 250, "RGB"), (640, 480, "RGB"), (57, 113, "RGBA"),
     (300, 3, "RGB")],
)
def test_matches_transformers(width: int, height: int, mode: str) -> None:
    img = _image(width, height, mode)
    pixels, grid = process_image(img, MIN_PIXELS, MAX_PIXELS)
    ref = _reference(MIN_PIXELS, MAX_PIXELS)(images=[img], return_tensors="pt")
    assert grid.tolist() == ref["image_grid_thw"][0].tolist()
    assert pixels.shape == ref["pixel_values"].shape
    assert pixels.shape[1] == PATCH_DIM and pixels.dtype == torch.float32
    assert (pixels - ref["pixel_values"]).abs().max().item() < 1e-5
    t, h, w = grid.tolist()
    assert pixels.shape[0] == t * h * w
    assert image_tokens(width, height, MIN_PIXELS, MAX_PIXELS) == t * h * w // 4
    assert h * w * 14 * 14 <= MAX_PIXELS and h * w * 14 * 14 >= MIN_PIXELS


def test_default_limits_large_image_matches() -> None:
    img = _image(1000, 700, seed=3)
    pixels, grid = process_image(img, 56 * 56, 28 * 28 * 1280)
    ref = _reference(56 * 56, 28 * 28 * 1280)(images=[img], return_tensors="pt")
    assert grid.tolist() == ref["image_grid_thw"][0].tolist()
    assert torch.allclose(pixels, ref["pixel_values"], atol=1e-5, rtol=0)


def test_still_image_is_two_identical_frames() -> None:
    pixels, _ = process_image(_image(56, 56), MIN_PIXELS, MAX_PIXELS)
    frames = pixels.view(-1, 3, 2, 14 * 14)
    assert torch.equal(frames[:, :, 0], frames[:, :, 1])


def test_smart_resize_values() -> None:
    assert smart_resize(56, 56, 28, MIN_PIXELS, MAX_PIXELS) == (56, 56)
    assert smart_resize(10, 10, 28, MIN_PIXELS, MAX_PIXELS) == (56, 56)  # upscaled to min_pixels
    h, w = smart_resize(2000, 1000, 28, MIN_PIXELS, MAX_PIXELS)
    assert h % 28 == 0 and w % 28 == 0 and h * w <= MAX_PIXELS and abs(h / w - 2) < 0.25


def test_smart_resize_equals_reference_function() -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as ref

    for h, w in [(1, 1), (13, 2000), (28, 28), (500, 333), (4000, 3000), (29, 57), (111, 112)]:
        for lo, hi in [(MIN_PIXELS, MAX_PIXELS), (56 * 56, 28 * 28 * 1280), (4 * 28 * 28, 16 * 28 * 28)]:
            assert smart_resize(h, w, 28, lo, hi) == ref(h, w, 28, lo, hi)


def test_aspect_ratio_over_200_raises() -> None:
    with pytest.raises(ValueError, match="aspect ratio .* above the limit of 200"):
        smart_resize(1, 201)
    with pytest.raises(ValueError, match="aspect ratio"):
        process_image(_image(402, 2), MIN_PIXELS, MAX_PIXELS)
    assert smart_resize(1, 200) is not None
