"""Parquet, Arrow files and HF ``datasets`` (save_to_disk) data sets, with images as paths or inline bytes, in
LLaVA-OneVision's and LLaMA-Factory's column names: the same tokens, labels and pixels as the equivalent JSONL, and
the same training losses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dhp.config import DataConfig
from dhp.data.llava import SFTDataset
from dhp.data.tokenizer import Tokenizer
from dhp.errors import DataError
from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor as VL

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

N = 24


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def rows(demo_data) -> list[dict]:
    return [json.loads(line) for line in demo_data.train.read_text().splitlines()[:N]]


def _open(path: Path, demo_data, **kw) -> SFTDataset:
    cfg = DataConfig(path=str(path), tokenizer=str(demo_data.tokenizer), image_root=str(demo_data.root),
                     max_pixels=12544, **kw)
    tok = Tokenizer(demo_data.tokenizer)
    return SFTDataset(cfg, tok, processor=VL(cfg, tok))


def _images(row: dict) -> list[str]:
    image = row.get("image")
    return [] if image is None else [image] if isinstance(image, str) else list(image)


def _struct(path: str, demo_data, inline: bool) -> dict:
    """The cell HF ``datasets`` writes for an Image feature: its bytes (inline) or only its path."""
    return {"bytes": (demo_data.root / path).read_bytes() if inline else None, "path": path}


def _onevision(rows: list[dict], demo_data, inline: bool) -> dict[str, list]:
    """LLaVA-OneVision's columns: ``conversations`` (from/value) and one ``image`` struct per sample."""
    return {"id": [r["id"] for r in rows], "conversations": [r["conversations"] for r in rows],
            "image": [_struct(_images(r)[0], demo_data, inline) for r in rows]}


def _llamafactory(rows: list[dict], demo_data, inline: bool) -> dict[str, list]:
    """LLaMA-Factory's converted sets: ``messages`` (role/content) with ``<image>`` tags and an ``images`` list."""
    role = {"human": "user", "gpt": "assistant"}
    return {"messages": [[{"role": role[t["from"]], "content": t["value"]} for t in r["conversations"]] for r in rows],
            "images": [[_struct(p, demo_data, inline) if inline else p for p in _images(r)] for r in rows]}


def _one_image(rows: list[dict]) -> list[dict]:
    return [r for r in rows if len(_images(r)) == 1]


def _same(a: SFTDataset, b: SFTDataset) -> None:
    assert len(a) == len(b) > 0 and a.lengths() == b.lengths()
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.pixel_values, y.pixel_values) and torch.equal(x.image_grid_thw, y.image_grid_thw)
        assert torch.equal(x.position_ids, y.position_ids)
        assert a.info(i) == b.info(i)


def _jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _save_to_disk(columns: dict[str, list], directory: Path, shards: int = 2) -> Path:
    """A directory in the layout HF ``datasets`` ``Dataset.save_to_disk`` writes: Arrow stream shards and
    ``state.json`` naming them (written with pyarrow: the reader needs nothing else)."""
    directory.mkdir(parents=True)
    table = pa.table(columns)
    per = -(-table.num_rows // shards)
    files = []
    for s in range(shards):
        name = f"data-{s:05d}-of-{shards:05d}.arrow"
        with pa.OSFile(str(directory / name), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(s * per, per))
        files.append({"filename": name})
    (directory / "state.json").write_text(json.dumps({"_data_files": files, "_split": "train"}))
    (directory / "dataset_info.json").write_text("{}")
    return directory


@pytest.mark.parametrize("inline", [False, True], ids=["paths", "inline"])
def test_parquet_onevision_columns_equal_jsonl(rows, demo_data, tmp_path, inline):
    one = _one_image(rows)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table(_onevision(one, demo_data, inline)), path, row_group_size=5)  # several row groups
    _same(_open(path, demo_data), _open(_jsonl(one, tmp_path / "train.jsonl"), demo_data))


