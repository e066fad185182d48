"""`data.validate=lazy`: the index from headers, each image read through before its step. A damaged image (a valid
header, a truncated body: `headers` accepts it) is replaced in its step by a deterministic substitute under
`data.on_error=skip` (named once, counted; losses equal whatever the reader threads and on resume), or stops the run
before its step naming the file under `raise`; one never reached is never reported, and no wait is endless."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from dhp import checkpoint
from dhp.config import DataConfig, load_config
from dhp.data import lazy
from dhp.data.lazy import LazyPlanner
from dhp.data.llava import SFTDataset
from dhp.data.sampler import BatchPlanner
from dhp.data.tokenizer import Tokenizer
from dhp.errors import DataError
from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor as VL
from dhp.train import train

N_ROWS, BATCH, SEED = 6, 4, 0  # one step per epoch: 4 of the 6 samples, drawn again each epoch


def step_ids(step: int) -> list[int]:
    """The samples of ``step`` in a 6-sample set with nothing dropped at validation (ids = records)."""
    return BatchPlanner({"text": [1.0] * N_ROWS}, {"text": 1}, BATCH, 2, seed=SEED).step_ids(step)[1]


def write_data(demo_data, folder: Path, damaged: list[int]) -> Path:
    """The demo set's first rows, the (first) image of records ``damaged`` cut to 60 % of its bytes."""
    rows = [json.loads(line) for line in demo_data.train.read_text().splitlines()][:N_ROWS]
    folder.mkdir(parents=True, exist_ok=True)
    for k in damaged:
        images = [rows[k]["image"]] if isinstance(rows[k]["image"], str) else rows[k]["image"]
        body = (demo_data.root / images[0]).read_bytes()
        (folder / f"damaged{k}.png").write_bytes(body[: int(len(body) * 0.6)])
        rows[k] = {**rows[k], "image": [str(folder / f"damaged{k}.png"), *images[1:]]}
    path = folder / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def open_data(path: Path, demo_data, validate: str = "lazy") -> SFTDataset:
    cfg = DataConfig(path=str(path), tokenizer=str(demo_data.tokenizer), image_root=str(demo_data.root),
                     max_pixels=12544, on_error="raise", validate=validate)
    tok = Tokenizer(demo_data.tokenizer)
    return SFTDataset(cfg, tok, processor=VL(cfg, tok))


def make_lazy(ds: SFTDataset, on_error: str, threads: int = 2, steps: int = 4) -> tuple[LazyPlanner, list[str]]:
    logged: list[str] = []
    planner = BatchPlanner({"text": [float(n) for n in ds.lengths()]}, {"text": 2}, BATCH, 2, seed=SEED)
    return LazyPlanner(planner, ds, on_error, threads, steps, log=logged.append), logged


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))


# ---- the planner (no training) ------------------------------------------------------------------------------------


def test_the_index_is_headers_one_and_keeps_the_damaged_sample(demo_data, tmp_path):
    bad = step_ids(0)[0]
    path = write_data(demo_data, tmp_path / "d", [bad])
    ds = open_data(path, demo_data)
    assert len(ds) == N_ROWS and ds.skipped == []  # a start reads headers only: the damaged body passes
    assert ds.index_dir == open_data(path, demo_data, "headers").index_dir  # one index for both
    assert lazy.read_through(ds, bad).index == bad and "damaged" in lazy.read_through(ds, bad).message
    assert lazy.read_through(ds, step_ids(0)[1]) is None


def test_a_mix_names_the_file_and_its_own_sample_number(demo_data, tmp_path):
    from dhp.data.mix import MixedDataset

    first = open_data(write_data(demo_data, tmp_path / "a", []), demo_data)
    second = open_data(write_data(demo_data, tmp_path / "b", [5]), demo_data)
    mix = MixedDataset([[first], [second]], [None, None], 0, f"{first.file},{second.file}")
    found = lazy.read_through(mix, N_ROWS + 5)
    assert (found.file, found.index) == (str(second.file), 5) and lazy.read_through(mix, 5) is None


@pytest.mark.parametrize("threads", [1, 4])
def test_skip_replaces_the_bad_sample_the_same_way_whatever_the_threads(demo_data, tmp_path, threads):
    bad = step_ids(0)[3]
    ds = open_data(write_data(demo_data, tmp_path / "d", [bad]), demo_data)
    planner, logged = make_lazy(ds, "skip", threads)
    plain = planner.planner.plan(0)
    plans = [planner.plan(s) for s in range(4)]
    planner.close()
    got = plans[0].sample_ids
    assert bad in plain.sample_ids and bad not in got  # replaced ...
    assert len(got) == len(set(got)) == BATCH  # ... by a sample not already in the step
    (sub,) = set(got) - set(plain.sample_ids)
    assert sub == planner.substitute(0, bad, set(step_ids(0)))  # from (seed, step, bad id): not from timing
    assert [len(r.sample_ids) for r in plans[0].rounds] == [len(r.sample_ids) for r in plain.rounds]
    assert all(bad not in p.sample_ids for p in plans)  # (epoch 1 reaches it again: replaced again)
    assert list(planner.skipped) == [bad]
    assert len(logged) == 1 and f"sample {bad}: image" in logged[0] and f"damaged{bad}.png" in logged[0]


