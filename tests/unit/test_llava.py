"""SFTDataset: both file formats, exact lengths without pixels, and one named error per kind of bad sample."""

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
from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor as VL
from dhp.models.qwen2_5_vl.processor import num_image_tokens, num_patches, process_image, vision_token_ids

CFG = DataConfig(min_pixels=56 * 56, max_pixels=28 * 28 * 64, max_length=512)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    return Tokenizer(build_demo_tokenizer(tmp_path_factory.mktemp("tok"), ["What digit is this?", "3 7"]))


def _png(path: Path, width: int, height: int, seed: int = 0) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = np.random.default_rng(seed).integers(0, 256, (height, width), dtype=np.uint8)
    Image.fromarray(arr, "L").save(path)
    return path.name


def _llava(image, q: str, a: str) -> dict:
    item = {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": a}]}
    if image is not None:
        item["image"] = image
    return item


def _write_jsonl(path: Path, items: list) -> Path:
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in items))
    return path


@pytest.fixture()
def good_dir(tmp_path: Path) -> Path:
    _png(tmp_path / "a.png", 56, 56, 1)
    _png(tmp_path / "b.png", 150, 60, 2)
    _png(tmp_path / "c.png", 90, 200, 3)
    return tmp_path


def test_llava_json_samples_equal_processor_and_template(good_dir: Path, tok: Tokenizer) -> None:
    items = [_llava("a.png", "<image>\nWhat digit is this?", "3"),
             _llava(["b.png", "c.png"], "<image><image>What are the two digits?", "3 7"),
             _llava(None, "Say 5", "5")]
    path = good_dir / "train.json"
    path.write_text(json.dumps(items))
    ds = SFTDataset(CFG, tok, str(path), processor=VL(CFG, tok))
    assert len(ds) == 3 and ds.num_skipped == 0
    lengths = ds.lengths()
    for i in range(3):
        s = ds[i]
        assert s.index == i and s.num_tokens == lengths[i]
        assert s.position_ids.shape == (3, s.num_tokens)
    s = ds[1]
    pv_b, g_b = process_image(Image.open(good_dir / "b.png"), CFG.min_pixels, CFG.max_pixels)
    pv_c, g_c = process_image(Image.open(good_dir / "c.png"), CFG.min_pixels, CFG.max_pixels)
    assert torch.equal(s.pixel_values, torch.cat([pv_b, pv_c]))
    assert s.image_grid_thw.tolist() == [g_b.tolist(), g_c.tolist()]
    counts = [int(g_b.prod()) // 4, int(g_c.prod()) // 4]
    msgs = [{"role": "user", "content": items[1]["conversations"][0]["value"]}, {"role": "assistant", "content": "3 7"}]
    v = vision_token_ids(tok)
    pad, start, end = v["image_token_id"], v["vision_start_token_id"], v["vision_end_token_id"]
    blocks = {"<image>": [[start] + [pad] * n + [end] for n in counts]}
    ids, labels = tok.encode_conversation(msgs, blocks)
    assert s.input_ids.tolist() == ids and s.labels.tolist() == labels
    assert num_image_tokens(s) == sum(counts) == int((s.input_ids == pad).sum())
    assert num_patches(ds[2]) == 0 and ds[2].image_grid_thw.shape == (0, 3)
    empty = {k: tuple(v.shape) for k, v in VL(CFG, tok).empty_media().items()}  # a text-only sample's fields
    assert {k: tuple(v.shape) for k, v in ds[2].media.items()} == empty == {
        "pixel_values": (0, 1176), "image_grid_thw": (0, 3), "pixel_values_videos": (0, 1176), "video_grid_thw": (0, 3),
        "second_per_grid_ts": (0,)}


def test_messages_jsonl_and_image_root(tmp_path: Path, tok: Tokenizer) -> None:
    _png(tmp_path / "imgs" / "x.png", 80, 80)
    (tmp_path / "data").mkdir()
    item = {"messages": [{"role": "system", "content": "Digits only."}, {"role": "user", "content": "<image>Which?"},
                         {"role": "assistant", "content": "8"}], "images": ["x.png"]}
    path = _write_jsonl(tmp_path / "data" / "train.jsonl", [item])
    cfg = replace(CFG, image_root=str(tmp_path / "imgs"))
    ds = SFTDataset(cfg, tok, path, processor=VL(cfg, tok))
    s = ds[0]
    assert s.image_grid_thw.tolist() == [[1, 6, 6]]
    assert tok.decode(s.input_ids.tolist()).startswith("system\nDigits only.")
    assert tok.decode([t for t in s.labels.tolist() if t != -100]) == "8"


BAD = {
    "missing image": (_llava("nope.png", "<image>Q", "1"), "image file .*nope.png does not exist"),
    "corrupt image": (_llava("corrupt.png", "<image>Q", "1"), "corrupt.png is unreadable or corrupt"),
    "count mismatch": (_llava(["a.png"], "<image><image>Q", "1"), "2 <image> placeholders but 1 image; make them"),
    "empty conversation": ({"conversations": []}, "empty conversation"),
    "no assistant": ({"conversations": [{"from": "human", "value": "hi"}]}, "no assistant turn"),
    "unknown role": ({"conversations": [{"from": "bot", "value": "hi"}]}, "unknown role 'bot'"),
    "too long": (_llava(None, "word " * 600, "1"), r"tokens, longer than data.max_length=512"),
    "bad json": ("{not json", "not valid JSON"),
    "aspect ratio": (_llava("thin.png", "<image>Q", "1"), "aspect ratio .* above the limit of 200"),
    "no conversation key": ({"image": "a.png"}, "no 'conversations' or 'messages' key"),
}


def _bad_file(good_dir: Path, case: str) -> Path:
    (good_dir / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"garbage" * 20)
    _png(good_dir / "thin.png", 402, 2)
    good = _llava("a.png", "<image>What digit is this?", "3")
    return _write_jsonl(good_dir / "train.jsonl", [good, good, BAD[case][0], good])


@pytest.mark.parametrize("case", list(BAD))
def test_bad_sample_raises_naming_file_and_index(good_dir: Path, tok: Tokenizer, case: str) -> None:
    path = _bad_file(good_dir, case)
    with pytest.raises(DataError, match=BAD[case][1]) as e:
        SFTDataset(CFG, tok, str(path), processor=VL(CFG, tok))
    assert f"{path} sample 2: " in str(e.value)
    assert "data.on_error=skip" in str(e.value)
    assert [i.index for i in e.value.issues] == [2] * len(e.value.issues)


@pytest.mark.parametrize("case", ["missing image", "count mismatch", "too long", "bad json"])
def test_skip_drops_and_counts(good_dir: Path, tok: Tokenizer, case: str) -> None:
    path = _bad_file(good_dir, case)
    ds = SFTDataset(replace(CFG, on_error="skip"), tok, str(path), processor=VL(replace(CFG, on_error="skip"), tok))
    assert len(ds) == 3 and ds.num_skipped == 1
    assert [ds.source_index(i) for i in range(3)] == [0, 1, 3]
    assert len(ds.lengths()) == 3
    assert str(ds.skipped[0]).startswith(f"{path} sample 2: ")
    assert ds[2].index == 2 and ds[2].num_tokens == ds.lengths()[2]
    with pytest.raises(IndexError):
        ds[3]


def test_validate_lists_every_problem(good_dir: Path, tok: Tokenizer) -> None:
    items = [_llava("a.png", "<image>Q", "1"), _llava("gone.png", "Q", "1"), {"conversations": []}]
    path = _write_jsonl(good_dir / "t.jsonl", items)
    ds = SFTDataset(replace(CFG, on_error="skip"), tok, path, processor=VL(replace(CFG, on_error="skip"), tok))
    issues = ds.validate()
    assert sorted({i.index for i in issues}) == [1, 2]
    messages = " | ".join(str(i) for i in issues)
    assert "sample 1: 0 <image> placeholders but 1 image" in messages
    assert "gone.png does not exist" in messages


def test_lengths_do_not_decode_pixels(good_dir: Path, tok: Tokenizer, monkeypatch) -> None:
    path = _write_jsonl(good_dir / "t.jsonl", [_llava("b.png", "<image>Q", "1")])
    monkeypatch.setattr(Image.Image, "load", lambda self: (_ for _ in ()).throw(AssertionError("decoded pixels")))
    ds = SFTDataset(CFG, tok, path, processor=VL(CFG, tok))
    monkeypatch.undo()
    assert ds.lengths() == [ds[0].num_tokens]


def test_all_bad_or_missing_file(tmp_path: Path, tok: Tokenizer) -> None:
    with pytest.raises(DataError, match="does not exist"):
        SFTDataset(CFG, tok, tmp_path / "none.jsonl", processor=VL(CFG, tok))
    path = _write_jsonl(tmp_path / "t.jsonl", [{"conversations": []}])
    with pytest.raises(DataError, match="no usable samples"):
        SFTDataset(replace(CFG, on_error="skip"), tok, path, processor=VL(replace(CFG, on_error="skip"), tok))


def test_loading_without_pixels_gives_the_same_sample_but_pixels(demo_data):
    from dhp.config import DataConfig
    from dhp.data.llava import SFTDataset
    from dhp.data.tokenizer import Tokenizer

    cfg, tok = DataConfig(path=str(demo_data.train)), Tokenizer(demo_data.tokenizer)
    ds = SFTDataset(cfg, tok, processor=VL(cfg, tok))
    checked = 0
    for i in range(8):
        full, light = ds.get(i), ds.get(i, pixels=False)
        assert torch.equal(full.input_ids, light.input_ids) and torch.equal(full.labels, light.labels)
        assert torch.equal(full.position_ids, light.position_ids)
        assert torch.equal(full.image_grid_thw, light.image_grid_thw)
        assert light.pixel_values.shape[0] == 0 and num_patches(light) == full.pixel_values.shape[0]
        checked += num_patches(full) > 0
    assert checked >= 4


def test_validation_handed_over_gives_the_same_data_set_without_reading_images(demo_data, tmp_path, monkeypatch):
    """Workers open the data set with the driver's validation: same samples, lengths and skips, no image read."""
    import json
    import shutil

    from dhp.config import DataConfig
    from dhp.data import llava
    from dhp.data.tokenizer import Tokenizer

    rows = demo_data.train.read_text().splitlines()[:6]
    first = json.loads(rows[0])
    first["image"] = "images/missing.png"
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join([json.dumps(first)] + rows[1:]) + "\n")
    shutil.copytree(demo_data.root / "images", tmp_path / "images")
    cfg = DataConfig(path=str(data), on_error="skip")
    tok = Tokenizer(demo_data.tokenizer)
    driver = llava.SFTDataset(cfg, tok, processor=VL(cfg, tok))

    def no_image_reads(*args, **kwargs):
        raise AssertionError("a worker read an image header again")

    monkeypatch.setattr(llava.SFTDataset, "_probe", no_image_reads)
    worker = llava.SFTDataset(cfg, tok, validated=driver.validation, processor=VL(cfg, tok))
    assert len(worker) == len(driver) == 5 and worker.num_skipped == driver.num_skipped == 1
    assert worker.lengths() == driver.lengths()
    assert torch.equal(worker.get(0, pixels=False).input_ids, driver.get(0, pixels=False).input_ids)
    data.write_text("\n".join(rows[1:]) + "\n")  # the file changed under the run
    with pytest.raises(llava.DataError, match="changed since it was validated"):
        llava.SFTDataset(cfg, tok, validated=driver.validation, processor=VL(cfg, tok))


