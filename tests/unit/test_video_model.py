"""Video through dhp's Qwen2.5-VL against transformers: M-RoPE positions and logits (random tiny weights)."""

from __future__ import annotations

import pytest
import torch

from dhp.models.qwen2_5_vl import build_model
from dhp.models.qwen2_5_vl.mrope import rope_index
from tests.hf_reference import hf_model_like, tiny_cfg

pytest.importorskip("transformers")

CFG = tiny_cfg()
IMG, VID = CFG.image_token_id, CFG.video_token_id


def make_inputs(items, seed=0):
    """items: ("image" | "video", (t, h, w), seconds per grid) in order -> model inputs."""
    g = torch.Generator().manual_seed(seed)
    ids: list[int] = []
    pixels = {"image": [], "video": []}
    grids = {"image": [], "video": []}
    seconds = []
    for kind, (t, h, w), sec in items:
        ids += torch.randint(0, 280, (3,), generator=g).tolist()
        pad = IMG if kind == "image" else VID
        ids += [CFG.vision_start_token_id] + [pad] * (t * h * w // 4) + [CFG.vision_end_token_id]
        pixels[kind].append(torch.randn(t * h * w, CFG.vision.patch_dim, generator=g))
        grids[kind].append([t, h, w])
        if kind == "video":
            seconds.append(sec)
    ids += torch.randint(0, 280, (7,), generator=g).tolist()

    def cat(kind):
        if not pixels[kind]:
            return None, None
        return torch.cat(pixels[kind]), torch.tensor(grids[kind], dtype=torch.long)

    (pv, ig), (pvv, vg) = cat("image"), cat("video")
    return torch.tensor([ids]), pv, ig, pvv, vg, torch.tensor(seconds, dtype=torch.float32)


CASES = {
    # a video of 3 temporal patches (6 frames of 8x12 patches) at 1.25 s per patch, and an image
    "video and image": [("video", (3, 8, 12), 1.25), ("image", (1, 12, 20), None)],
    # two clips of different lengths and rates; the second spans two attention windows across
    "two videos": [("video", (2, 4, 4), 1.0), ("video", (5, 6, 10), 0.4)],
}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    model = build_model(CFG, seed=0)
    return model, hf_model_like(model, tmp_path_factory.mktemp("ckpt"))


def _mm(ids):
    return (ids == IMG).int() + 2 * (ids == VID).int()


@pytest.mark.parametrize("name", list(CASES))
def test_rope_index_matches_transformers(pair, name):
    _, hf = pair
    ids, _, ig, _, vg, sec = make_inputs(CASES[name])
    ref, _ = hf.model.get_rope_index(ids, _mm(ids), image_grid_thw=ig, video_grid_thw=vg, second_per_grid_ts=sec)
    ours = rope_index(ids, ig, IMG, CFG.vision_start_token_id, video_grid_thw=vg, video_token_id=VID,
                      second_per_grid_ts=sec, tokens_per_second=CFG.vision.tokens_per_second)
    assert torch.equal(ours, ref)
    # the temporal axis counts seconds: the first clip's second temporal patch sits tokens_per_second * s later
    _, (_, h, w), s = CASES[name][0]
    i0 = int((ids[0] == VID).nonzero()[0])
    assert ours[0, 0, i0 + h * w // 4] - ours[0, 0, i0] == int(2 * s) != 1


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(pair, name):
    model, hf = pair
    ids, pv, ig, pvv, vg, sec = make_inputs(CASES[name], seed=1)
    ours = model(ids, pv, ig, pixel_values_videos=pvv, video_grid_thw=vg, second_per_grid_ts=sec)
    ref = hf(input_ids=ids, pixel_values=pv, image_grid_thw=ig, pixel_values_videos=pvv, video_grid_thw=vg,
             second_per_grid_ts=sec, mm_token_type_ids=_mm(ids)).logits
    assert ours.shape == ref.shape
    assert (ours - ref).abs().max().item() < 1e-4


def test_frames_never_attend_across_clips(pair):
    """Changing the second clip leaves the first clip's embeddings unchanged (one encoder call for both)."""
    model, _ = pair
    _, _, _, pvv, vg, _ = make_inputs(CASES["two videos"])
    first = 2 * 4 * 4
    a = model.encode_vision(None, None, pvv, vg)[VID]
    pvv2 = pvv.clone()
    pvv2[first:] += 1.0
    b = model.encode_vision(None, None, pvv2, vg)[VID]
    assert torch.equal(a[: first // 4], b[: first // 4]) and not torch.allclose(a[first // 4:], b[first // 4:])


def test_ulysses_cuts_a_clip_at_window_boundaries_frame_by_frame():
    """A clip of 3 temporal patches, 2 windows a frame: the SP cuts fall on window boundaries, never inside a
    window, so each rank holds whole windows of whole frames; full attention keeps per-frame segments."""
    from dhp.models.qwen2_5_vl.sequence_parallel import shard_vision
    from dhp.models.qwen2_5_vl.vision import vision_layout

    grid = torch.tensor([[3, 8, 16], [1, 4, 4]])
    layout = vision_layout(grid, CFG.vision)
    bounds = layout.cu_window_seqlens.tolist()
    assert layout.cu_seqlens.tolist() == [0, 128, 256, 384, 400]  # one full-attention segment per frame
    for sp in (2, 3, 4):
        shards = shard_vision(layout, sp)
        assert sum(s.num_patches for s in shards) == 400
        assert all(s.offset in bounds and s.offset + s.num_patches in bounds for s in shards)
