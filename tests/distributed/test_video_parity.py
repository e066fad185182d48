"""Video under the Ray runtime equals the single-process reference: vision Ulysses sp=2 with dp=2, text tp=2.

The clips span several attention windows per frame and several frames, so Ulysses cuts them at window
boundaries inside a clip; samples mix videos (files and frame lists), images and text only, so the language
model's media hold both placeholders of the vision encoder (``<|image_pad|>`` and ``<|video_pad|>``)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from dhp.data.video import write_clip
from tests.parity import assert_matches_reference, run_steps

pytest.importorskip("av")


def write_video_data(root, n: int = 16):
    rng = np.random.default_rng(0)
    rows = []
    for i in range(n):
        q = {"from": "human", "value": "Which digits appear, in order?"}
        a = {"from": "gpt", "value": " ".join(str(d) for d in rng.integers(0, 10, 2))}
        kind = i % 4
        if kind in (0, 1):  # a clip: 112 x (112 or 224) px, 6-8 frames at 4 fps -> t = 2..3, 1-2 windows a frame
            width = 224 if kind == 0 else 112
            frames = rng.integers(0, 256, (6 + 2 * (i % 2), 112, width, 3)).astype(np.uint8)
            write_clip(root / f"v{i}.mp4", frames, fps=4)
            row = {"video": f"v{i}.mp4"}
            q["value"] = "<video>\n" + q["value"]
            if i % 8 == 0:  # and an image
                Image.fromarray(rng.integers(0, 256, (56, 84, 3)).astype(np.uint8)).save(root / f"i{i}.png")
                row["image"] = f"i{i}.png"
                q["value"] = "<image>" + q["value"]
        elif kind == 2:  # a frame list
            paths = []
            for k in range(4):
                Image.fromarray(rng.integers(0, 256, (56, 112, 3)).astype(np.uint8)).save(root / f"f{i}_{k}.png")
                paths.append(f"f{i}_{k}.png")
            row = {"video": paths}
            q["value"] = "<video>" + q["value"]
        else:
            row = {}
        rows.append({"conversations": [q, a], **row})
    (root / "video.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root / "video.jsonl"


@pytest.fixture(scope="module")
def video_overrides(demo_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("video")
    data = write_video_data(out)
    return [f"data.path={data}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "data.video_max_pixels=25088", "data.max_length=1024", "train.global_batch_size=8",
            "train.micro_batch_size=2", "train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9",
            "train.warmup_steps=1", "train.clip_grad_norm=1.0", f"output.dir={out / 'run'}",
            "runtime.cpus_per_worker=0.5"]


def test_video_under_vision_sp_and_text_tp_matches_the_reference(ray_cluster, video_overrides):
    reference = run_steps(video_overrides + ["runtime.backend=local"])
    stats, state, _ = run_steps(video_overrides + [
        "runtime.backend=ray", "runtime.placement=disaggregated", "vision.parallel.sp=2", "vision.parallel.dp=2",
        "text.parallel.tp=2",
    ])
    assert_matches_reference(stats, state, reference)
    assert [len(state[m]) for m in ("vision", "text")] == [4, 2]