# ---- the data forms users have ----------------------------------------------------------------------------------


def _same_samples(a: SFTDataset, b: SFTDataset) -> None:
    assert len(a) == len(b)
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.input_ids.tolist() == y.input_ids.tolist() and x.labels.tolist() == y.labels.tolist()
        assert torch.equal(x.pixel_values, y.pixel_values) and torch.equal(x.image_grid_thw, y.image_grid_thw)
        assert torch.equal(x.position_ids, y.position_ids)


def test_chat_content_form_gives_the_llava_tokens_and_labels(good_dir: Path, tok: Tokenizer) -> None:
    """HF chat content (transformers' templates, TRL): text and image parts, images from 'images' or the parts."""
    llava = [_llava("a.png", "<image>\nWhat digit is this?", "3"),
             _llava(["b.png", "c.png"], "Compare <image> and <image>: which digits?", "3 7"),
             {"conversations": [{"from": "system", "value": "Digits only."}, {"from": "human", "value": "Say 5"},
                                {"from": "gpt", "value": "5"}]}]
    chat = [
        {"messages": [{"role": "user",
                       "content": [{"type": "image"}, {"type": "text", "text": "\nWhat digit is this?"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "3"}]}],
         "images": ["a.png"]},
        {"messages": [{"role": "user", "content": [
            {"type": "text", "text": "Compare "}, {"type": "image", "path": "b.png"}, {"type": "text", "text": " and "},
            {"type": "image", "image": str(good_dir / "c.png")}, {"type": "text", "text": ": which digits?"}]},
            {"role": "assistant", "content": "3 7"}]},
        {"messages": [{"role": "system", "content": [{"type": "text", "text": "Digits only."}]},
                      {"role": "user", "content": [{"type": "text", "text": "Say 5"}]},
                      {"role": "assistant", "content": [{"type": "text", "text": "5"}]}]},
    ]
    a = SFTDataset(CFG, tok, _write_jsonl(good_dir / "llava.jsonl", llava), processor=VL(CFG, tok))
    b = SFTDataset(CFG, tok, _write_jsonl(good_dir / "chat.jsonl", chat), processor=VL(CFG, tok))
    _same_samples(a, b)


