"""The README's examples that need no GPU run as written: its data-form samples, `dhp info`, `dhp data ...`."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from dhp.cli import main

README = Path(__file__).resolve().parents[2] / "README.md"


def _blocks(lang: str, section: str | None = None) -> list[str]:
    text = README.read_text()
    if section is not None:
        start = text.index(f"## {section}")
        end = text.find("\n## ", start + 1)
        text = text[start:end if end > 0 else None]
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _commands(block: str) -> list[list[str]]:
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            out.append(shlex.split(line))
    return out


def test_every_data_form_gives_the_same_sample(demo_data, tmp_path):
    from dhp.config import DataConfig
    from dhp.data.llava import SFTDataset
    from dhp.data.tokenizer import Tokenizer
    from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor

    samples = [json.loads(b) for b in _blocks("json", "Data forms")]
    assert len(samples) == 4
    (tmp_path / "images").mkdir()
    Image.fromarray(np.full((56, 56), 200, dtype=np.uint8), "L").save(tmp_path / "images" / "0.png")
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(s) + "\n" for s in samples))
    cfg, tok = DataConfig(path=str(path)), Tokenizer(demo_data.tokenizer)
    ds = SFTDataset(cfg, tok, processor=Qwen2_5_VLProcessor(cfg, tok))
    assert len(ds) == 4 and ds.num_skipped == 0
    first = ds[0]
    for i in range(1, 4):
        assert ds[i].input_ids.tolist() == first.input_ids.tolist()
        assert ds[i].labels.tolist() == first.labels.tolist()


def test_the_data_forms_commands_run(tmp_path, monkeypatch, capsys):
    """`dhp data demo`, `dhp data check` and `dhp info` as the README writes them (in a temporary folder, and a
    smaller demo set, to stay fast)."""
    from dhp.data import demo

    made = demo.make_demo_dataset
    monkeypatch.setattr(demo, "make_demo_dataset", lambda out, seed=0: made(out, seed=seed, n_train=24, n_eval=4))
    (block,) = [b for b in _blocks("bash", "Data forms") if "dhp data demo" in b]
    commands = _commands(block)
    assert [c[:3] for c in commands] == [["dhp", "data", "demo"], ["dhp", "data", "check"], ["dhp", "info", "tiny"]]
    for argv in commands:
        argv = [a.replace("/tmp/dhp-demo", str(tmp_path / "dhp-demo")) for a in argv]
        assert main(argv[1:]) == 0, argv
    out = capsys.readouterr().out
    assert "24 good samples, 0 skipped" in out and "total" in out


@pytest.mark.parametrize("argv", [c for b in _blocks("bash") for c in _commands(b) if c[:2] == ["dhp", "info"]],
                         ids=lambda c: " ".join(c))
def test_dhp_info_lines_run(argv, capsys):
    assert main(argv[1:]) == 0
    assert re.search(r"total +\d+\.\d\d [KMB]\n", capsys.readouterr().out)
