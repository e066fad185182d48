"""output.dir as an object-store URL, through a real S3-compatible server on loopback (moto's server mode).

A run whose output.dir is ``s3://bucket/run`` checkpoints there (DCP's fsspec writer from every rank, the
record and COMPLETE put after the shards), resumes from there (``train.resume=auto`` finds the newest complete
checkpoint by listing the bucket) and exports its Hugging Face copy there; its losses and exported weights equal
the same run's with a local output.dir. The endpoint reaches s3fs the way users give it: ``AWS_ENDPOINT_URL``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("moto.server", reason="needs moto[server] (pip install -e '.[test]')")
pytest.importorskip("s3fs", reason="needs s3fs (pip install -e '.[test]')")

BUCKET = "dhp-test"


@pytest.fixture(scope="module")
def s3():
    """A moto S3 server on a free loopback port for the module, dummy credentials, one bucket; the s3fs
    filesystem the driver uses."""
    import fsspec
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
                           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}.items():
            mp.setenv(key, value)
        fsspec.filesystem("s3").clear_instance_cache()
        fs = fsspec.filesystem("s3")
        fs.mkdir(BUCKET)
        yield fs
        fsspec.filesystem("s3").clear_instance_cache()
    server.stop()


def _rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _exported(files: dict[str, bytes]) -> dict:
    from safetensors.torch import load

    out = {}
    for name, data in files.items():
        if name.endswith(".safetensors"):
            out.update(load(data))
    return out


def _local_files(root) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in root.iterdir() if p.is_file()}


def _s3_files(fs, url: str) -> dict[str, bytes]:
    return {k.rsplit("/", 1)[-1]: fs.cat_file(k) for k in fs.find(url)}


def _data_on_s3(fs, demo_data, overrides: list[str]) -> list[str]:
    """The demo set (samples, images, tokenizer) uploaded to the bucket; ``overrides`` with its data keys as URLs."""
    data = f"s3://{BUCKET}/data"
    for f in sorted(p for p in demo_data.root.rglob("*") if p.is_file()):
        fs.put_file(str(f), f"{BUCKET}/data/{f.relative_to(demo_data.root)}")
    moved = {"data.path": f"{data}/{demo_data.train.relative_to(demo_data.root)}", "data.image_root": data,
             "data.tokenizer": f"{data}/{demo_data.tokenizer.relative_to(demo_data.root)}"}
    kept = [o for o in overrides if o.split("=", 1)[0] not in (*moved, "data.eval_path")]
    return kept + [f"{k}={v}" for k, v in moved.items()]


def test_checkpoint_resume_export_on_s3_equal_local(s3, demo_data, demo_overrides, tmp_path, monkeypatch, capsys):
    """Two steps with a checkpoint after each, data and output in the bucket; then step 2's checkpoint is removed
    (a run that died after step 1's) and the run resumed from step 1 to 2: losses, exported weights and config
    equal the local run's, the metrics rows are step 1's (read back from the bucket) and step 2's, step 1 is pruned
    (keep_checkpoints=1). The data, images and tokenizer were read from local copies under DHP_CACHE."""
    import torch

    from dhp.cli import main

    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    url = f"s3://{BUCKET}/run"
    base = [o for o in demo_overrides if not o.startswith("output.dir=")] + [
        "train.checkpoint_every=1", "train.eval_at_end=false", "train.steps=2"]
    local = tmp_path / "local"
    assert main(["train", *base, f"output.dir={local}"]) == 0

    remote = _data_on_s3(s3, demo_data, base)
    assert main(["train", *remote, f"output.dir={url}", "train.keep_checkpoints=0"]) == 0
    cached = json.loads(s3.cat_file(f"{url}/checkpoints/step_000001/trainer.json"))["data_path"]
    assert cached.startswith(str(tmp_path / "cache")) and cached.endswith(demo_data.train.name)
    for step in (1, 2):
        assert s3.isfile(f"{url}/checkpoints/step_00000{step}/COMPLETE")
        assert s3.isfile(f"{url}/checkpoints/step_00000{step}/text/.metadata")
    s3.rm(f"{url}/checkpoints/step_000002", recursive=True)
    capsys.readouterr()
    assert main(["train", *remote, f"output.dir={url}", "train.keep_checkpoints=1"]) == 0
    assert f"resumed from {url}/checkpoints/step_000001 (step 1)" in capsys.readouterr().out

    local_rows = _rows((local / "metrics.jsonl").read_text())
    s3_rows = _rows(s3.cat_file(f"{url}/metrics.jsonl").decode())
    assert [r["step"] for r in s3_rows] == [1, 2]
    assert [r["loss"] for r in s3_rows] == pytest.approx([r["loss"] for r in local_rows], abs=0, rel=1e-6)
    # pruned to the newest (keep_checkpoints=1): listed and removed in the bucket
    assert [p.rsplit("/", 1)[-1] for p in s3.ls(f"{url}/checkpoints")] == ["step_000002"]
    for name in ("config.yaml", "workers.json", "summary.json"):
        assert s3.isfile(f"{url}/{name}"), name

    want, got = _exported(_local_files(local / "final")), _exported(_s3_files(s3, f"{url}/final"))
    assert sorted(got) == sorted(want) and want
    for name, t in want.items():
        torch.testing.assert_close(got[name], t, rtol=1e-5, atol=1e-6, msg=name)
    assert json.loads(s3.cat_file(f"{url}/final/config.json")) == json.loads((local / "final/config.json").read_text())

    # dhp export from the bucket to another prefix: the same tensors
    assert main(["export", f"{url}/checkpoints/step_000002", f"s3://{BUCKET}/exported"]) == 0
    again = _exported(_s3_files(s3, f"s3://{BUCKET}/exported"))
    for name, t in want.items():
        torch.testing.assert_close(again[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_latest_on_s3_skips_incomplete_and_truncated(s3):
    """The newest complete and intact checkpoint, found by listing the bucket: one without COMPLETE and one whose
    shard is shorter than its record says are skipped, each named."""
    from dhp import checkpoint
    from dhp.storage import UrlPath, location

    out = location(f"s3://{BUCKET}/records")
    assert isinstance(out, UrlPath) and str(out) == f"s3://{BUCKET}/records"
    assert location("file:///tmp/run") == Path("/tmp/run") and location("run") == Path("run")  # local as before
    for step in (1, 2, 3):
        ckpt = checkpoint.step_dir(out, step)
        (ckpt / "text" / "__0_0.distcp").write_bytes(b"x" * 10)
        if step != 3:
            checkpoint.finish(ckpt, {"step": step})
    (checkpoint.step_dir(out, 2) / "text" / "__0_0.distcp").write_bytes(b"x")
    said: list[str] = []
    ckpt, record = checkpoint.latest(out, said.append)
    assert ckpt == checkpoint.step_dir(out, 1) and record["step"] == 1
    assert record["files"] == {"text/__0_0.distcp": 10}
    assert "step_000003" in said[0] and "incomplete" in said[0]
    assert "step_000002" in said[1] and "1 bytes, 10 when written" in said[1]


def test_missing_bucket_is_refused_before_anything_starts(s3, demo_overrides, capsys):
    from dhp.cli import main
    from dhp.errors import EXIT_CONFIG

    over = [o for o in demo_overrides if not o.startswith("output.dir=")]
    assert main(["train", *over, "output.dir=s3://no-such-bucket/run", "train.steps=1"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "output.dir=s3://no-such-bucket/run: cannot write there" in err and "bucket exists" in err


def test_a_parquet_set_with_inline_images_on_s3_gives_the_local_samples(s3, demo_data, tmp_path, monkeypatch):
    """data.path=s3://.../train.parquet (images inside its rows): read from its local copy, the same samples,
    token counts and pixels as the same file read locally."""
    import torch

    from dhp.config import load_config
    from dhp.inputs import dataset_spec, open_dataset, resolve_inputs
    from tests.unit.test_data_formats import _llamafactory, pa, pq

    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    rows = [json.loads(line) for line in demo_data.train.read_text().splitlines()[:12]]
    local = tmp_path / "train.parquet"
    pq.write_table(pa.table(_llamafactory(rows, demo_data, inline=True)), local)
    s3.put_file(str(local), f"{BUCKET}/parquet/train.parquet")
    opened = {}
    for where, path in (("local", str(local)), ("s3", f"s3://{BUCKET}/parquet/train.parquet")):
        run = resolve_inputs(load_config(None, [f"data.path={path}", f"data.tokenizer={demo_data.tokenizer}",
                                                "data.max_pixels=12544", "runtime.backend=local"]))
        opened[where] = open_dataset(dataset_spec(run, run.train_path))
    a, b = opened["local"], opened["s3"]
    assert len(a) == len(b) == 12 and a.lengths() == b.lengths() and str(b.file).startswith(str(tmp_path / "cache"))
    for i in (0, 5, 11):
        assert torch.equal(a[i].input_ids, b[i].input_ids) and torch.equal(a[i].pixel_values, b[i].pixel_values)
