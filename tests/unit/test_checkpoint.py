"""Durable training on the local backend: exact resume, safe output directories, damaged checkpoints, HF export."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dhp import checkpoint
from dhp.config import ConfigError, load_config
from dhp.errors import CheckpointError
from dhp.train import train

STEPS = 6


def run(overrides: list[str], out: Path, **extra: str) -> dict:
    over = overrides + [f"output.dir={out}"] + [f"{k}={v}" for k, v in extra.items()]
    return train(load_config(None, over))


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture
def base(demo_overrides):
    keep = [o for o in demo_overrides if not o.startswith("output.dir=")]
    return keep + [f"train.steps={STEPS}", "train.eval_at_end=false", "train.optimizer=adamw"]


@pytest.fixture
def uninterrupted(base, tmp_path):
    out = tmp_path / "whole"
    run(base, out)
    return out


def test_resume_with_the_same_config_is_exact(base, uninterrupted, tmp_path):
    """A run that died after step 5 with its last checkpoint at step 3 resumes there: the rows it wrote after the
    checkpoint are replaced (one row per step), and losses and final weights equal an uninterrupted run's."""
    out = tmp_path / "split"
    over = base + ["train.checkpoint_every=3"]
    run(over, out)
    keep = checkpoint.step_dir(out, 3)
    assert (keep / checkpoint.COMPLETE).is_file()
    shutil.rmtree(checkpoint.step_dir(out, 6))  # died before the last save
    shutil.rmtree(out / "final")
    rows = (out / "metrics.jsonl").read_text().splitlines()[:4]  # ... after writing step 5's row
    crashed = json.dumps({"step": 5, "loss": 1e9})
    (out / "metrics.jsonl").write_text("".join(r + "\n" for r in rows) + crashed + "\n")
    summary = run(over, out)
    assert summary["last_checkpoint"].endswith("step_000006")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, STEPS + 1))
    assert losses(out) == pytest.approx(losses(uninterrupted), rel=1e-6)
    whole, resumed = final_weights(uninterrupted), final_weights(out)
    assert whole.keys() == resumed.keys()
    assert max((whole[k] - resumed[k]).abs().max().item() for k in whole) <= 1e-6


def test_output_dir_is_never_silently_overwritten(base, uninterrupted):
    with pytest.raises(ConfigError, match="holds another run"):
        run(base, uninterrupted, **{"train.resume": "none"})
    summary = run(base, uninterrupted, **{"train.resume": "none", "output.overwrite": "true", "train.steps": "2"})
    assert summary["steps"] == 2
    assert [json.loads(line)["step"] for line in (uninterrupted / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert [p.name for p in checkpoint.complete_checkpoints(uninterrupted)] == ["step_000002"]


def test_a_run_that_never_starts_leaves_no_directory(base, tmp_path):
    from dhp.data.llava import DataError

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"conversations": [{"from": "human", "value": "no reply"}]}) + "\n")
    out = tmp_path / "never"
    with pytest.raises(DataError, match="no assistant turn"):
        run([o for o in base if not o.startswith("data.path=")] + [f"data.path={bad}"], out)
    assert not out.exists()


def test_damaged_checkpoints_are_skipped(base, tmp_path, capsys):
    """A save that crashed (no marker) and a truncated shard: auto resumes from the one before, and says why."""
    out = tmp_path / "run"
    run(base + ["train.checkpoint_every=2", "train.keep_checkpoints=0"], out)
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step_000002", "step_000004", "step_000006"]
    (checkpoint.step_dir(out, 6) / checkpoint.COMPLETE).unlink()  # the save of step 6 never finished
    shard = next((checkpoint.step_dir(out, 4) / "text").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])  # truncated
    found = checkpoint.latest(out)
    assert found is not None and found[0].name == "step_000002"
    printed = capsys.readouterr().out
    assert "step_000006" in printed and "incomplete" in printed
    assert "step_000004" in printed and "truncated" in printed and shard.name in printed
    with pytest.raises(checkpoint.CheckpointError, match="truncated"):
        checkpoint.read_record(checkpoint.step_dir(out, 4))


def test_another_model_or_data_is_refused(base, uninterrupted, demo_data, tmp_path):
    rows = demo_data.train.read_text().splitlines()
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(rows[:-1]) + "\n")
    over = [o for o in base if not o.startswith("data.path=")] + [f"data.path={other}",
                                                                   f"data.image_root={demo_data.root}"]
    with pytest.raises(CheckpointError, match="training data"):
        run(over, uninterrupted, **{"train.steps": 8})
    with pytest.raises(CheckpointError, match=r"train.seed"):
        run(base, uninterrupted, **{"train.steps": 8, "train.seed": 3})


