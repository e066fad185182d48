"""dhp's Qwen3-VL against transformers' Qwen3VLForConditionalGeneration (random tiny weights, float32).

Fresh shapes: two images of different sizes (one larger, one smaller than the learned position grid, so the
bilinear resampling both shrinks and grows), a video of two frame pairs with timestamp text beside an image, and
text only. DeepStack is on (two levels) in every case with vision.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dhp.models.qwen3_vl import build_model, load_hf_checkpoint, save_hf_checkpoint
from dhp.models.qwen3_vl.config import tiny
from dhp.models.qwen3_vl.mrope import rope_index
from dhp.models.qwen3_vl.weights import WEIGHTS

pytest.importorskip("transformers")

TWO_IMAGES = {"images": [[1, 12, 20], [1, 4, 6]], "video": None}
VIDEO_AND_IMAGE = {"images": [[1, 6, 4]], "video": [2, 8, 6]}
TEXT_ONLY = {"images": [], "video": None}


def tiny_cfg(tie: bool = False):
    cfg = tiny(vocab_size=300, image_token_id=290, video_token_id=291, vision_start_token_id=292,
               vision_end_token_id=293)
    return replace(cfg, text=replace(cfg.text, tie_word_embeddings=tie))


def _vision_run(cfg, token: int, n: int) -> list[int]:
    return [cfg.vision_start_token_id] + [token] * n + [cfg.vision_end_token_id]


def make_inputs(cfg, case: dict, seed: int = 0) -> dict:
    """ids [1, L] and pixels: text, each image, then (if any) a video whose frame pairs each follow a few
    timestamp text tokens, as Qwen3VLProcessor lays them out."""
    g = torch.Generator().manual_seed(seed)
    text = lambda n: torch.randint(0, 280, (n,), generator=g).tolist()  # noqa: E731
    ids = text(3)
    for t, h, w in case["images"]:
        ids += _vision_run(cfg, cfg.image_token_id, t * h * w // 4) + text(2)
    out: dict = {}
    if case["images"]:
        out["image_grid_thw"] = torch.tensor(case["images"])
        out["pixel_values"] = torch.randn(sum(t * h * w for t, h, w in case["images"]), cfg.vision.patch_dim,
                                          generator=g)
    if case["video"]:
        t, h, w = case["video"]
        for _ in range(t):
            ids += text(3) + _vision_run(cfg, cfg.video_token_id, h * w // 4)
        out["video_grid_thw"] = torch.tensor([case["video"]])
        out["pixel_values_videos"] = torch.randn(t * h * w, cfg.vision.patch_dim, generator=g)
    ids += text(7)
    out["input_ids"] = torch.tensor([ids])
    return out


def hf_forward(hf, cfg, inputs: dict) -> torch.Tensor:
    ids = inputs["input_ids"]
    mm = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    extra = {"mm_token_type_ids": mm} if len(inputs) > 1 else {}
    return hf(**inputs, **extra).logits


def hf_model_like(model, path):
    from transformers import Qwen3VLForConditionalGeneration

    save_hf_checkpoint(model, path)
    hf, info = Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32,
                                                               attn_implementation="sdpa", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return hf.eval()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = tiny_cfg()
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # LayerNorm biases and norm weights away from their init, so a swap would show
        for name, p in model.named_parameters():
            if p.ndim == 1:
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    return cfg, model, hf_model_like(model, tmp_path_factory.mktemp("ckpt"))


CASES = [TWO_IMAGES, VIDEO_AND_IMAGE, TEXT_ONLY]
CASE_IDS = ["two_images", "video_and_image", "text_only"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_logits_match_transformers(pair, case):
    cfg, model, hf = pair
    inputs = make_inputs(cfg, case)
    ours = model(**inputs)
    ref = hf_forward(hf, cfg, inputs)
    assert ours.shape == ref.shape == (1, inputs["input_ids"].shape[1], cfg.text.vocab_size)
    assert (ours - ref).abs().max().item() < 1e-4


def _hf_param(hf_params: dict, disk: str) -> torch.nn.Parameter:
    return hf_params[disk]  # transformers 5 keeps the on-disk names (model.visual, model.language_model)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_gradients_match_transformers(pair, case):
    cfg, model, hf = pair
    inputs = make_inputs(cfg, case, seed=1)
    weights = torch.randn(cfg.text.vocab_size, generator=torch.Generator().manual_seed(2))
    model.zero_grad()
    hf.zero_grad()
    (model(**inputs) * weights).sum().backward()
    (hf_forward(hf, cfg, inputs) * weights).sum().backward()
    hf_params = dict(hf.named_parameters())
    checked = {"visual": 0, "language": 0, "deepstack": 0}
    for name, p in model.named_parameters():
        parts = [hf_params[disk].grad for disk in WEIGHTS.hf_names(name)]
        if "pixel_values" not in inputs and name.startswith("visual."):
            assert p.grad is None and all(g is None for g in parts), name
            continue
        assert p.grad is not None and all(g is not None for g in parts), name
        ref = torch.cat(parts)
        scale = ref.abs().max().item() + 1e-6
        assert (p.grad - ref).abs().max().item() / scale < 1e-4, name
        checked[name.split(".")[0]] += 1
        checked["deepstack"] += "deepstack_merger_list" in name and p.grad.abs().max().item() > 0
    assert checked["language"] > 10
    if "pixel_values" in inputs:
        assert checked["visual"] > 10 and checked["deepstack"] == 2 * 6  # 2 mergers x (norm, fc1, fc2) x (w, b)


def test_deepstack_changes_the_logits(pair):
    """The DeepStack features are used: zeroing a DeepStack merger's output layer changes the logits."""
    cfg, model, _ = pair
    inputs = make_inputs(cfg, TWO_IMAGES)
    with torch.no_grad():
        ref = model(**inputs)
        fc2 = model.visual.deepstack_merger_list[1].linear_fc2
        saved = fc2.weight.clone(), fc2.bias.clone()
        fc2.weight.zero_()
        fc2.bias.zero_()
        changed = model(**inputs)
        fc2.weight.copy_(saved[0])
        fc2.bias.copy_(saved[1])
    assert (changed - ref).abs().max().item() > 1e-3


