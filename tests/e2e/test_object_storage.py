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


def _upload(fs, demo_data) -> str:
    """The demo set (samples, images, tokenizer) uploaded to the bucket (once); its URL."""
    if not fs.exists(f"{BUCKET}/data/{demo_data.train.name}"):
        for f in sorted(p for p in demo_data.root.rglob("*") if p.is_file()):
            fs.put_file(str(f), f"{BUCKET}/data/{f.relative_to(demo_data.root)}")
    return f"s3://{BUCKET}/data"


def _data_on_s3(fs, demo_data, overrides: list[str]) -> list[str]:
    """The demo set uploaded to the bucket; ``overrides`` with its data keys as URLs."""
    data = _upload(fs, demo_data)
    moved = {"data.path": f"{data}/{demo_data.train.relative_to(demo_data.root)}", "data.image_root": data,
             "data.tokenizer": f"{data}/{demo_data.tokenizer.relative_to(demo_data.root)}"}
    kept = [o for o in overrides if o.split("=", 1)[0] not in (*moved, "data.eval_path")]
    return kept + [f"{k}={v}" for k, v in moved.items()]


def test_checkpoint_resume_export_on_s3_equal_local(s3, demo_data, demo_overrides, tmp_path, monkeypatch, capsys):
    """Two steps with a checkpoint after each, data and output in the bucket; then step 2's checkpoint is removed
    (a run that died after step 1's) and the run resumed from step 1 to 2: losses, exported weights and config
    equal the local run's, the metrics rows are step 1's (read back from the bucket) and step 2's, step 1 is pruned
    (keep_checkpoints=1). The data file and tokenizer were read from local copies under DHP_CACHE; the images were
    fetched from the bucket as they were read (data.image_root=s3://...): the cache holds none."""
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
    assert not [p for p in (tmp_path / "cache").rglob("*.png")] and any((tmp_path / "cache").rglob("*.jsonl"))
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


def _open(path: str, demo_data, *extra: str):
    """The data set at ``path`` (a file, a URL, a mix), as a run opens it."""
    from dhp.config import load_config
    from dhp.inputs import dataset_spec, open_dataset, resolve_inputs

    run = resolve_inputs(load_config(None, [f"data.path={path}", f"data.tokenizer={demo_data.tokenizer}",
                                            "data.max_pixels=12544", "runtime.backend=local", *extra]))
    return open_dataset(dataset_spec(run, run.train_path))


@pytest.fixture
def fetches(monkeypatch):
    """Every medium opened from an object store: (URL, whole or header, the opening thread's name)."""
    from dhp import storage

    seen: list[tuple[str, bool, str]] = []
    init = storage.MediaFile.__init__

    def recording(self, ref, whole, timeout_s):
        import threading

        seen.append((ref.url, whole, threading.current_thread().name))
        init(self, ref, whole, timeout_s)

    monkeypatch.setattr(storage.MediaFile, "__init__", recording)
    return seen


def test_images_only_on_s3_are_fetched_by_the_loader_that_runs_ahead(s3, demo_data, tmp_path, monkeypatch, fetches):
    """data.path=s3://.../train.jsonl, its images only in the bucket (data.image_root unset: the data file's folder
    in the bucket). Indexing (data.validate=lazy, the default) reads each image's header by one range request and
    downloads none; the loader's background threads (data.loader_workers=2) fetch the images they decode; the
    samples equal the local set's, pixel for pixel, and the cache holds no image. data.validate=full fetches each
    image whole and finds the same index."""
    import torch

    from dhp.data.loader import AheadLoader

    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    url = f"{_upload(s3, demo_data)}/{demo_data.train.name}"
    local, remote = _open(str(demo_data.train), demo_data), _open(url, demo_data)
    assert str(remote.image_root) == f"s3://{BUCKET}/data" and remote.lengths() == local.lengths()
    images = {u for u, _, _ in fetches}
    assert len(fetches) == len(images) > 0 and not any(whole for _, whole, _ in fetches)  # one header read each
    fetches.clear()
    loader = AheadLoader(remote.get, workers=2)
    ids = list(range(0, len(remote), 5))
    loader.prefetch(0, ids)
    try:
        for i in ids:
            got, want = loader.take(i), local[i]
            assert torch.equal(got.input_ids, want.input_ids) and torch.equal(got.pixel_values, want.pixel_values)
    finally:
        loader.close()
    assert fetches and all(whole and thread.startswith("dhp-loader") for _, whole, thread in fetches)
    assert not [p for p in (tmp_path / "cache").rglob("*.png")]
    fetches.clear()
    full = _open(url, demo_data, "data.validate=full")
    assert full.lengths() == local.lengths() and {u for u, w, _ in fetches if w} == images


