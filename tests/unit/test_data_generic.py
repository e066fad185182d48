"""dhp/data/ is generic: it imports no model family and holds no family constant, and a third family's processor
(a toy one, defined here and nowhere under dhp/) drives SFTDataset with its own media rules, tokens and positions."""

from __future__ import annotations

import ast
import io
import json
import math
import pickle
import re
import tokenize
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import soundfile as sf
import torch
from PIL import Image

from dhp.config import DataConfig
from dhp.data.audio import read_header
from dhp.data.batch import pack
from dhp.data.demo import build_demo_tokenizer
from dhp.data.llava import SFTDataset, UnreadMedia
from dhp.data.processor import Media, MediaError, Placeholder, Processor
from dhp.data.tokenizer import Tokenizer
from dhp.errors import DataError

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "dhp" / "data"
LEAVES = {"dhp.models.spec"}  # what data/ may import from dhp.models: the shared leaf (SampleInfo), no family
# Family facts that used to live in dhp/data/: Qwen2.5-VL's patch length and 2x2 merge, Whisper's 128 mel bins
# and 16 kHz, the placeholder names, the family names. Demo-set writers may keep them (they write a family's demo
# data and tokenizer); everything else may not.
FAMILY_WORDS = re.compile(r"qwen|image_pad|video_pad|<\|IMAGE\|>|<\|AUDIO\|>|vision_bos|m-?rope|whisper", re.I)
FAMILY_NUMBERS = {1176, 128, 16000}
DEMO_WRITERS = {"demo.py", "omni_demo.py", "dtmf.py"}


def _sources() -> list[Path]:
    return sorted(p for p in DATA.glob("*.py") if p.name not in DEMO_WRITERS)


def test_data_imports_no_model_family():
    offenders = {}
    for path in DATA.glob("*.py"):
        mods = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                mods.add(node.module)
            elif isinstance(node, ast.Import):
                mods.update(a.name for a in node.names)
        bad = sorted(m for m in mods if m.startswith("dhp.models") and m not in LEAVES)
        if bad:
            offenders[path.name] = bad
    assert offenders == {}