def test_rope_index_matches_transformers(pair):
    """Two rows of one batch: an image and a video (split into t = 1 groups) in one, two images in the other."""
    cfg, _, hf = pair
    a, b = make_inputs(cfg, VIDEO_AND_IMAGE, seed=3), make_inputs(cfg, TWO_IMAGES, seed=4)
    length = max(a["input_ids"].shape[1], b["input_ids"].shape[1])
    pad = lambda ids: torch.cat([ids, torch.full((1, length - ids.shape[1]), 5)], dim=1)  # noqa: E731
    ids = torch.cat([pad(a["input_ids"]), pad(b["input_ids"])])
    images = torch.cat([a["image_grid_thw"], b["image_grid_thw"]])
    mm = (ids == cfg.image_token_id).int() + 2 * (ids == cfg.video_token_id).int()
    ref, _ = hf.model.get_rope_index(ids, mm, image_grid_thw=images, video_grid_thw=a["video_grid_thw"])
    ours = rope_index(ids, images, image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                      spatial_merge_size=2, video_grid_thw=a["video_grid_thw"])
    assert torch.equal(ours, ref)
    with pytest.raises(ValueError, match="grid"):
        rope_index(ids, images[:1], image_token_id=cfg.image_token_id, video_token_id=cfg.video_token_id,
                   spatial_merge_size=2, video_grid_thw=a["video_grid_thw"])


