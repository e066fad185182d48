"""`data.validate`: full reads every image through when the index is built and drops (or names) a damaged one;
headers reads sizes only, so the same file passes validation and is named, with its sample, when it is decoded.
Each mode keeps its own index (the setting is part of the key)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dhp.config import DataConfig
from dhp.data.llava import SFTDataset
from dhp.data.tokenizer import Tokenizer
from dhp.errors import DataError
from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor as VL

N_ROWS = 12
DAMAGED = 4  # the record whose image keeps its header but loses the end of its pixel data


@pytest.fixture(params=["png", "jpg"])
def data(demo_data, tmp_path, monkeypatch, request) -> Path:
    """The first rows, one of whose images keeps its header and loses the end of its pixel data: a PNG (PIL's
    ``verify`` checks its chunks), or a JPEG (whose ``verify`` checks nothing: full decodes it)."""
    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    rows = [json.loads(line) for line in demo_data.train.read_text().splitlines()][:N_ROWS]
    src = demo_data.root / rows[DAMAGED]["image"]
    damaged = tmp_path / f"damaged.{request.param}"
    if request.param == "jpg":
        from PIL import Image

        with Image.open(src) as img:
            img.convert("RGB").save(damaged, quality=95)
        body = damaged.read_bytes()
    else:
        body = src.read_bytes()
    damaged.write_bytes(body[: int(len(body) * 0.6)])  # a valid header, a truncated body
    rows[DAMAGED] = {**rows[DAMAGED], "image": str(damaged)}
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _open(path: Path, demo_data, validate: str) -> SFTDataset:
    cfg = DataConfig(path=str(path), tokenizer=str(demo_data.tokenizer), image_root=str(demo_data.root),
                     max_pixels=12544, on_error="skip", validate=validate)
    tok = Tokenizer(demo_data.tokenizer)
    return SFTDataset(cfg, tok, processor=VL(cfg, tok))


def test_full_drops_the_damaged_image_and_names_it(data, demo_data):
    ds = _open(data, demo_data, "full")
    assert len(ds) == N_ROWS - 1
    assert [i.index for i in ds.skipped] == [DAMAGED]
    message = ds.skipped[0].message
    assert f"{data.parent / 'damaged'}." in message and "is unreadable or corrupt" in message
    for i in range(len(ds)):  # every kept sample decodes
        assert ds.get(i).media["pixel_values"].shape[0] > 0


def test_headers_keeps_it_and_decoding_names_file_and_sample(data, demo_data):
    full = _open(data, demo_data, "full")
    ds = _open(data, demo_data, "headers")
    assert len(ds) == N_ROWS and ds.skipped == []  # the header alone looks right
    assert ds.index_dir != full.index_dir  # its own index: the setting is in the key
    for i in range(N_ROWS):
        if i == DAMAGED:
            with pytest.raises(DataError, match=rf"sample {DAMAGED}: image .*damaged\.(png|jpg) cannot be processed"):
                ds.get(i)
        else:  # the other samples equal the fully validated set's (which lacks the damaged one)
            a, b = ds.get(i), full.get(i - (i > DAMAGED))
            assert a.input_ids.tolist() == b.input_ids.tolist()
            assert a.media["pixel_values"].equal(b.media["pixel_values"])
