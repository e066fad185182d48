"""metrics.jsonl read back (``dhp.observe.metrics_file``): a last line cut short by a killed run is left out, and
a run resumes over it; any other damaged line is an error naming the file and the line."""

from __future__ import annotations

import json

import pytest

from dhp.errors import UsageError
from dhp.observe.metrics_file import metric_rows


def _rows(*steps: int) -> str:
    return "".join(json.dumps({"step": s, "loss": 1.0 / s}) + "\n" for s in steps)


def test_whole_rows_blank_lines_and_a_cut_last_line():
    text = _rows(1, 2) + "\n" + _rows(3) + '{"step": 4, "lo'
    got = metric_rows(text, "m.jsonl")
    assert [row["step"] for _, row in got] == [1, 2, 3]
    assert [json.loads(line) for line, _ in got] == [row for _, row in got]
    assert metric_rows("", "m.jsonl") == []


@pytest.mark.parametrize("text, line", [
    (_rows(1) + '{"step": 2, "lo\n' + _rows(3), 2),  # damaged in the middle
    (_rows(1) + '{"step": 2, "lo\n', 2),  # a whole last line (it ends the line) that is not a row
    (_rows(1) + '["not", "a", "row"]\n', 2),
    ('{"loss": 1.0}\n', 1),  # no step
])
def test_a_damaged_line_is_named(text, line):
    with pytest.raises(UsageError, match=rf"m.jsonl: line {line} is not a step's row"):
        metric_rows(text, "m.jsonl")


def test_a_run_resumes_over_a_cut_last_line_and_report_draws_it(demo_overrides, tmp_path, capsys):
    from dhp.cli import main

    out = tmp_path / "run"
    base = [*demo_overrides, "output.save_final=false", "train.eval_at_end=false", "train.checkpoint_every=1"]
    assert main(["train", *base, "train.steps=2"]) == 0
    metrics = out / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 3, "loss": 0.')  # a third step's row, cut by a kill
    assert main(["report", str(out)]) == 0
    assert main(["train", *base, "train.steps=3", "train.resume_changes=allow"]) == 0
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [1, 2, 3]
    assert "dhp: done, step 3 (1 step this run, after a resume)" in capsys.readouterr().out