@pytest.mark.parametrize("tie", [False, True])
def test_round_trip_through_transformers(pair, tmp_path, tie):
    """dhp -> safetensors -> transformers (no missing or unexpected keys) gives the same logits; back too. Untied:
    the module's pair (saved by dhp, loaded by transformers in the fixture); tied: a model of its own."""
    if tie:
        cfg = tiny_cfg(tie=True)
        model = build_model(cfg, seed=3)
        hf = hf_model_like(model, tmp_path / "dhp_saved")
    else:
        cfg, model, hf = pair
    inputs = make_inputs(cfg, VIDEO_AND_IMAGE, seed=4)
    with torch.no_grad():
        ours = model(**inputs)
    assert hf.config.tie_word_embeddings == tie
    assert (hf_forward(hf, cfg, inputs) - ours).abs().max().item() < 1e-4
    hf.save_pretrained(str(tmp_path / "hf_saved"))
    back = load_hf_checkpoint(tmp_path / "hf_saved")
    assert back.cfg == cfg
    with torch.no_grad():
        assert (back(**inputs) - ours).abs().max().item() < 1e-5


def test_missing_and_unknown_keys_are_listed(tmp_path):
    from safetensors.torch import load_file, save_file

    save_hf_checkpoint(build_model(tiny_cfg(), seed=6), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    del tensors["model.visual.deepstack_merger_list.0.norm.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KeyError, match="visual.deepstack_merger_list.0.norm.weight"):
        load_hf_checkpoint(tmp_path)


# ---- the family ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-8b", "qwen3-vl-32b"])
def test_preset_parameter_counts_equal_transformers(name):
    """``dhp info`` counts (the family's ``describe``) equal transformers' model built on meta from our config."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from dhp.models.registry import family_of_preset

    family = family_of_preset(name)
    assert family is not None and family.name == "qwen3_vl"
    cfg = family.preset_config(name)
    ours = sum(n for _, n, _ in family.describe(cfg))
    with torch.device("meta"):
        hf = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**cfg.to_hf_dict()))
    assert ours == sum(p.numel() for p in hf.parameters())  # tied weights counted once by both


def test_hf_path_picks_the_family_and_config_round_trips(tmp_path):
    import json

    from dhp.models.registry import resolve_family

    cfg = tiny_cfg()
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    family = resolve_family(None, str(tmp_path))
    assert family.name == "qwen3_vl"
    assert family.preset_config(str(tmp_path)) == cfg


@pytest.mark.parametrize("preset_name", ["qwen3-vl-tiny", "qwen3-vl-8b"])
def test_flops_closed_forms_equal_the_counter(preset_name):
    """The closed forms against FlopCounterMode on meta; the 8B's widths (head_dim 128, GQA 32/8) with 3 vision
    blocks (3 DeepStack levels) and 3 decoder layers: both forms are linear in the depth."""
    from dhp.models.qwen3_vl.config import preset
    from dhp.models.qwen3_vl.flops import count_text, count_vision, text_flops, vision_flops

    cfg = preset(preset_name)
    cfg = replace(cfg, vision=replace(cfg.vision, depth=3, deepstack_visual_indexes=(0, 1, 2)),
                  text=replace(cfg.text, num_hidden_layers=3))
    grids = [[1, 12, 20], [2, 8, 6]]
    assert count_vision(cfg, grids) == pytest.approx(vision_flops(grids, cfg.vision), rel=1e-9)
    segments = [37, 64]
    assert count_text(cfg, segments) == pytest.approx(text_flops(segments, cfg.text), rel=1e-9)


def test_family_modules_train_like_the_whole_model():
    """The family's two modules, built and initialised apart (each from its own seed, by name), hold exactly the
    whole model's weights; its vision ``encode`` output fed to the language module's ``loss_sum`` gives the
    whole model's loss, DeepStack included."""
    import torch.nn.functional as F

    from dhp.models.registry import get_family

    cfg = tiny_cfg()
    family = get_family("qwen3_vl")
    whole = build_model(cfg, seed=7)
    vision, text = (family.module(n).build(cfg) for n in ("vision", "text"))
    family.module("vision").init(vision, 7 + family.module("vision").seed_offset)
    family.module("text").init(text, 7 + family.module("text").seed_offset)
    for name, p in [*vision.named_parameters(prefix="visual"), *text.named_parameters(prefix="language")]:
        assert torch.equal(p, whole.get_parameter(name)), name
    inputs = make_inputs(cfg, VIDEO_AND_IMAGE, seed=8)

    class S:  # a sample as the engine hands it over
        pixel_values, image_grid_thw = inputs["pixel_values"], inputs["image_grid_thw"]
        pixel_values_videos, video_grid_thw = inputs["pixel_values_videos"], inputs["video_grid_thw"]

    out, index = family.module("vision").encode(vision, [S()], None, "cpu")
    names = ("embeds", *(f"deepstack_{i}" for i in range(cfg.deepstack_levels)))
    assert tuple(out) == family.module("vision").outputs(cfg) == names  # the named outputs, main first
    assert {t.shape[-1] for t in out.values()} == {cfg.text.hidden_size}
    assert tuple(i.name for i in family.language.inputs(cfg)) == names
    n_img = int(inputs["image_grid_thw"].prod(-1).sum()) // 4
    media = {cfg.image_token_id: family.language.handover({n: t[:n_img] for n, t in out.items()}, cfg),
             cfg.video_token_id: family.language.handover({n: t[n_img:] for n, t in out.items()}, cfg)}
    ids = inputs["input_ids"]
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    loss = text.loss_sum(ids, whole.position_ids(ids, inputs["image_grid_thw"], inputs["video_grid_thw"]),
                         targets, media)
    logits = whole(**inputs)
    ref = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.view(-1), ignore_index=-100, reduction="sum")
    assert (loss - ref).abs().item() < 1e-4


# ---- the processor ---------------------------------------------------------------------------------------
# Images: against transformers' image processor as Qwen3-VL configures it. Videos: transformers' video processor
# needs torchvision, which this environment lacks, so the video *arithmetic* (frame sampling, the temporal
# smart_resize, the timestamps and the placeholder text Qwen3VLProcessor writes) is compared against the
# reference functions themselves, read from the installed transformers source; the pixels of a video are
# checked against the image path (one frame pair of equal frames equals a still image).


def _hf_video_functions() -> dict:
    """``smart_resize`` and ``Qwen3VLVideoProcessor.sample_frames`` from transformers' source, compiled here
    (their module imports torchvision at import time; these two functions do not use it)."""
    import ast
    import inspect
    import logging
    import math

    import numpy as np
    import transformers.models.qwen3_vl as pkg

    path = Path(inspect.getfile(pkg)).with_name("video_processing_qwen3_vl.py")
    tree = ast.parse(path.read_text())
    wanted = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "smart_resize"]
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Qwen3VLVideoProcessor")
    wanted += [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "sample_frames"]
    for fn in wanted:
        fn.decorator_list = []
        for arg in fn.args.args + fn.args.kwonlyargs:
            arg.annotation = None
        fn.returns = None
    namespace = {"math": math, "np": np, "logger": logging.getLogger("hf")}
    exec(compile(ast.Module(body=wanted, type_ignores=[]), str(path), "exec"), namespace)
    return namespace