def test_sharegpt_forms_of_llama_factory(good_dir: Path, tok: Tokenizer) -> None:
    """LLaMA-Factory's ShareGPT style: 'messages' with role/content and <image> tags plus 'images' (or from/value
    turns, or 'conversations' with 'images'), a top-level 'system'; the same tokens as the LLaVA sample."""
    llava = [{"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "<image>Which?"},
                                {"from": "gpt", "value": "3"}], "image": "a.png"}] * 3
    forms = [
        {"messages": [{"role": "user", "content": "<image>Which?"}, {"role": "assistant", "content": "3"}],
         "images": ["a.png"], "system": "Be brief."},
        {"messages": [{"from": "human", "value": "<image>Which?"}, {"from": "gpt", "value": "3"}],
         "images": ["a.png"], "system": "Be brief."},
        {"conversations": [{"from": "human", "value": "<image>Which?"}, {"from": "gpt", "value": "3"}],
         "images": ["a.png"], "system": "Be brief."},
    ]
    _same_samples(SFTDataset(CFG, tok, _write_jsonl(good_dir / "l.jsonl", llava), processor=VL(CFG, tok)),
                  SFTDataset(CFG, tok, _write_jsonl(good_dir / "s.jsonl", forms), processor=VL(CFG, tok)))


def test_image_part_sources(good_dir: Path, tok: Tokenizer) -> None:
    """file:// URLs and OpenAI's image_url parts name local files; a URL of a storage fsspec does not know is an
    error that says so."""
    def sample(part):
        return {"messages": [{"role": "user", "content": [part, {"type": "text", "text": "Which?"}]},
                             {"role": "assistant", "content": "3"}]}

    ok = [sample({"type": "image", "url": f"file://{good_dir / 'a.png'}"}),
          sample({"type": "image_url", "image_url": {"url": "a.png"}}),
          sample({"type": "image", "image": "a.png"})]
    ds = SFTDataset(CFG, tok, _write_jsonl(good_dir / "ok.jsonl", ok), processor=VL(CFG, tok))
    assert len(ds) == 3 and ds[0].input_ids.tolist() == ds[1].input_ids.tolist() == ds[2].input_ids.tolist()
    bad = [sample({"type": "image", "url": "nostore://example.com/a.png"}),  # (URLs fsspec reads are fetched:
           {"messages": [{"role": "user", "content": "<image>Which?"}, {"role": "assistant", "content": "3"}],
            "images": ["nostore://example.com/a.png"]},  # tests/e2e/test_object_storage.py)
           sample({"type": "video"}),
           sample({"type": "image"}),  # no file and no 'images'
           sample({"type": "text", "text": "<image>"})]
    path = _write_jsonl(good_dir / "bad.jsonl", bad)
    with pytest.raises(DataError) as e:
        SFTDataset(CFG, tok, path, processor=VL(CFG, tok))
    by_sample = {i.index: i.message for i in e.value.issues}
    assert "image nostore://example.com/a.png: fsspec knows no 'nostore://' storage" in by_sample[0]
    assert "knows no 'nostore://'" in by_sample[1]
    assert "1 <video> placeholder but 0 videos" in by_sample[2]  # a video part with no clip
    assert "1 <image> placeholder but 0 images" in by_sample[3]
    assert "tag inside a text part" in by_sample[4]


