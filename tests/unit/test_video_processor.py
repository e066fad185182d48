"""Video preprocessing against transformers' Qwen2.5-VL video processor (``Qwen2VLVideoProcessor``).

transformers' video processor module imports torchvision at load, and torchvision does not install beside
this torch (shared/FACTS.md). The reference is therefore transformers' own code run piece by piece: its PyAV
loader ``read_video_pyav`` and ``VideoMetadata.sampled_fps``, and the processor's own ``sample_frames``,
``smart_resize`` and ``patchify`` (compiled from the module's source, which needs no torchvision for them);
its ``resize`` (the per-frame share of the pixel budget, then torchvision's uint8
bicubic resize, whose CPU path is ``F.interpolate(..., antialias=True)`` on the uint8 frames) and its fused
rescale + normalise are transcribed in ``_reference``.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from dhp.data.video import VideoError, write_clip
from dhp.models.qwen2_5_vl.processor import VideoSettings, probe, process_video

pytest.importorskip("av")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_video():
    """``smart_resize``, ``Qwen2VLVideoProcessor.sample_frames`` and ``.patchify``: transformers' source of them,
    compiled from its file (importing the module needs torchvision, and its class is then a placeholder)."""
    import ast
    import importlib.util

    spec = importlib.util.find_spec("transformers.models.qwen2_vl")
    source = (Path(spec.submodule_search_locations[0]) / "video_processing_qwen2_vl.py").read_text()
    tree = ast.parse(source)
    wanted = {"smart_resize", "sample_frames", "patchify"}
    defs = [node for node in ast.walk(tree) if isinstance(node, ast.FunctionDef) and node.name in wanted]
    assert {d.name for d in defs} == wanted
    for d in defs:
        d.decorator_list = []
    ns: dict = {"math": math, "torch": torch}
    exec(compile(ast.Module(body=defs, type_ignores=[]), "video_processing_qwen2_vl.py", "exec"), ns)
    return SimpleNamespace(**{k: ns[k] for k in wanted})


def _clip(path: Path, n_frames: int, height: int, width: int, fps: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, (height, width, 3)).astype(np.float32)
    frames = [np.clip(base + 40 * np.sin(k + np.arange(width))[None, :, None], 0, 255).astype(np.uint8)
              for k in range(n_frames)]
    return write_clip(path, np.stack(frames), fps=fps)


def _reference(mod, path: Path, s: VideoSettings):
    from transformers.video_utils import read_video_pyav

    proc = SimpleNamespace(num_frames=None, fps=s.fps, temporal_patch_size=2, min_frames=s.min_frames,
                           max_frames=s.max_frames)

    def sample(metadata, **kwargs):
        return mod.sample_frames(proc, metadata).numpy()

    frames, metadata = read_video_pyav(str(path), sample_indices_fn=sample)
    metadata.frames_indices = sample(metadata)
    video = torch.from_numpy(np.stack([f.to_ndarray(format="rgb24") if hasattr(f, "to_ndarray") else f
                                       for f in frames])).permute(0, 3, 1, 2)[None]  # [1, T, C, H, W] uint8
    # Qwen2VLVideoProcessor.resize with cap_pixels_per_frame=True (max_video_tokens chosen to give total_pixels)
    num_frames = video.shape[1]
    max_pixels = max(min(s.max_pixels, s.total_pixels * 2 // num_frames), int(s.min_pixels * 1.05))
    h, w = mod.smart_resize(video.shape[-2], video.shape[-1], factor=28, min_pixels=s.min_pixels,
                            max_pixels=max_pixels)
    if (h, w) != tuple(video.shape[-2:]):  # torchvision resize_image, uint8 on the CPU
        video = F.interpolate(video[0], size=[h, w], mode="bicubic", align_corners=False, antialias=True)[None]
    mean = torch.tensor([0.48145466, 0.4578275, 0.40821073]) * (1.0 / (1 / 255))
    std = torch.tensor([0.26862954, 0.26130258, 0.27577711]) * (1.0 / (1 / 255))
    video = (video.float() - mean[:, None, None]) / std[:, None, None]
    patches, t, gh, gw = mod.patchify(None, video, patch_size=14, merge_size=2,
                                                             temporal_patch_size=2)
    return patches[0], (t, gh, gw), 2 / metadata.sampled_fps


# (frames, height, width, native fps, settings)
CASES = {
    "short, upscaled": (9, 40, 60, 4, VideoSettings()),
    "odd size, 30 fps, downsampled": (31, 90, 130, 30, VideoSettings(fps=2.0, max_pixels=28 * 28 * 12)),
    "pixel budget shared by frames": (24, 112, 168, 6, VideoSettings(fps=3.0, total_pixels=28 * 28 * 40)),
    "max frames": (40, 56, 56, 10, VideoSettings(fps=4.0, max_frames=6)),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_transformers(hf_video, tmp_path, name):
    n, h, w, fps, settings = CASES[name]
    path = _clip(tmp_path / "clip.mp4", n, h, w, fps, seed=len(name))
    ours, plan = process_video(path, settings)
    ref, grid, seconds = _reference(hf_video, path, settings)
    assert plan.grid == grid and probe(path, settings).grid == grid  # header-only grid too
    assert ours.shape == ref.shape == (math.prod(grid), 1176)
    assert (ours - ref).abs().max().item() < 1e-5
    assert plan.second_per_grid == pytest.approx(seconds, rel=1e-9)


def test_frame_list_and_bad_clips(tmp_path):
    from PIL import Image

    frames = []
    for k in range(5):
        p = tmp_path / f"f{k}.png"
        Image.fromarray(np.full((50, 70, 3), 40 * k, np.uint8)).save(p)
        frames.append(p)
    pv, plan = process_video(frames, VideoSettings(fps=2.0))
    assert plan.grid[0] == 3 and plan.second_per_grid == 1.0  # 5 frames padded to 6, at data.video_fps
    assert torch.equal(pv.view(3, -1, 3, 2, 14 * 14)[2, :, :, 0], pv.view(3, -1, 3, 2, 14 * 14)[2, :, :, 1])
    short = _clip(tmp_path / "short.mp4", 3, 56, 56, 4, seed=0)
    with pytest.raises(VideoError, match="video_min_frames"):
        probe(short, VideoSettings(min_frames=4))
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\x00" * 300)
    with pytest.raises(VideoError, match="cannot be read"):
        probe(broken, VideoSettings())