def test_keep_checkpoints_prunes_only_after_a_newer_one_is_complete(base, tmp_path):
    out = tmp_path / "run"
    run(base + ["train.checkpoint_every=1", "train.keep_checkpoints=2"], out)
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step_000005", "step_000006"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_export_loads_in_transformers_with_equal_logits(base, uninterrupted, tmp_path, dtype):
    """`dhp export` writes config, safetensors (sharded with an index when large) and the tokenizer; transformers'
    logits equal dhp's own model on the same weights."""
    pytest.importorskip("transformers")
    from transformers import Qwen2_5_VLForConditionalGeneration

    from dhp.models.qwen2_5_vl import load_hf_checkpoint

    ckpt = checkpoint.complete_checkpoints(uninterrupted)[-1]
    out = tmp_path / f"hf_{dtype}"
    from dhp.cli import main

    assert main(["export", str(ckpt), str(out), "--dtype", dtype]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    ours = load_hf_checkpoint(out).float().eval()
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32,
                                                            attn_implementation="sdpa").eval()
    cfg = ours.cfg
    ids = torch.tensor([[5, 7, cfg.vision_start_token_id] + [cfg.image_token_id] * 4 + [cfg.vision_end_token_id, 9]])
    pv = torch.randn(16, cfg.vision.patch_dim, generator=torch.Generator().manual_seed(0))
    grid = torch.tensor([[1, 4, 4]])
    with torch.no_grad():
        a = ours(ids, pv, grid)
        b = hf(input_ids=ids, pixel_values=pv, image_grid_thw=grid,
               mm_token_type_ids=(ids == cfg.image_token_id).int()).logits
    assert (a - b).abs().max().item() < 1e-4
    saved = load_file(str(out / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {getattr(torch, dtype)}


def test_export_shards_a_large_model_with_an_index(uninterrupted, tmp_path):
    ckpt = checkpoint.complete_checkpoints(uninterrupted)[-1]
    out = checkpoint.export_checkpoint(ckpt, tmp_path / "hf", max_shard_bytes=200_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and all((out / f).is_file() for f in files)
    whole = final_weights(uninterrupted)
    parts = {}
    for f in files:
        parts.update(load_file(str(out / f)))
    assert parts.keys() == whole.keys()
    assert all(torch.equal(parts[k], whole[k]) for k in whole)


def _checkpoint(path: Path, complete: bool = True) -> Path:
    path.mkdir(parents=True)
    (path / checkpoint.RECORD).write_text(json.dumps({"files": {}}))
    if complete:
        (path / checkpoint.COMPLETE).write_text("")
    return path


def test_export_takes_a_checkpoint_or_a_run_directory(tmp_path):
    """`dhp export RUN_DIR OUT`: a run's output.dir (or its checkpoints/) means its newest complete checkpoint; a
    path that is neither says what to give."""
    run_dir = tmp_path / "run"
    older = _checkpoint(run_dir / "checkpoints" / "step_000004")
    newest = _checkpoint(run_dir / "checkpoints" / "step_000008")
    _checkpoint(run_dir / "checkpoints" / "step_000012", complete=False)  # a save that did not finish
    said = []
    assert checkpoint.resolve_checkpoint(older) == older
    assert checkpoint.resolve_checkpoint(str(run_dir), said.append) == newest
    assert said[-1] == f"dhp: {run_dir}: the run's newest complete checkpoint, step_000008"
    assert checkpoint.resolve_checkpoint(run_dir / "checkpoints", said.append) == newest
    with pytest.raises(CheckpointError, match="no such directory; give a checkpoint"):
        checkpoint.resolve_checkpoint(tmp_path / "nope")
    (tmp_path / "data").mkdir()
    with pytest.raises(CheckpointError, match=r"neither a checkpoint \(no trainer.json\) nor a run's output.dir"):
        checkpoint.resolve_checkpoint(tmp_path / "data")
    unfinished = run_dir / "checkpoints" / "step_000012"
    assert checkpoint.resolve_checkpoint(unfinished) == unfinished  # read_record then names it incomplete
    with pytest.raises(CheckpointError, match="no COMPLETE marker"):
        checkpoint.read_record(unfinished)
    (tmp_path / "empty_run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no complete checkpoint in this run"):
        checkpoint.resolve_checkpoint(tmp_path / "empty_run")
