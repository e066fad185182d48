"""Observability on the Ray backend: the Chrome-trace timeline (vision running ahead is visible in it),
TensorBoard scalars read back, MFU per group in metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from dhp.cli import main
from dhp.observe.trace import PHASES, read_trace


def _overlaps(a: dict, b: dict) -> bool:
    return a["ts"] < b["ts"] + b["dur"] and b["ts"] < a["ts"] + a["dur"]


def test_trace_shows_vision_ahead_and_tensorboard_has_every_loss(ray_cluster, demo_overrides, tmp_path):
    rc = main(["train", *demo_overrides, "runtime.backend=ray", "runtime.placement=disaggregated",
               "runtime.encoders_ahead=1", "runtime.cpus_per_worker=0.5", "train.steps=3", "train.global_batch_size=12",
               "data.eval_samples=2", "output.trace_steps=2", "output.tensorboard=true", "output.save_final=false",
               "train.eval_at_end=false"])
    assert rc == 0
    out = tmp_path / "run"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for row in rows:
        assert 0 < row["mfu_vision"] < 1 and 0 < row["mfu_text"] < 1
        assert 0 < row["busy_text"] <= 1.0

    # the trace: valid Chrome-trace JSON, one row per rank, the phases named, steps 2 and 3 only
    doc = json.loads((out / "trace.json").read_text())
    assert isinstance(doc["traceEvents"], list)
    events = read_trace(out / "trace.json")
    assert {(e["module"], e["rank"]) for e in events} == {("driver", 0), ("vision", 0), ("text", 0)}
    work = [e for e in events if e["module"] != "driver"]
    assert {e["name"] for e in work} <= set(PHASES)
    # disaggregated: the p2p data plane (no emit through Ray; its waits are router_wait), the loader's rounds
    assert {"load", "forward", "router_wait", "forward_backward", "backward", "reduce", "optimizer"} <= {
        e["name"] for e in work}
    assert {e["args"]["step"] for e in events} == {2, 3}
    # vision forward of round k+1 runs under the text step of round k (encoders_ahead=1, separate workers)
    ahead = [(v, t) for v in work if v["module"] == "vision" and v["name"] == "forward"
             for t in work if t["module"] == "text" and t["name"] == "forward_backward"
             and t["args"]["step"] == v["args"]["step"] and v["args"]["round"] == t["args"]["round"] + 1]
    assert ahead, "three rounds per step: a vision forward of round k+1 for every text step k but the last"
    assert any(_overlaps(v, t) for v, t in ahead)

    # TensorBoard: the loss of every step, read back with tensorboard's own reader
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    loss = {e.step: e.value for e in acc.Scalars("loss")}
    assert loss == pytest.approx({r["step"]: r["loss"] for r in rows}, rel=1e-6)
    assert "mfu_text" in acc.Tags()["scalars"]
