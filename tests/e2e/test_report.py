"""`dhp report RUN_DIR`: non-empty PNGs from a short run's metrics.jsonl and trace.json."""

from __future__ import annotations

import json
import shutil

from dhp.cli import main


def test_report_writes_pngs(demo_overrides, tmp_path, capsys):
    rc = main(["train", *demo_overrides, "train.steps=2", "output.trace_steps=1", "output.save_final=false",
               "train.eval_at_end=false"])
    assert rc == 0
    run = tmp_path / "run"
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(0 < r["mfu_text"] < 1 and r["model_flops_vision"] > 0 for r in rows)  # local backend: MFU too
    assert "mfu" in capsys.readouterr().out
    rc = main(["report", str(run)])
    assert rc == 0
    for name in ("loss_lr.png", "throughput_mfu.png", "memory.png", "timeline.png"):
        png = run / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    assert main(["report", str(tmp_path / "missing")]) == 2
    # a `dhp bench` directory (bench.json, a run per layout): a report of each layout, under --out/<layout>
    bench = tmp_path / "bench"
    for layout in ("dhp", "fsdp"):
        shutil.copytree(run, bench / layout, ignore=shutil.ignore_patterns("plots", "checkpoints"))
    (bench / "bench.json").write_text("{}")
    capsys.readouterr()
    assert main(["report", str(bench), "--out", str(tmp_path / "plots")]) == 0
    assert "a report of each layout (dhp, fsdp)" in capsys.readouterr().out
    assert all((tmp_path / "plots" / layout / "loss_lr.png").is_file() for layout in ("dhp", "fsdp"))
    assert main(["report", str(bench / "dhp" / "checkpoints")]) == 2  # neither a run nor a bench
    # a trace.json that is not dhp's (dhp writes it whole, atomically): said, the other plots still drawn
    (run / "trace.json").write_text('{"traceEvents": [{"name": "x", "ph": "X"')
    shutil.rmtree(run / "plots")
    capsys.readouterr()
    assert main(["report", str(run)]) == 0
    assert "trace.json: not a trace dhp wrote (JSONDecodeError" in capsys.readouterr().err
    assert (run / "plots" / "loss_lr.png").is_file() and not (run / "plots" / "timeline.png").exists()