def test_a_bad_sample_never_reached_is_never_reported(demo_data, tmp_path):
    later = next(i for i in step_ids(1) if i not in step_ids(0))  # read ahead while step 0 trains, never planned
    ds = open_data(write_data(demo_data, tmp_path / "d", [later]), demo_data)
    planner, logged = make_lazy(ds, "raise", steps=2)
    assert planner.plan(0).sample_ids  # no error: step 0's samples read through
    assert later in planner.reader.problems([later])  # (the reader found it ...)
    planner.close()
    assert logged == [] and planner.skipped == {}  # (... and nobody was told)


def test_a_read_that_never_ends_or_fails_stops_the_step_naming_the_sample(demo_data, tmp_path, monkeypatch):
    ds = open_data(write_data(demo_data, tmp_path / "d", []), demo_data)
    release = threading.Event()
    monkeypatch.setattr(lazy, "read_through", lambda dataset, i: release.wait() and None)  # a hung file system
    planner, _ = make_lazy(ds, "raise")
    planner.reader.wait_s = 0.2
    with pytest.raises(DataError, match=r"train.jsonl sample \d+: its media were not read within 0.2 s"):
        planner.plan(0)
    release.set()
    planner.close()

    def broken(dataset, i):
        raise KeyError("a bug in a processor")

    monkeypatch.setattr(lazy, "read_through", broken)
    planner, _ = make_lazy(ds, "raise")
    with pytest.raises(RuntimeError, match=r"sample \d+ through failed: KeyError: 'a bug in a processor'"):
        planner.plan(0)
    planner.close()


# ---- training runs on the local backend ---------------------------------------------------------------------------


def run(demo_overrides, demo_data, path: Path, out: Path, **extra: object) -> dict:
    over = [o for o in demo_overrides if not o.startswith(("data.path=", "output.dir="))]
    over += [f"data.path={path}", f"data.image_root={demo_data.root}", f"output.dir={out}", "train.eval_at_end=false",
             "output.save_final=false", f"train.seed={SEED}", f"train.global_batch_size={BATCH}",
             "train.micro_batch_size=2",
             "data.validate=lazy", *(f"{k}={v}" for k, v in extra.items())]
    return train(load_config(None, over))


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_skip_trains_names_it_once_and_its_losses_hold_across_threads_and_resume(demo_overrides, demo_data, tmp_path,
                                                                                  capsys):
    bad = next(i for i in step_ids(0) if i in step_ids(1))  # reached in step 1 and again in step 2 (epoch 1)
    path = write_data(demo_data, tmp_path / "d", [bad])
    common = {"data.on_error": "skip", "train.steps": 2, "train.checkpoint_every": 1}
    out = tmp_path / "run"
    summary = run(demo_overrides, demo_data, path, out, **common, **{"data.index_workers": 1, "data.loader_workers": 0})
    said = capsys.readouterr().out
    assert said.count(f"skipped {path} sample {bad}: image") == 1
    assert summary["skipped_samples"] == 1 and [r["skipped_samples"] for r in rows(out)] == [1, 1]
    losses = [r["loss"] for r in rows(out)]
    shutil.rmtree(checkpoint.step_dir(out, 2))  # died before its last save: resumed from step 1, across step 2 ...
    run(demo_overrides, demo_data, path, out, **common, **{"data.index_workers": 3, "data.loader_workers": 2})
    assert [r["step"] for r in rows(out)] == [1, 2]  # ... with other reader threads and loader workers
    assert [r["loss"] for r in rows(out)] == pytest.approx(losses, rel=1e-6)  # the same substitute
    assert capsys.readouterr().out.count(f"skipped {path} sample {bad}: image") == 1


def test_raise_stops_before_the_step_naming_the_file_and_keeps_the_checkpoints(demo_overrides, demo_data, tmp_path):
    bad = next(i for i in step_ids(1) if i not in step_ids(0))  # step 1 trains, step 2 is refused
    path = write_data(demo_data, tmp_path / "d", [bad])
    out = tmp_path / "run"
    with pytest.raises(DataError) as e:  # (no train.checkpoint_every: the stop writes one)
        run(demo_overrides, demo_data, path, out, **{"train.steps": 2})
    first, *rest = str(e.value).splitlines()
    assert f"{path} sample {bad}: image" in first and f"damaged{bad}.png" in first and "before step 2" in first
    assert "data.on_error=skip" in first and e.value.exit_code == 3 and [i.index for i in e.value.issues] == [bad]
    assert [r["step"] for r in rows(out)] == [1]
    assert [p.name for p in checkpoint.complete_checkpoints(out)] == ["step_000001"]
    assert "step_000001 holds the run up to step 1" in rest[-1]
    summary = run(demo_overrides, demo_data, path, out, **{"train.steps": 2, "data.on_error": "skip"})
    assert [r["step"] for r in rows(out)] == [1, 2] and summary["skipped_samples"] == 1  # resumed: nothing lost