def _findings(name: str, text: str) -> list[str]:
    """Every family number (a literal), name or token (in code, strings or comments) and ``// 4`` in ``text``."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NUMBER and tok.string.isdigit() and int(tok.string) in FAMILY_NUMBERS:
            found.append(f"{name}:{tok.start[0]}: {tok.string}")
        elif tok.type in (tokenize.STRING, tokenize.COMMENT, tokenize.NAME) and FAMILY_WORDS.search(tok.string):
            found.append(f"{name}:{tok.start[0]}: {FAMILY_WORDS.search(tok.string).group()}")
    return found + [f"{name}:{text[:m.start()].count(chr(10)) + 1}: // 4" for m in re.finditer(r"//\s*4\b", text)]


def test_data_holds_no_family_constant():
    assert [hit for path in _sources() for hit in _findings(path.name, path.read_text())] == []


def test_the_constant_check_finds_what_it_looks_for():
    """The scan is not vacuous: the old Qwen facts, written as dhp/data/ had them, are found."""
    old = ('PATCH_DIM = 1176\ncounts = [t * h * w // 4 for t, h, w in grids]\nPAD = "<|image_pad|>"  # Qwen\n'
           "torch.zeros(128, 0)\nfrom dhp.data.mrope import rope_index\n")
    assert _findings("old.py", old) == ["old.py:1: 1176", "old.py:3: image_pad", "old.py:3: Qwen", "old.py:4: 128",
                                        "old.py:5: mrope", "old.py:2: // 4"]


# ---- a third family's processor ---------------------------------------------------------------------------------

CELL = 16  # the toy's image rule: one token per 16x16 cell, no resize, no merge
TOKENS_PER_SECOND = 10  # the toy's audio rule: one token per 0.1 s at the file's own rate


class ToyImages(Media):
    """Gray images cut into 16x16 cells, one token each; ``cells`` [n, 256] and ``cell_grid`` [I, 2]."""

    kind, noun = "image", "image"

    def __init__(self, placeholder: Placeholder) -> None:
        self.placeholder = placeholder

    def probe(self, source: Path) -> tuple[int, int]:
        with Image.open(source) as img:
            width, height = img.size
        if width < CELL or height < CELL:
            raise MediaError(f"image {source} is {width}x{height}, smaller than one {CELL}x{CELL} cell; use a larger "
                             "image")
        return height // CELL, width // CELL

    def num_tokens(self, fact: tuple[int, int]) -> int:
        return fact[0] * fact[1]

    def decode(self, source: Path, fact: tuple[int, int]) -> torch.Tensor:
        gh, gw = fact
        with Image.open(source) as img:
            arr = np.asarray(img.convert("L"), dtype=np.float32)[:gh * CELL, :gw * CELL] / 255
        return torch.from_numpy(arr.reshape(gh, CELL, gw, CELL).transpose(0, 2, 1, 3).reshape(gh * gw, CELL * CELL))

    def collate(self, facts: Sequence[Any], decoded: Sequence[Any] | None) -> dict[str, torch.Tensor]:
        return {"cells": torch.cat(list(decoded)) if decoded else torch.zeros(0, CELL * CELL),
                "cell_grid": torch.tensor(list(facts), dtype=torch.long).reshape(-1, 2)}

    def info(self, facts: Sequence[Any]) -> dict[str, tuple]:
        return {"image_grids": tuple((1, h, w) for h, w in facts)}


class ToyAudio(Media):
    """Audio at the file's own rate, one token per 0.1 s; ``wave`` [samples] and ``wave_lens`` [A]."""

    kind, noun = "audio", "audio clip"

    def __init__(self, placeholder: Placeholder) -> None:
        self.placeholder = placeholder

    def probe(self, source: Path) -> tuple[int, int]:
        head = read_header(source)
        return head.frames, math.ceil(head.seconds * TOKENS_PER_SECOND)

    def num_tokens(self, fact: tuple[int, int]) -> int:
        return fact[1]

    def decode(self, source: Path, fact: tuple[int, int]) -> torch.Tensor:
        wave, _ = sf.read(str(source), dtype="float32")
        return torch.from_numpy(wave)

    def collate(self, facts: Sequence[Any], decoded: Sequence[Any] | None) -> dict[str, torch.Tensor]:
        return {"wave": torch.cat(list(decoded)) if decoded else torch.zeros(0),
                "wave_lens": torch.tensor([f[0] for f in facts], dtype=torch.long)}

    def info(self, facts: Sequence[Any]) -> dict[str, tuple]:
        return {"audio_frames": tuple(f[0] for f in facts)}


class ToyProcessor(Processor):
    """Images and audio, one position axis (plain RoPE, the base class's default)."""

    family = "toy_third"

    def __init__(self, data_cfg: Any, tokenizer: Tokenizer) -> None:
        ids = tokenizer.token_to_id
        self.media = (ToyImages(Placeholder(ids("<|vision_pad|>"))),
                      ToyAudio(Placeholder(ids("<|AUDIO|>"), (ids("<|audio_bos|>"),), (ids("<|audio_eos|>"),))))