def _rows_with(demo_data, n: int, image: dict[int, str]) -> str:
    """The first ``n`` samples of the demo set as JSONL, sample k's image replaced by ``image[k]``."""
    rows = [json.loads(line) for line in demo_data.train.read_text().splitlines()[:n]]
    for k, path in image.items():
        rows[k]["image"] = path
    return "".join(json.dumps(r) + "\n" for r in rows)


def test_a_missing_image_on_s3_is_named_and_follows_on_error(s3, demo_data, tmp_path, monkeypatch):
    """A sample whose image is not in the bucket: data.on_error=raise names the file, the sample, the image's URL
    and the fix; skip drops that sample and keeps its report. An image whose server never answers is given up
    after data.media_timeout_s, named, and the index is not cached (the next start asks again)."""
    import socket

    from dhp.errors import DataError

    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    data = _upload(s3, demo_data)
    s3.pipe_file(f"{BUCKET}/data/missing.jsonl", _rows_with(demo_data, 4, {1: "images/gone.png"}).encode())
    missing = f"{data}/images/gone.png"
    with pytest.raises(DataError) as err:
        _open(f"{data}/missing.jsonl", demo_data, "data.on_error=raise")
    assert f"sample 1: image file {missing} does not exist" in str(err.value) and "data.on_error=skip" in str(err.value)
    skipped = _open(f"{data}/missing.jsonl", demo_data, "data.on_error=skip")
    assert len(skipped) == 3 and [i.index for i in skipped.skipped] == [1] and missing in skipped.skipped[0].message

    silent = socket.socket()  # accepts connections, never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(4)
    try:
        hung = f"http://127.0.0.1:{silent.getsockname()[1]}/x.png"
        s3.pipe_file(f"{BUCKET}/data/hung.jsonl", _rows_with(demo_data, 3, {1: hung}).encode())
        opened = _open(f"{data}/hung.jsonl", demo_data, "data.on_error=skip", "data.media_timeout_s=1")
    finally:
        silent.close()
    assert len(opened) == 2 and [i.index for i in opened.skipped] == [1]
    assert hung in opened.skipped[0].message and "not read within 1 s" in opened.skipped[0].message
    assert opened.index_dir is None  # (not stored: a failed request is not the sample's fault)


def test_a_mix_of_a_local_and_an_s3_source(s3, demo_data, tmp_path, monkeypatch):
    """data.path="LOCAL.jsonl:1,s3://.../train.jsonl:1,s3://.../video_tr*.jsonl:1": the bucket's sources (a file and
    a glob) read from their local copies, their images and video files from the bucket (relative to their folder
    there); every mixed sample equals its source's sample read locally."""
    import torch

    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    data = _upload(s3, demo_data)
    local = _open(str(demo_data.train), demo_data)
    clips = _open(str(demo_data.root / "video_train.jsonl"), demo_data)
    mix = _open(f"{demo_data.train}:1,{data}/{demo_data.train.name}:1,{data}/video_tr*.jsonl:0.1", demo_data)
    assert [str(ds.image_root) for ds in mix.parts] == [str(demo_data.root), data, data]
    assert [len(ds) for ds in mix.parts] == [len(local), len(local), len(clips)]
    picked = {}
    for i in range(len(mix)):
        picked.setdefault(mix.source_of(i), []).append(i)
    for s, ids in sorted(picked.items()):
        for i in ids[:2] + ids[-1:]:
            part, j = mix.locate(i)
            assert part is mix.parts[s]
            got, want = mix[i], (clips if s == 2 else local)[j]
            assert torch.equal(got.input_ids, want.input_ids)
            for name in ("pixel_values", "pixel_values_videos"):
                assert torch.equal(getattr(got, name), getattr(want, name)), (s, j, name)
    assert sorted(picked) == [0, 1, 2] and not [p for p in (tmp_path / "cache").rglob("*.mp4")]