def _image(width: int, height: int, seed: int = 0):
    import numpy as np
    from PIL import Image

    arr = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    return Image.fromarray(arr, "RGB")


@pytest.mark.parametrize(("width", "height"), [(56, 56), (100, 37), (33, 250), (640, 480), (300, 7)])
def test_image_processing_matches_transformers(width, height):
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from dhp.models.qwen3_vl.processor import PATCH_DIM, image_grid, process_image

    lo, hi = 64 * 64, 32 * 32 * 96
    ref = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                   image_std=[0.5] * 3, size={"shortest_edge": lo, "longest_edge": hi})
    img = _image(width, height)
    pixels, grid = process_image(img, lo, hi)
    out = ref(images=[img], return_tensors="pt")
    assert grid.tolist() == out["image_grid_thw"][0].tolist() == list(image_grid(width, height, lo, hi))
    assert pixels.shape == out["pixel_values"].shape and pixels.shape[1] == PATCH_DIM
    assert (pixels - out["pixel_values"]).abs().max().item() < 1e-5


class _Settings:
    video_fps, video_min_frames, video_max_frames = 2.0, 4, 768
    min_pixels, video_max_pixels, video_total_pixels = 128 * 32 * 32, 768 * 32 * 32, 24576 * 32 * 32


@pytest.mark.parametrize(("total", "fps", "height", "width"),
                         [(48, 24.0, 360, 640), (7, 2.0, 56, 56), (300, 30.0, 1080, 1920), (31, 10.0, 100, 30),
                          (2000, 25.0, 480, 640)])
