"""`dhp train` end to end: the CLI, the output directory, the metrics, the evaluation, the checkpoint."""

from __future__ import annotations

import json

import yaml

from dhp.cli import main
from dhp.models.qwen2_5_vl import load_hf_checkpoint


def test_dhp_train_writes_everything(demo_overrides, tmp_path, capsys):
    rc = main(["train", *demo_overrides, "train.steps=3", "data.eval_samples=4", "train.log_every=1"])
    assert rc == 0
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "lr", "grad_norm", "tokens", "tokens_per_s", "samples_per_s", "memory_gb"):
        assert all(isinstance(r[key], (int, float)) for r in rows), key
    assert all(r["samples"] == 8 for r in rows)
    assert rows[0]["lr"] < rows[1]["lr"] or rows[1]["lr"] > rows[2]["lr"]  # warmup then decay
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["train"]["steps"] == 3
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval"]["samples"] == 4 and 0.0 <= summary["eval"]["accuracy"] <= 1.0
    model = load_hf_checkpoint(out / "final")
    assert (out / "final" / "tokenizer.json").exists()
    assert model.cfg.image_token_id == json.loads((out / "final" / "config.json").read_text())["image_token_id"]
    printed = capsys.readouterr().out
    assert "step     1 | loss" in printed and "eval exact-match" in printed


def test_config_error_names_the_key(capsys):
    assert main(["train", "train.lr=fast"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_dhp_info(capsys):
    assert main(["info", "32b"]) == 0
    out = capsys.readouterr().out
    assert "0.684 B" in out and "32.764 B" in out
