"""Video samples in SFTDataset: both forms, header-only grids, and one named error per kind of bad clip."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from dhp.config import DataConfig
from dhp.data.demo import build_demo_tokenizer
from dhp.data.llava import DataError, SFTDataset
from dhp.data.tokenizer import Tokenizer
from dhp.data.video import write_clip
from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor as VL
from dhp.models.qwen2_5_vl.processor import (
    VideoSettings,
    num_patches,
    num_video_patches,
    num_video_tokens,
    process_video,
    vision_token_ids,
)

pytest.importorskip("av")

CFG = DataConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 64, max_length=512, video_max_pixels=28 * 28 * 16)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_demo_tokenizer(tmp_path_factory.mktemp("tok"), ["Which digits appear?", "3 7"]))


@pytest.fixture(scope="module")
def media(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("media")
    rng = np.random.default_rng(0)
    write_clip(root / "a.mp4", rng.integers(0, 256, (12, 64, 96, 3)).astype(np.uint8), fps=4)
    write_clip(root / "b.mp4", rng.integers(0, 256, (20, 56, 56, 3)).astype(np.uint8), fps=8)
    write_clip(root / "short.mp4", rng.integers(0, 256, (3, 56, 56, 3)).astype(np.uint8), fps=4)
    (root / "broken.mp4").write_bytes(b"not a video" * 20)
    for k in range(4):
        Image.fromarray(rng.integers(0, 256, (56, 84, 3)).astype(np.uint8)).save(root / f"f{k}.png")
    Image.fromarray(rng.integers(0, 256, (60, 60, 3)).astype(np.uint8)).save(root / "img.png")
    return root


def _write(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _llava(q: str, **media) -> dict:
    return {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "3 7"}], **media}


def test_forms_agree_and_header_grids_are_exact(media, tok):
    llava = [_llava("<video>\nWhich digits appear?", video="a.mp4"),
             _llava("<image><video><video>Which digits appear?", image="img.png",
                    videos=["b.mp4", ["f0.png", "f1.png", "f2.png", "f3.png"]])]
    messages = [
        {"messages": [{"role": "user", "content": [{"type": "video", "video": "a.mp4"},
                                                   {"type": "text", "text": "\nWhich digits appear?"}]},
                      {"role": "assistant", "content": "3 7"}]},
        {"messages": [{"role": "user", "content": "<image><video><video>Which digits appear?"},
                      {"role": "assistant", "content": "3 7"}],
         "images": ["img.png"], "videos": ["b.mp4", ["f0.png", "f1.png", "f2.png", "f3.png"]]},
    ]
    a = SFTDataset(CFG, tok, _write(media / "l.jsonl", llava), processor=VL(CFG, tok))
    b = SFTDataset(CFG, tok, _write(media / "m.jsonl", messages), processor=VL(CFG, tok))
    settings = VideoSettings.from_data(CFG)
    for i in range(2):
        x, y, light = a[i], b[i], a.get(i, pixels=False)
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.pixel_values_videos, y.pixel_values_videos)
        assert torch.equal(x.position_ids, light.position_ids) and torch.equal(x.video_grid_thw, light.video_grid_thw)
        assert light.pixel_values_videos.shape[0] == 0 and x.pixel_values_videos.shape[0] == num_video_patches(x)
        assert num_video_tokens(x) == int((x.input_ids == vision_token_ids(tok)["video_token_id"]).sum()) > 0
        assert a.lengths()[i] == x.num_tokens
        info = a.info(i)  # the planner's view counts video patches as vision work
        assert sum(t * h * w for t, h, w in info.image_grids) == num_patches(x) + num_video_patches(x)
    pv, plan = process_video(media / "a.mp4", settings)
    assert torch.equal(a[0].pixel_values_videos, pv)
    assert a[0].second_per_grid_ts.tolist() == [pytest.approx(plan.second_per_grid)]
    assert a[1].second_per_grid_ts.shape == (2,) and a[1].second_per_grid_ts[1] == 1.0  # frames at video_fps=2


def test_bad_clips_are_named(media, tok):
    rows = [_llava("<video>Which?", video="broken.mp4"),
            _llava("<video>Which?", video="short.mp4"),
            _llava("<video><video>Which?", video="a.mp4"),
            _llava("<video>Which?", video="missing.mp4"),
            _llava("<video>Which?", video="b.mp4"),  # good
            _llava("<video>Which?", video="a.mp4")]  # too long under max_length below
    path = _write(media / "bad.jsonl", rows)
    cfg = replace(CFG, max_length=80)
    with pytest.raises(DataError) as e:
        SFTDataset(cfg, tok, path, processor=VL(cfg, tok))
    by = {i.index: i.message for i in e.value.issues}
    assert "cannot be read" in by[0] and "broken.mp4" in by[0]
    assert "video_min_frames=4" in by[1] and "short.mp4" in by[1]
    assert "2 <video> placeholders but 1 video" in by[2]
    assert "does not exist" in by[3]
    assert "longer than data.max_length=80" in by[5] and "video_max_pixels" in by[5]
    assert 4 not in by and str(path) in str(e.value)
    ds = SFTDataset(replace(cfg, on_error="skip"), tok, path, processor=VL(replace(cfg, on_error="skip"), tok))
    assert len(ds) == 1 and ds.source_index(0) == 4 and ds.num_skipped == 5