def test_an_audio_clip_on_s3_reads_as_the_local_file(s3, tmp_path):
    """An audio clip in the bucket, opened as the data code opens media (a header read, a whole fetch): the same
    header (its path: the URL) and the same decoded samples as the local file."""
    import numpy as np
    import soundfile as sf

    from dhp.data.audio import load_audio, read_header
    from dhp.storage import UrlPath, open_media

    wave = np.sin(np.linspace(0, 400, 22050 * 3)).astype(np.float32)
    local = tmp_path / "tone.wav"
    sf.write(local, wave, 22050)
    s3.put_file(str(local), f"{BUCKET}/audio/tone.wav")
    url = UrlPath(f"s3://{BUCKET}/audio/tone.wav")
    head, want = read_header(open_media(url, whole=False)), read_header(local)
    assert head.path == str(url) and (head.sample_rate, head.channels, head.frames) == (
        want.sample_rate, want.channels, want.frames)
    np.testing.assert_array_equal(load_audio(open_media(url), 16000), load_audio(local, 16000))


def test_media_paths_under_a_url_root():
    """A record's media path under a URL data.image_root: relative paths join it (normalised), an absolute local
    path and a URL stay what they are, a storage fsspec does not know is a ValueError naming the URL."""
    from dhp.storage import UrlPath, media_ref

    root = UrlPath(f"s3://{BUCKET}/set")
    assert media_ref("images/../img/1.png", root) == UrlPath(f"s3://{BUCKET}/set/img/1.png")
    assert media_ref("/data/1.png", root) == Path("/data/1.png")
    assert media_ref("memory://other/2.png", root) == UrlPath("memory://other/2.png")
    assert media_ref(f"s3://{BUCKET}/x/3.png", Path("/local")) == UrlPath(f"s3://{BUCKET}/x/3.png")
    assert media_ref("4.png", Path("/local")) == Path("/local/4.png")
    with pytest.raises(ValueError, match="fsspec knows no 'nostore://' storage"):
        media_ref("nostore://b/5.png", root)


def test_a_media_file_reads_the_ranges_it_is_asked_for(s3):
    """A header read of a 300 KB object: the first 64 KiB by one request, a seek to the end asks its size, reads
    anywhere give the object's bytes, and reading it all takes a few growing ranges, not one request per block."""
    import os

    from dhp.storage import HEADER_BLOCK, UrlPath, open_media

    data = os.urandom(300_000)
    s3.pipe_file(f"{BUCKET}/blob/x.bin", data)
    f = open_media(UrlPath(f"s3://{BUCKET}/blob/x.bin"), whole=False)
    assert [(start, len(got)) for start, got in f.ranges] == [(0, HEADER_BLOCK)] and f.size is None
    assert f.read(10) == data[:10]
    f.seek(-5, 2)
    assert f.size == len(data) and f.read() == data[-5:]
    f.seek(70_000)
    assert f.read(100) == data[70_000:70_100]
    f.seek(0)
    assert f.read() == data and len(f.ranges) <= 4
    whole = open_media(UrlPath(f"s3://{BUCKET}/blob/x.bin"))
    assert len(whole.ranges) == 1 and whole.read() == data
