"""Resume compares what matters: a checkpoint of another schedule (steps, learning rate, ...) is refused, naming the
keys, unless ``train.resume_changes=allow``, when the log says what changes; other data is named by its file and
sample count (no placeholder words); a directory whose run left no checkpoint says so without suggesting the
default; ``data.eval_samples=0`` skips evaluation instead of reporting 0 of 0."""

from __future__ import annotations

import json
import math

import pytest

from dhp.cli import main
from dhp.errors import EXIT_CONFIG, EXIT_MODEL


@pytest.fixture
def base(demo_overrides):
    return [*demo_overrides, "output.save_final=false", "train.steps=2"]


def _steps_and_lrs(out):
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step"] for r in rows], [r["lr"] for r in rows]


def test_changed_schedule_is_refused_unless_allowed(base, tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", *base, "data.eval_samples=0"]) == 0
    printed = capsys.readouterr().out
    assert "dhp: done, 2 steps in " in printed
    assert "data.eval_samples=0: evaluation skipped" in printed and "eval exact-match" not in printed
    assert "eval" not in json.loads((out / "summary.json").read_text())

    assert main(["train", *base, "train.steps=3"]) == EXIT_CONFIG  # a longer run
    err = capsys.readouterr().err
    assert err.startswith("dhp: config error: train.resume_changes: ")
    assert "train.steps: the checkpoint has 2, this run has 3" in err and "train.resume_changes=allow" in err
    assert main(["train", *base, "train.lr=5e-4"]) == EXIT_CONFIG  # nothing left to train, but another lr
    assert "train.lr: the checkpoint has 0.001, this run has 0.0005" in capsys.readouterr().err
    assert _steps_and_lrs(out)[0] == [1, 2]  # nothing ran

    assert main(["train", *base, "train.steps=3", "train.resume_changes=allow"]) == 0
    printed = capsys.readouterr().out
    steps, lrs = _steps_and_lrs(out)
    assert steps == [1, 2, 3]
    # the schedule planned again over 3 steps: warmup 1, then the cosine half way at step 3 (index 2)
    expected = 1e-3 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lrs[2] == pytest.approx(expected)
    assert "train.steps 2 -> 3" in printed and f"from step 3 of 3: learning rate {expected:.3g}" in printed
    assert "it had ended at step 2" in printed
    assert "dhp: done, step 3 (1 step this run, after a resume) in " in printed
    assert json.loads((out / "summary.json").read_text())["steps_this_run"] == 1


def test_other_data_is_named_by_file(base, demo_data, tmp_path, capsys):
    assert main(["train", *base, "train.eval_at_end=false"]) == 0
    other = tmp_path / "other.jsonl"
    other.write_text("".join(demo_data.train.read_text().splitlines(keepends=True)[:-1]))
    over = [o for o in base if not o.startswith("data.path=")] + [f"data.path={other}",
                                                                  f"data.image_root={demo_data.root}"]
    capsys.readouterr()
    assert main(["train", *over, "train.eval_at_end=false"]) == EXIT_MODEL
    err = capsys.readouterr().err
    assert f"the checkpoint has {demo_data.train} (64 usable samples" in err
    assert f"this run has {other} (63 usable samples" in err
    assert "'other data'" not in err and "'this data'" not in err


def test_a_run_without_checkpoint_does_not_suggest_the_default(base, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    assert main(["train", *base]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "holds another run (metrics.jsonl)" in err and "no complete checkpoint" in err
    assert "train.resume=auto" not in err and "output.overwrite=true" in err


def test_a_run_goes_on_from_another_runs_checkpoint_in_its_own_directory(base, tmp_path, capsys):
    """``train.resume=<run A's step 1> output.dir=B``: a new run B (its directory made), from A's exact state: its
    step 2 is A's step 2, and its metrics.jsonl starts with A's row of step 1. A second such run into B, which
    now holds a run, is refused without touching it."""
    a, b = tmp_path / "run", tmp_path / "branch"
    assert main(["train", *base, "train.checkpoint_every=1", "train.eval_at_end=false"]) == 0
    other = [o for o in base if not o.startswith("output.dir=")]
    resume = f"train.resume={a / 'checkpoints' / 'step_000001'}"
    assert main(["train", *other, f"output.dir={b}", resume, "train.eval_at_end=false"]) == 0
    assert "dhp: done, step 2 (1 step this run, after a resume)" in capsys.readouterr().out
    rows_a = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    rows_b = [json.loads(x) for x in (b / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows_b] == [1, 2] and rows_b[0] == rows_a[0]
    assert rows_b[1]["loss"] == pytest.approx(rows_a[1]["loss"], rel=1e-6)
    assert (b / "checkpoints" / "step_000002").is_dir() and not (a / "checkpoints" / "step_000003").exists()

    before = sorted(p.name for p in b.iterdir())
    assert main(["train", *other, f"output.dir={b}", resume]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"output.dir: {b} holds another run" in err and "is not one of its checkpoints" in err
    assert sorted(p.name for p in b.iterdir()) == before and (b / "checkpoints" / "step_000002").is_dir()
