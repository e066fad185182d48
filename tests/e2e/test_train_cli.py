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
    assert all(r["imbalance_vision"] == 1.0 and r["imbalance_text"] == 1.0 for r in rows)  # one replica each
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
    assert "684.42 M" in out and "32.76 B" in out and "33.45 B" in out


def test_dhp_data_check_validates_as_train_does(demo_overrides, demo_data, tmp_path, capsys):
    """`dhp data check` takes the same config and key=value overrides as `dhp train` (it used to crash with an
    ImportError), reports the good samples, and names a broken one with its file."""
    assert main(["data", "check", *demo_overrides]) == 0
    out = capsys.readouterr().out
    assert f"{demo_data.train}: 64 good samples, 0 skipped" in out
    rows = demo_data.train.read_text().splitlines()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows[:5] + ['{"conversations": [{"from": "human", "value": "hi"}]}']) + "\n")
    over = [o for o in demo_overrides if not o.startswith("data.path=")] + [f"data.path={bad}"]
    for o in ("data.image_root=" + str(demo_data.root),):
        over.append(o)
    assert main(["data", "check", *over]) == 3  # a data error
    err = capsys.readouterr().err
    assert f"{bad} sample 5" in err and "no assistant turn" in err
    assert main(["data", "check", *over, "data.on_error=skip"]) == 0
    assert "5 good samples, 1 skipped" in capsys.readouterr().out


def test_dhp_data_check_defaults_to_the_embedded_config(monkeypatch, tmp_path, capsys):
    """No config: the embedded demo config (its data set generated into the cache) is checked."""
    from dhp.data import demo

    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "make_demo_dataset", _small_demo(demo.make_demo_dataset))
    assert main(["data", "check"]) == 0
    assert "good samples" in capsys.readouterr().out


def _small_demo(make):
    def small(out_dir, seed=0, n_train=8000, n_eval=200):
        return make(out_dir, seed=seed, n_train=24, n_eval=8)

    return small