def test_video_arithmetic_matches_transformers(total, fps, height, width):
    """Frame indices, resized size (with the per-frame cap) and timestamps equal the reference's."""
    from types import SimpleNamespace

    from transformers.video_utils import VideoMetadata

    from dhp.models.qwen3_vl.processor import VideoSettings, plan_video

    hf = _hf_video_functions()
    settings = VideoSettings.from_data(_Settings)
    meta = VideoMetadata(total_num_frames=total, fps=fps, width=width, height=height)
    ref_self = SimpleNamespace(fps=settings.fps, min_frames=settings.min_frames, max_frames=settings.max_frames)
    indices = hf["sample_frames"](ref_self, meta).tolist()
    n = len(indices)
    per_frame = max(min(settings.max_pixels, settings.total_pixels // n), int(settings.min_pixels * 1.05))
    ref_hw = hf["smart_resize"](num_frames=n, height=height, width=width, temporal_factor=2, factor=32,
                                min_pixels=settings.min_pixels, max_pixels=per_frame * n)
    from transformers import Qwen3VLProcessor

    ref_ts = Qwen3VLProcessor._calculate_timestamps(None, list(indices), fps, 2)
    plan = plan_video(total, fps, height, width, settings)
    assert list(plan.indices) == indices
    assert (plan.height, plan.width) == tuple(ref_hw)
    assert plan.timestamps == pytest.approx(ref_ts, abs=0)
    assert plan.grid == (-(-n // 2), ref_hw[0] // 16, ref_hw[1] // 16)


@pytest.fixture(scope="module")
def demo_tokenizer(tmp_path_factory):
    from dhp.data.demo import build_demo_tokenizer
    from dhp.data.tokenizer import Tokenizer

    path = build_demo_tokenizer(tmp_path_factory.mktemp("tok"), ["<0.5 seconds> what digits 0123456789"] * 4)
    return Tokenizer(path)


def test_video_placeholder_text_matches_qwen3vl_processor(demo_tokenizer):
    """Our token block of a clip equals Qwen3VLProcessor's placeholder text (timestamps, then each frame pair's
    vision block) tokenized by the same tokenizer; and the processor's pixels of two equal frames are a still
    image's."""
    from types import SimpleNamespace

    import numpy as np
    from transformers import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    from dhp.models.qwen3_vl.processor import Qwen3VLProcessor as Ours
    from dhp.models.qwen3_vl.processor import VideoSettings, plan_video, process_frames, process_image

    data = SimpleNamespace(min_pixels=64 * 64, max_pixels=32 * 32 * 96, **{
        k: getattr(_Settings, k) for k in ("video_fps", "video_min_frames", "video_max_frames", "video_max_pixels",
                                           "video_total_pixels")})
    ours = Ours(data, demo_tokenizer, tiny_cfg())
    plan = plan_video(90, 30.0, 64, 96, VideoSettings.from_data(data))
    ref_self = SimpleNamespace(
        video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2), video_token="<|video_pad|>",
        vision_start_token="<|vision_start|>", vision_end_token="<|vision_end|>",
        _calculate_timestamps=lambda *a: Qwen3VLProcessor._calculate_timestamps(None, *a))
    text = Qwen3VLProcessor.replace_video_token(
        ref_self, {"video_grid_thw": torch.tensor([plan.grid]),
                   "video_metadata": [VideoMetadata(total_num_frames=90, fps=30.0,
                                                    frames_indices=list(plan.indices))]}, 0)
    assert "<1.5 seconds>" in text
    block = ours.blocks({"video": [plan]})["<video>"][0]
    assert block == demo_tokenizer.encode(text)
    img = _image(96, 64, seed=5)
    frames = torch.from_numpy(np.array(img)).permute(2, 0, 1)[None].expand(2, -1, -1, -1)
    small = VideoSettings(min_pixels=64 * 96, max_pixels=64 * 96, total_pixels=64 * 96 * 2)
    still, _ = process_image(img, 64 * 96, 64 * 96)
    assert (process_frames(frames.contiguous(), plan_video(2, 2.0, 64, 96, small)) - still).abs().max() < 1e-5


def test_a_video_sample_through_the_data_set_and_the_model(tmp_path, demo_tokenizer):
    """A real clip and an image through ``SFTDataset`` with the family's processor: timestamp text before each
    frame pair, header-only token counts exact, position ids those of the model, and the model runs on it."""
    import json

    import numpy as np
    from PIL import Image

    from dhp.config import DataConfig
    from dhp.data.llava import SFTDataset
    from dhp.data.video import write_clip
    from dhp.models.qwen2_5_vl.processor import vision_token_ids
    from dhp.models.registry import get_family

    pytest.importorskip("av")
    rng = np.random.default_rng(0)
    write_clip(tmp_path / "a.mp4", rng.integers(0, 256, (12, 64, 96, 3)).astype(np.uint8), fps=4)
    Image.fromarray(rng.integers(0, 256, (60, 70, 3)).astype(np.uint8)).save(tmp_path / "img.png")
    row = {"conversations": [{"from": "human", "value": "<image><video>\nwhat digits"},
                             {"from": "gpt", "value": "0 1"}], "image": "img.png", "video": "a.mp4"}
    (tmp_path / "d.jsonl").write_text(json.dumps(row) + "\n")
    data = DataConfig(min_pixels=64 * 64, max_pixels=32 * 32 * 16, max_length=512, video_max_pixels=32 * 32 * 4,
                      video_min_frames=4)
    family = get_family("qwen3_vl")
    cfg = tiny(vocab_size=64 * -(-demo_tokenizer.vocab_size // 64), **vision_token_ids(demo_tokenizer))
    ds = SFTDataset(data, demo_tokenizer, tmp_path / "d.jsonl", processor=family.processor(data, demo_tokenizer, cfg))
    sample, light = ds[0], ds.get(0, pixels=False)
    assert ds.lengths()[0] == sample.num_tokens
    assert torch.equal(sample.position_ids, light.position_ids)
    # 3 s at 2 fps: 6 frames, linspace(0, 11, 6).round() = 0 2 4 7 9 11 -> pairs at 0.25, 1.375, 2.5 s
    assert sample.video_grid_thw[0, 0].item() == 3
    text = demo_tokenizer.decode(sample.input_ids.tolist(), skip_special_tokens=False)
    assert all(f"<{s} seconds><|vision_start|><|video_pad|>" in text for s in ("0.2", "1.4", "2.5"))
    model = build_model(cfg, seed=0)
    ids = sample.input_ids[None]
    assert torch.equal(model.position_ids(ids, sample.image_grid_thw, sample.video_grid_thw)[:, 0],
                       sample.position_ids)
    logits = model(ids, sample.pixel_values, sample.image_grid_thw,
                   pixel_values_videos=sample.pixel_values_videos, video_grid_thw=sample.video_grid_thw)
    assert logits.shape == (1, ids.shape[1], cfg.text.vocab_size) and torch.isfinite(logits).all()


def test_processor_refuses_another_familys_patch_geometry():
    """A Qwen2.5-VL config (patch 14) under the Qwen3-VL processor, and back: a clear error naming both."""
    from dhp.models.qwen2_5_vl.config import tiny as qwen2_5_tiny
    from dhp.models.qwen2_5_vl.processor import check_geometry as qwen2_5_check
    from dhp.models.qwen3_vl.processor import check_geometry

    check_geometry(tiny_cfg())
    qwen2_5_check(qwen2_5_tiny())
    with pytest.raises(ValueError, match=r"\(14, 2, 2, 3\); the Qwen3-VL processor cuts \(16, 2, 2, 3\)"):
        check_geometry(qwen2_5_tiny())
    with pytest.raises(ValueError, match=r"\(16, 2, 2, 3\); the Qwen2.5-VL processor cuts \(14, 2, 2, 3\)"):
        qwen2_5_check(tiny_cfg())