def test_the_index_build_reads_each_row_group_once(rows, demo_data, tmp_path, monkeypatch):
    """Index tasks are runs of whole row groups (a larger group cut in runs): a group is read by one task, once,
    and the index equals the JSONL one."""
    from dhp.data import llava
    from dhp.data.sources import Parquet

    one = _one_image(rows)
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table(_onevision(one, demo_data, inline=True)), path, row_group_size=5)
    runs = Parquet(path).ranges(7)
    assert [k for lo, hi in runs for k in range(lo, hi)] == list(range(len(one))) and len(one) > 10
    assert all(hi - lo <= 7 and hi % 5 in (0, len(one) % 5) for lo, hi in runs)  # whole groups of 5
    assert Parquet(path).ranges(10)[0] == (0, 10) and Parquet(path).ranges(3)[:2] == [(0, 3), (3, 5)]
    reads = []
    real = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, g, *a, **k: reads.append(g) or real(
        self, g, *a, **k))
    monkeypatch.setattr(llava, "CHUNK_RECORDS", 7)  # (fixed runs of 7 would read most groups twice)
    built = _open(path, demo_data)
    assert sorted(reads) == list(range(-(-len(one) // 5)))
    _same(built, _open(_jsonl(one, tmp_path / "train.jsonl"), demo_data))


@pytest.mark.parametrize("inline", [False, True], ids=["paths", "inline"])
def test_hf_save_to_disk_llamafactory_columns_equal_jsonl(rows, demo_data, tmp_path, inline):
    directory = _save_to_disk(_llamafactory(rows, demo_data, inline), tmp_path / "hf")
    _same(_open(directory, demo_data), _open(_jsonl(rows, tmp_path / "train.jsonl"), demo_data))


@pytest.mark.parametrize("form", ["stream", "file"])
def test_one_arrow_file_equals_jsonl(rows, demo_data, tmp_path, form):
    """A single Arrow file given as data.path: an HF ``datasets`` shard or cache file (the IPC stream format) or
    Feather v2 (the IPC file format). It used to be read as JSONL, and every binary "line" was a problem. The
    index of the same bytes read as JSONL is not reused (the reader is part of its key)."""
    table = pa.table(_llamafactory(rows, demo_data, inline=True))
    path = tmp_path / "data-00000-of-00001.arrow"
    with pa.OSFile(str(path), "wb") as sink:
        writer = pa.ipc.new_stream(sink, table.schema) if form == "stream" else pa.ipc.new_file(sink, table.schema)
        with writer:
            writer.write_table(table)
    jsonl = _open(_jsonl(rows, tmp_path / "train.jsonl"), demo_data)
    _same(_open(path, demo_data), jsonl)
    (tmp_path / "bad.arrow").write_bytes(b"not arrow " * 10)
    with pytest.raises(DataError, match=r"bad.arrow: not an Arrow IPC stream or file"):
        _open(tmp_path / "bad.arrow", demo_data)


def test_the_index_key_holds_the_reader(rows, demo_data, tmp_path):
    """The same bytes read as another form make another index: a file renamed from .jsonl to .arrow (or read
    before a form was known) does not get the other form's cached index."""
    from dhp.data.llava import index_key

    ds = _open(_jsonl(rows, tmp_path / "train.jsonl"), demo_data)
    key, manifest = index_key(ds, "fp")
    assert manifest["form"] == "json"
    (tmp_path / "train.arrow").write_bytes(b"")
    ds.file = tmp_path / "train.arrow"
    assert index_key(ds, "fp")[1]["form"] == "arrow" and index_key(ds, "fp")[0] != key


def test_a_bad_inline_image_names_the_sample_and_the_file(rows, demo_data, tmp_path):
    columns = _onevision(_one_image(rows), demo_data, inline=True)
    columns["image"][3] = {"bytes": b"not a png", "path": "broken.png"}
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table(columns), path)
    with pytest.raises(DataError, match=r"train.parquet: 1 problem\(s\) in 1 sample") as e:
        _open(path, demo_data)
    assert "sample 3: image broken.png (inline bytes) is unreadable" in str(e.value)
    assert "replace the cell's bytes" in str(e.value) and " at 0x" not in str(e.value)  # PIL's repr of the buffer
    ds = _open(path, demo_data, on_error="skip")
    assert len(ds) == len(columns["id"]) - 1 and [i.index for i in ds.skipped] == [3]


def test_a_split_directory_says_which_split(tmp_path, demo_data):
    (tmp_path / "dd").mkdir()
    (tmp_path / "dd" / "dataset_dict.json").write_text(json.dumps({"splits": ["train", "test"]}))
    with pytest.raises(DataError, match="holds several splits .*dd/train"):
        _open(tmp_path / "dd", demo_data)


def test_training_on_parquet_equals_training_on_jsonl(demo_overrides, demo_data, tmp_path):
    """The demo set as parquet with inline images trains to the same losses and weights as its JSONL (local
    backend, a few steps)."""
    from tests.unit.test_trainer import run_steps

    all_rows = [json.loads(line) for line in demo_data.train.read_text().splitlines()]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table(_llamafactory(all_rows, demo_data, inline=True)), path, row_group_size=16)
    base = [o for o in demo_overrides if not o.startswith("data.path=")] + ["train.optimizer=sgd", "train.lr=0.05"]
    ref_losses, ref_state, *_ = run_steps(base + [f"data.path={demo_data.train}"], steps=2)
    losses, state, *_ = run_steps(base + [f"data.path={path}", f"data.image_root={demo_data.root}"], steps=2)
    assert losses == ref_losses
    for k, v in ref_state.items():
        assert torch.equal(state[k], v), k


def test_json_list_with_non_ascii_text_reads_each_sample_by_its_byte_span(rows, demo_data, tmp_path):
    """Byte spans, not character offsets: a JSON list whose text holds multi-byte characters."""
    changed = [replace_text(r, f"Zahl {i} — ü 数字") for i, r in enumerate(rows)]
    path = tmp_path / "train.json"
    path.write_text(json.dumps(changed, ensure_ascii=False, indent=1))
    ds = _open(path, demo_data)
    assert len(ds) == len(rows)
    for i in (0, 7, len(rows) - 1):
        assert ds.record(i).messages[-1]["content"] == f"Zahl {i} — ü 数字"


def replace_text(row: dict, answer: str) -> dict:
    turns = [dict(t) for t in row["conversations"]]
    turns[-1]["value"] = answer
    return {**row, "conversations": turns}



# ---- several sources as one data set, with weights --------------------------------------------------------------


def _mix(value: str, demo_data, **kw):
    from dhp.inputs import DatasetSpec, open_dataset

    cfg = DataConfig(path=value, tokenizer=str(demo_data.tokenizer), image_root=str(demo_data.root),
                     max_pixels=12544, **kw)
    tok = Tokenizer(demo_data.tokenizer)
    return open_dataset(DatasetSpec(cfg, str(demo_data.tokenizer), value, VL(cfg, tok), "qwen2_5_vl"))


def test_weighted_sources_give_their_proportions_for_a_seed(rows, demo_data, tmp_path):
    """10 samples at weight 0.75 and 14 (a glob of a JSONL and a parquet file) at 0.25: 24 mixed samples, 18 of
    the first (each of its samples 1.8 times: once, then 8 of them again) and 6 of the second (a subset); the
    same for a seed, another subset for another seed; each mixed sample is its file's sample."""
    a = _jsonl(rows[:10], tmp_path / "a.jsonl")
    (tmp_path / "b").mkdir()
    _jsonl(rows[10:17], tmp_path / "b" / "b1.jsonl")
    pq.write_table(pa.table(_llamafactory(rows[17:], demo_data, inline=True)), tmp_path / "b" / "b2.parquet")
    value = f"{a}:0.75,{tmp_path}/b/*:0.25"
    mix = _mix(value, demo_data)
    sources = [mix.source_of(i) for i in range(len(mix))]
    assert len(mix) == 24 and sources.count(0) == 18 and sources.count(1) == 6
    assert mix.describe() == [f"source 0: {a}: weight 0.75, 1 file(s), 10 good samples, 18 in the mix",
                              f"source 1: {tmp_path}/b/*: weight 0.25, 2 file(s), 14 good samples, 6 in the mix"]
    firsts = [mix.locate(i)[1] for i in range(len(mix)) if sources[i] == 0]
    assert sorted(set(firsts)) == list(range(10)) and sorted(firsts.count(j) for j in range(10)) == [1] * 2 + [2] * 8
    seconds = [(mix.locate(i)[0].file.name, mix.locate(i)[1]) for i in range(len(mix)) if sources[i] == 1]
    assert len(set(seconds)) == 6
    again, other = _mix(value, demo_data), _mix(value, demo_data, mix_seed=1)
    assert [again.locate(i)[1] for i in range(24)] == [mix.locate(i)[1] for i in range(24)]
    assert [(other.locate(i)[0].file.name, other.locate(i)[1]) for i in range(24) if other.source_of(i) == 1] \
        != seconds
    assert mix.lengths() == [mix.info(i).num_tokens for i in range(len(mix))]
    for i in (0, 17, 18, 23):
        ds, j = mix.locate(i)
        assert mix[i].index == mix.info(i).index == i and torch.equal(mix[i].input_ids, ds[j].input_ids)


def test_sources_without_weights_are_concatenated_and_bad_lists_are_named(rows, demo_data, tmp_path):
    from dhp.data.mix import parse_sources

    a, b = _jsonl(rows[:5], tmp_path / "a.jsonl"), _jsonl(rows[5:8], tmp_path / "b.jsonl")
    mix = _mix(f"{a},{b}", demo_data)
    assert [mix.locate(i)[1] for i in range(len(mix))] == [0, 1, 2, 3, 4, 0, 1, 2]
    with pytest.raises(DataError, match="some sources have a weight and some not"):
        parse_sources(f"{a}:0.5,{b}")
    with pytest.raises(DataError, match="matches no file"):
        _mix(f"{a}:1,{tmp_path}/none/*.jsonl:1", demo_data)


def test_a_resume_checks_a_directory_or_a_mix_by_its_files_fingerprints(rows, demo_data, tmp_path):
    """What a checkpoint records of data that is no single file: equal for the same files, another value once a
    file changed (so a resume refuses other data)."""
    from dhp.inputs import indexed_fingerprint

    directory = _save_to_disk(_llamafactory(rows, demo_data, inline=False), tmp_path / "hf")
    first = indexed_fingerprint(_open(directory, demo_data), [])
    assert indexed_fingerprint(_open(directory, demo_data), []) == first
    a = _jsonl(rows[:5], tmp_path / "a.jsonl")
    mixed = indexed_fingerprint(_mix(f"{a}:1,{directory}:1", demo_data), [])
    assert mixed != first
    _save_to_disk(_llamafactory(rows[:-1], demo_data, inline=False), tmp_path / "hf2")
    (directory / "data-00001-of-00002.arrow").write_bytes((tmp_path / "hf2" / "data-00001-of-00002.arrow").read_bytes())
    assert indexed_fingerprint(_open(directory, demo_data), []) != first
