"""`dhp train configs/omni_demo.yaml` end to end, shortened: the family's demo set generated into the cache,
three Ray groups on separate workers, metrics per group, evaluation, and an HF thinker checkpoint that
transformers loads."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from dhp.cli import main

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "omni_demo.yaml"


def test_omni_demo_config_trains_three_groups(tmp_path, monkeypatch, capsys):
    from dhp.data import omni_demo

    made = omni_demo.make_omni_demo_dataset
    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(omni_demo, "make_omni_demo_dataset", lambda out, seed=0: made(out, seed, 40, 8))
    out = tmp_path / "run"
    rc = main(["train", str(CONFIG), "train.steps=2", "train.global_batch_size=8", "train.micro_batch_size=4",
               "data.eval_samples=4", "train.log_every=1", f"output.dir={out}"])
    assert rc == 0
    assert (tmp_path / "cache" / "omni_demo" / "train.jsonl").is_file()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["mfu_audio"] > 0 and r["busy_audio"] > 0 for r in rows)  # the audio group worked every step
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"]["samples"] == 4
    workers = json.loads((out / "workers.json").read_text())
    assert {w["module"] for w in workers} >= {"vision", "audio", "text"}

    from transformers import Qwen2_5OmniThinkerForConditionalGeneration

    hf, info = Qwen2_5OmniThinkerForConditionalGeneration.from_pretrained(str(out / "final"), dtype=torch.float32,
                                                                          output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert "eval exact-match" in capsys.readouterr().out
