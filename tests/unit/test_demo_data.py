"""The demo set: deterministic, varied vision lengths, multi-image and collage samples, disjoint held-out digits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

import dhp.data.demo as demo
from dhp.config import DataConfig
from dhp.data.llava import SFTDataset
from dhp.data.tokenizer import Tokenizer
from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor as VL

N_TRAIN, N_EVAL = 120, 30


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> demo.DemoPaths:
    return demo.make_demo_dataset(tmp_path_factory.mktemp("demo"), seed=0, n_train=N_TRAIN, n_eval=N_EVAL)


def _items(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_files_and_counts(built: demo.DemoPaths) -> None:
    assert len(_items(built.train)) == N_TRAIN and len(_items(built.eval)) == N_EVAL
    assert (built.tokenizer / "tokenizer.json").is_file()
    assert built.images.is_dir()


def test_deterministic_given_seed(built: demo.DemoPaths, tmp_path: Path) -> None:
    again = demo.make_demo_dataset(tmp_path / "a", seed=0, n_train=N_TRAIN, n_eval=N_EVAL)
    assert again.train.read_bytes() == built.train.read_bytes()
    assert again.eval.read_bytes() == built.eval.read_bytes()
    assert (again.tokenizer / "tokenizer.json").read_bytes() == (built.tokenizer / "tokenizer.json").read_bytes()
    for name in sorted(p.name for p in built.images.iterdir())[:20]:
        assert (again.images / name).read_bytes() == (built.images / name).read_bytes()
    other = demo.make_demo_dataset(tmp_path / "b", seed=1, n_train=N_TRAIN, n_eval=N_EVAL)
    assert other.train.read_bytes() != built.train.read_bytes()


def test_held_out_uses_other_digit_instances(built: demo.DemoPaths) -> None:
    train = {d for item in _items(built.train) for d in item["digits"]}
    held = {d for item in _items(built.eval) for d in item["digits"]}
    assert train and held and not train & held


def test_variety_and_learnable_answers(built: demo.DemoPaths) -> None:
    items = _items(built.train)
    sizes, multi, collage = [], 0, 0
    for item in items:
        paths = item.get("image", [])
        paths = [paths] if isinstance(paths, str) else paths
        answer = item["conversations"][1]["value"]
        assert set(answer) <= set("0123456789 ") and answer.strip() == answer
        assert item["conversations"][0]["value"].count("<image>") == len(paths)
        if len(paths) == 2:
            multi += 1
            assert len(answer.split()) == 2
        for p in paths:
            sizes.append(Image.open(built.root / p).size)
        if len(paths) == 1 and len(item["digits"]) > 1:
            collage += 1
            w, h = Image.open(built.root / paths[0]).size
            assert w >= 2 * h * 0.99 and len(answer.split()) == len(item["digits"])
    weights = dict(zip(demo.KINDS, demo.KIND_WEIGHTS, strict=True))
    assert multi >= len(items) * weights["pair"] / 2 and collage >= len(items) * weights["collage"] / 2
    assert any(w > 112 or h > 112 for w, h in sizes)  # spans several 112 px attention windows
    assert any(w <= 112 and h <= 112 for w, h in sizes)
    assert any(w != h for w, h in sizes)
    assert len({w * h for w, h in sizes}) >= 15  # sizes vary (single 56-70 px, pairs 56-140 px, collages)


def test_loads_cleanly_with_varied_lengths(built: demo.DemoPaths) -> None:
    tok = Tokenizer(built.tokenizer)
    assert tok.vocab_size < 512
    ds = SFTDataset(DataConfig(), tok, built.train, processor=VL(DataConfig(), tok))
    assert len(ds) == N_TRAIN and ds.num_skipped == 0
    lengths = ds.lengths()
    assert max(lengths) - min(lengths) >= 24 and len(set(lengths)) >= 5  # text-only, singles, pairs, collages
    sample = ds[0]
    assert sample.num_tokens == lengths[0]
    answer = _items(built.train)[0]["conversations"][1]["value"]
    assert tok.decode([t for t in sample.labels.tolist() if t != -100]) == answer
    ev = SFTDataset(DataConfig(), tok, built.eval, processor=VL(DataConfig(), tok))
    assert len(ev) == N_EVAL


def test_ensure_builds_once_into_cache(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    assert demo.demo_dir() == tmp_path / "cache" / "demo"
    real = demo.make_demo_dataset
    calls = []

    def small(out_dir, **kw):
        calls.append(out_dir)
        return real(out_dir, n_train=8, n_eval=4)

    monkeypatch.setattr(demo, "make_demo_dataset", small)
    root = demo.ensure_demo_dataset()
    assert root == demo.demo_dir() and (root / "train.jsonl").is_file() and (root / demo.MARKER).is_file()
    assert demo.ensure_demo_dataset() == root
    assert len(calls) == 1
    monkeypatch.delenv("DHP_CACHE")
    assert demo.demo_dir() == Path.home() / ".cache" / "dhp" / "demo"
