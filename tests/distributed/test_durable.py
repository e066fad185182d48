"""Durable training on real Ray actors: exact resume, resharding between layouts and backends, recovery from a
killed worker, a clear stop without recovery, and SIGTERM; on a parquet data set with inline images."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from dhp import checkpoint
from dhp.config import load_config
from dhp.runtime import WorkerError
from dhp.train import train

STEPS = 4
SGD = ["train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9"]
LAYOUTS = {
    "local": ["runtime.backend=local"],
    "collocated": ["runtime.backend=ray", "runtime.placement=collocated", "vision.parallel.dp=2",
                   "text.parallel.dp=2"],
    "disaggregated": ["runtime.backend=ray", "runtime.placement=disaggregated", "vision.parallel.sp=2",
                      "text.parallel.tp=2"],
    "sharded": ["runtime.backend=ray", "runtime.placement=collocated", "vision.parallel.sp=2",
                "vision.parallel.dp=2", "vision.parallel.zero=3", "text.parallel.tp=2", "text.parallel.dp=2",
                "text.parallel.zero=1", "runtime.cpus_per_worker=0.25"],
}


def _alive_dhp_actors() -> list[str]:
    table = ray._private.state.actors().values()
    return sorted(a["Name"] for a in table if a["State"] == "ALIVE" and a["Name"].startswith("dhp-"))


def run(overrides: list[str], out: Path, *extra: str) -> dict:
    return train(load_config(None, overrides + [f"output.dir={out}", *extra]))


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def assert_same_run(out: Path, ref: Path) -> None:
    assert losses(out) == pytest.approx(losses(ref), rel=1e-5)
    a, b = weights(out), weights(ref)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def parquet_copy(demo_data, path: Path) -> Path:
    """The demo's training set as one parquet file with the images inline (LLaMA-Factory's converted columns:
    ``messages`` with ``<image>`` tags, an ``images`` list of HF ``datasets`` Image cells), in row groups of 16:
    every worker reads its samples by row."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    role = {"human": "user", "gpt": "assistant"}
    rows = [json.loads(line) for line in demo_data.train.read_text().splitlines()]
    images = [[] if r.get("image") is None else [r["image"]] if isinstance(r["image"], str) else r["image"]
              for r in rows]
    pq.write_table(pa.table({
        "messages": [[{"role": role[t["from"]], "content": t["value"]} for t in r["conversations"]] for r in rows],
        "images": [[{"bytes": (demo_data.root / p).read_bytes(), "path": p} for p in ps] for ps in images],
    }), path, row_group_size=16)
    return path


@pytest.fixture(scope="module")
def base(demo_data, tmp_path_factory):
    """Every run of the module trains on the parquet copy (layout parity and exact resume on parquet; JSONL's
    are the other Ray modules')."""
    data = parquet_copy(demo_data, tmp_path_factory.mktemp("parquet") / "train.parquet")
    return [f"data.path={data}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "train.global_batch_size=8", "train.micro_batch_size=2", "train.warmup_steps=1",
            f"train.steps={STEPS}", "train.eval_at_end=false", "runtime.cpus_per_worker=0.5", *SGD]


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory):
    """The uninterrupted run, single-process."""
    out = tmp_path_factory.mktemp("reference")
    run(base + LAYOUTS["local"], out)
    return out


@pytest.mark.parametrize(("first", "second"), [
    ("collocated", "collocated"),  # (disaggregated to disaggregated: the killed worker's restart below)
    ("sharded", "local"),  # resharding: Ray FSDP x SP and ZeRO-1 x TP, optimizer state included, to one process
    ("local", "sharded"),  # ... and back
])
def test_resume_equals_an_uninterrupted_run(ray_cluster, base, reference, tmp_path, first, second):
    out = tmp_path / "run"
    run(base + LAYOUTS[first] + ["train.checkpoint_every=2"], out)
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step_000002", "step_000004"]
    shutil.rmtree(checkpoint.step_dir(out, 4))  # as if the run had died after step 2's checkpoint
    record = checkpoint.read_record(checkpoint.step_dir(out, 2))
    assert record["backend"] == LAYOUTS[first][0].split("=")[1] and record["step"] == 2
    run(base + LAYOUTS[second], out)  # resume=auto: steps 3 and 4 again, on the second layout
    assert_same_run(out, reference)
    workers = json.loads((out / "workers.json").read_text())
    assert {w["module"] for w in workers} == {"vision", "text"} and all(w["pid"] > 0 for w in workers)
    assert _alive_dhp_actors() == []


def _kill_when(out: Path, rows: int, module: str, rank: int, killed: list) -> None:
    deadline = time.monotonic() + 120
    metrics, workers = out / "metrics.jsonl", out / "workers.json"
    while time.monotonic() < deadline:
        if metrics.is_file() and len(metrics.read_text().splitlines()) >= rows and workers.is_file():
            pid = next(w["pid"] for w in json.loads(workers.read_text()) if (w["module"], w["rank"]) == (module, rank))
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return
        time.sleep(0.02)


def test_a_killed_worker_is_survived(ray_cluster, base, reference, tmp_path):
    """SIGKILL a text worker (its pid from workers.json) after step 3 with checkpoint_every=2 and max_failures=1:
    every group restarts from step 2's checkpoint (the disaggregated layout saved and loaded by itself), the run
    finishes, and its losses and weights equal the uninterrupted single-process run's."""
    layout = LAYOUTS["disaggregated"]
    steps = ["train.checkpoint_every=2"]
    out = tmp_path / "killed"
    killed: list[int] = []
    killer = threading.Thread(target=_kill_when, args=(out, 3, "text", 1, killed))
    killer.start()
    summary = run(base + layout + steps, out, "runtime.max_failures=1")
    killer.join()
    assert killed, "the run finished before the worker could be killed"
    assert summary["failures_survived"] == 1
    assert killed[0] not in {w["pid"] for w in json.loads((out / "workers.json").read_text())}  # rewritten
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == list(
        range(1, STEPS + 1))
    assert_same_run(out, reference)
    assert _alive_dhp_actors() == []


def test_without_recovery_a_dead_worker_stops_the_run_clearly(ray_cluster, base, tmp_path):
    out = tmp_path / "killed"
    killed: list[int] = []
    killer = threading.Thread(target=_kill_when, args=(out, 1, "vision", 0, killed))
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(WorkerError) as err:
        run(base + LAYOUTS["collocated"], out, "train.steps=30", "runtime.max_failures=0")
    killer.join()
    assert killed and time.monotonic() - t0 < 120  # nothing hangs
    assert err.value.module == "vision" and err.value.rank == 0 and err.value.step >= 2
    assert "vision rank 0" in str(err.value)
    assert _alive_dhp_actors() == []


def test_sigterm_leaves_a_checkpoint_that_resumes(base, tmp_path):
    """A preempted run (SIGTERM) finishes its step, writes a checkpoint, exits non-zero with the resume command."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "dhp.cli", "train", *base, "runtime.backend=local", "train.steps=500",
           f"output.dir={out}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, output
    assert "SIGTERM" in output and "Resume" in output
    found = checkpoint.latest(out)
    assert found is not None
    step = found[1]["step"]
    assert step == len(metrics.read_text().splitlines()) >= 2
    summary = run(base + LAYOUTS["local"], out, f"train.steps={step + 1}", "train.resume_changes=allow")
    assert summary["last_checkpoint"].endswith(f"step_{step + 1:06d}")
    assert len(metrics.read_text().splitlines()) == step + 1