@pytest.fixture(scope="module")
def toy(tmp_path_factory) -> tuple[Path, Tokenizer]:
    root = tmp_path_factory.mktemp("toy")
    tok = Tokenizer(build_demo_tokenizer(root / "tok", ["What is there?", "a tone and a square"], omni=True))
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (40, 70), dtype=np.uint8), "L").save(root / "wide.png")  # 2x4 cells
    Image.fromarray(rng.integers(0, 256, (8, 8), dtype=np.uint8), "L").save(root / "tiny.png")
    sf.write(str(root / "tone.wav"), (0.1 * rng.standard_normal(8000 * 3 // 4)).astype(np.float32), 8000)  # 0.75 s
    rows = [
        {"conversations": [{"from": "human", "value": "<image>What is there?"}, {"from": "gpt", "value": "a square"}],
         "image": "wide.png"},
        {"messages": [{"role": "user", "content": [{"type": "audio", "audio": "tone.wav"}, {"type": "image"},
                                                   {"type": "text", "text": "What is there?"}]},
                      {"role": "assistant", "content": "a tone and a square"}], "images": ["wide.png"]},
        {"conversations": [{"from": "human", "value": "What is there?"}, {"from": "gpt", "value": "nothing"}]},
        {"conversations": [{"from": "human", "value": "<image>What?"}, {"from": "gpt", "value": "x"}],
         "image": "tiny.png"},
    ]
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root, tok


def test_a_third_family_processor_drives_the_data_set(toy):
    root, tok = toy
    cfg = DataConfig(path=str(root / "train.jsonl"), on_error="skip")
    proc = ToyProcessor(cfg, tok)
    ds = SFTDataset(cfg, tok, processor=pickle.loads(pickle.dumps(proc)))  # it travels to workers pickled
    assert len(ds) == 3 and [i.index for i in ds.skipped] == [3]
    assert "tiny.png is 8x8, smaller than one 16x16 cell" in ds.skipped[0].message  # the family's own problem
    pad, audio = tok.token_to_id("<|vision_pad|>"), tok.token_to_id("<|AUDIO|>")
    start, end = tok.token_to_id("<|audio_bos|>"), tok.token_to_id("<|audio_eos|>")
    s0, s1, s2 = ds[0], ds[1], ds[2]
    assert s0.token_counts[pad] == 2 * 4 and s0.cells.shape == (8, 256) and s0.cell_grid.tolist() == [[2, 4]]
    assert s0.wave.shape == (0,) and s0.wave_lens.shape == (0,)  # the empty fields of a kind it does not carry
    ids = s1.input_ids.tolist()
    a = ids.index(start)  # the audio part comes first in the content, then the image part
    assert ids[a:a + 10] == [start] + [audio] * 8 + [end] and ids.index(pad) > a + 9
    assert s1.token_counts[audio] == 8 and s1.token_counts[pad] == 8  # ceil(0.75 s * 10), 2x4 cells
    assert s1.wave_lens.tolist() == [6000] and s1.wave.shape == (6000,)
    img = np.asarray(Image.open(root / "wide.png"), dtype=np.float32)
    torch.testing.assert_close(s1.cells[5], torch.from_numpy(img[16:32, 16:32].reshape(-1) / 255))  # cell (1, 1)
    empty = {k: tuple(v.shape) for k, v in proc.empty_media().items()}
    assert empty == {"cells": (0, 256), "cell_grid": (0, 2), "wave": (0,), "wave_lens": (0,)}
    assert {k: tuple(v.shape) for k, v in s2.media.items()} == empty  # the text-only sample
    for s in (s0, s1, s2):
        assert torch.equal(s.position_ids, torch.arange(s.num_tokens)[None])  # one axis: the default positions
        assert (s.labels[s.input_ids == pad] == -100).all()
    info = ds.info(1)
    assert info.image_grids == ((1, 2, 4),) and info.audio_frames == (6000,) and info.num_tokens == s1.num_tokens
    assert info.token_counts[audio] == 8 == s1.token_counts[audio]
    light = ds.get(1, pixels=False)
    assert torch.equal(light.input_ids, s1.input_ids) and light.cells.shape == (0, 256)
    assert light.cell_grid.tolist() == [[2, 4]] and light.wave_lens.tolist() == [6000]
    batch = pack([s0, s1, s2])
    assert batch.position_ids.shape == (1, 1, sum(s.num_tokens for s in (s0, s1, s2)))
    worker = SFTDataset(cfg, tok, validated=ds.validation, processor=proc)
    assert worker.lengths() == ds.lengths() and torch.equal(worker[1].cells, s1.cells)


def test_media_a_family_does_not_read_is_one_error(toy, tmp_path):
    """A video under the toy family (it reads images and audio): one error naming the file, the count and the kind,
    not a <video> tag read as text."""
    root, tok = toy
    path = tmp_path / "v.jsonl"
    rows = [{"conversations": [{"from": "human", "value": "<video>What?"}, {"from": "gpt", "value": "x"}],
             "video": str(root / "clip.mp4")}] * 2
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = DataConfig(path=str(path))
    with pytest.raises(UnreadMedia, match=r"2 sample\(s\) carry video \(the first: sample 0\) but the toy_third "
                                          r"processor reads no video") as e:
        SFTDataset(cfg, tok, processor=ToyProcessor(cfg, tok))
    assert isinstance(e.value, DataError) and e.value.kind == "video" and e.value.samples == [0, 1]