def test_errors_that_share_one_cause_say_it_first(good_dir: Path, tok: Tokenizer) -> None:
    items = [_llava("a.png", "<image>Q", "1"), _llava("b.png", "<image>Q", "2")]
    path = _write_jsonl(good_dir / "t.jsonl", items)
    (good_dir / "elsewhere").mkdir()
    with pytest.raises(DataError) as e:
        cfg = replace(CFG, image_root=str(good_dir / "elsewhere"))
        SFTDataset(cfg, tok, path, processor=VL(cfg, tok))
    head = str(e.value).splitlines()[0]
    assert "2 image file(s) not found under data.image_root=" in head and "set data.image_root" in head
    with pytest.raises(DataError) as e:
        SFTDataset(replace(CFG, max_length=8), tok, path, processor=VL(replace(CFG, max_length=8), tok))
    head = str(e.value).splitlines()[0]
    assert head.startswith("data.max_length=8: 2 sample(s)") and "raise data.max_length to at least" in head
    empty = good_dir / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="holds no samples"):
        SFTDataset(CFG, tok, empty, processor=VL(CFG, tok))


def test_skip_leaving_nothing_lists_the_problems(good_dir: Path, tok: Tokenizer) -> None:
    items = [{"conversations": []}, _llava("gone.png", "<image>Q", "1"), "{bad json"]
    with pytest.raises(DataError) as e:
        skip = replace(CFG, on_error="skip")
        SFTDataset(skip, tok, _write_jsonl(good_dir / "t.jsonl", items), processor=VL(skip, tok))
    lines = str(e.value).splitlines()
    assert "no usable samples" in lines[0] and "all 3" in lines[0]
    assert any("sample 0: empty conversation" in ln for ln in lines[1:])
    assert any("gone.png does not exist" in ln for ln in lines[1:])
    assert any("not valid JSON" in ln for ln in lines[1:])


def test_long_validation_shows_progress(good_dir: Path, tok: Tokenizer, monkeypatch, capsys) -> None:
    from dhp.data import llava

    path = _write_jsonl(good_dir / "t.jsonl", [_llava("a.png", "<image>Q", "1")] * 30)
    SFTDataset(CFG, tok, path, processor=VL(CFG, tok))
    assert capsys.readouterr().err == ""  # quick: quiet
    monkeypatch.setattr(llava, "PROGRESS_AFTER_S", 0.0)
    uncached = replace(CFG, index_cache=False)  # (the first open cached the index: a second would not validate)
    SFTDataset(uncached, tok, path, processor=VL(uncached, tok))
    err = capsys.readouterr().err
    assert f"validating {path}: 30/30 samples (100%)" in err and "3/30" in err
