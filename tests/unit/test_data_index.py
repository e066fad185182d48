"""The data set's index: stored and read back equal, used by a second open, rebuilt when the file or a setting
changes, built over a process pool equal to the in-process build, and read by id equal to the full parse."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dhp.config import DataConfig
from dhp.data import index, llava
from dhp.data.llava import SFTDataset
from dhp.data.tokenizer import Tokenizer
from dhp.errors import DataError
from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor as VL

N_ROWS = 300


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "index"


@pytest.fixture()
def data(demo_data, tmp_path) -> Path:
    """N_ROWS samples (the demo's rows repeated), two of them bad: a missing image, a placeholder miscount."""
    rows = [json.loads(line) for line in demo_data.train.read_text().splitlines()]
    out = [dict(rows[k % len(rows)]) for k in range(N_ROWS)]
    out[5] = {**out[5], "image": "images/missing.png"}
    out[9] = {**out[9], "conversations": [{"from": "human", "value": "no tag"}, {"from": "gpt", "value": "1"}]}
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in out))
    return path


def _cfg(path: Path, demo_data, **kw) -> DataConfig:
    return DataConfig(path=str(path), tokenizer=str(demo_data.tokenizer), image_root=str(demo_data.root),
                      max_pixels=12544, on_error="skip", **kw)


def _open(cfg: DataConfig, demo_data, **kw) -> SFTDataset:
    tok = Tokenizer(demo_data.tokenizer)
    return SFTDataset(cfg, tok, processor=VL(cfg, tok), **kw)


def _count_probes(monkeypatch) -> list[int]:
    calls = [0]
    real = llava._Checker._probe

    def counted(self, kind, source):
        calls[0] += 1
        return real(self, kind, source)

    monkeypatch.setattr(llava._Checker, "_probe", counted)
    return calls


def _same(a: SFTDataset, b: SFTDataset, ids: range | list[int]) -> None:
    assert len(a) == len(b) and a.lengths() == b.lengths()
    assert [str(i) for i in a.skipped] == [str(i) for i in b.skipped]
    for i in ids:
        x, y = a[i], b[i]
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.labels, y.labels)
        assert torch.equal(x.pixel_values, y.pixel_values) and a.info(i) == b.info(i)


def test_index_round_trips_and_a_worker_reading_by_id_gets_the_full_parse(data, demo_data, cache):
    cfg = _cfg(data, demo_data)
    driver = _open(cfg, demo_data)
    assert driver.index_dir is not None and driver.index_dir.parent == cache
    assert len(driver) == N_ROWS - 2 and [i.index for i in driver.skipped] == [5, 9]
    stored = index.load(driver.index_dir)
    for name in ("status", "tokens", "kinds", "meta", "meta_offsets", "spans"):
        assert np.array_equal(getattr(stored, name), getattr(driver.index, name)), name
    assert isinstance(stored.tokens, np.memmap)  # mapped, not read
    assert stored.issues == driver.index.issues and stored.fingerprint == driver.index.fingerprint
    assert int(stored.tokens[5]) == -1 and stored.status.tolist().count(index.BAD) == 2
    # the full parse, in memory, with no index stored: the reference
    full = _open(replace(cfg, index_cache=False), demo_data)
    assert full.index_dir is None
    worker = _open(cfg, demo_data, index_dir=driver.index_dir)
    _same(worker, full, [0, 1, 4, 5, 150, len(full) - 1])
    handed = _open(cfg, demo_data, validated=full.validation)  # the Python-object hand-over still works
    _same(handed, full, [0, 7])


def test_a_second_open_uses_the_cache_and_a_change_rebuilds_it(data, demo_data, cache, monkeypatch):
    cfg = _cfg(data, demo_data)
    first = _open(cfg, demo_data)
    probes = _count_probes(monkeypatch)
    again = _open(cfg, demo_data)
    assert probes[0] == 0 and again.index_dir == first.index_dir and again.lengths() == first.lengths()

    smaller = _open(replace(cfg, max_pixels=56 * 56), demo_data)  # a setting that changes token counts
    assert probes[0] > 0 and smaller.index_dir != first.index_dir
    assert sum(smaller.lengths()) < sum(first.lengths())
    _open(replace(cfg, loader_workers=0, mix_seed=3), demo_data)  # settings that change nothing found
    assert len(list(cache.iterdir())) == 2

    probes[0] = 0
    text = data.read_text().splitlines()
    data.write_text("\n".join(text[:-10]) + "\n")  # the file changed
    shorter = _open(cfg, demo_data)
    assert probes[0] > 0 and len(shorter) == len(first) - 10 and shorter.index_dir != first.index_dir
    with pytest.raises(DataError, match="changed since it was validated"):
        _open(cfg, demo_data, index_dir=first.index_dir)  # a worker handed the old index refuses it


def test_the_pool_builds_the_same_index(data, demo_data, monkeypatch):
    """Over 2 spawned processes in runs of 64 records: the same columns and issues as one process."""
    monkeypatch.setattr(llava, "POOL_MIN_RECORDS", 0)
    monkeypatch.setattr(llava, "CHUNK_RECORDS", 64)
    pooled = _open(_cfg(data, demo_data, index_workers=2, index_cache=False), demo_data)
    inline = _open(_cfg(data, demo_data, index_workers=1, index_cache=False), demo_data)
    for name in ("status", "tokens", "kinds", "meta_offsets", "meta", "spans"):
        assert np.array_equal(getattr(pooled.index, name), getattr(inline.index, name)), name
    assert pooled.index.issues == inline.index.issues and len(pooled.index.issues) == 2


def test_a_damaged_or_foreign_index_is_rebuilt(data, demo_data, monkeypatch):
    cfg = _cfg(data, demo_data)
    first = _open(cfg, demo_data)
    (first.index_dir / "tokens.npy").write_bytes(b"garbage")
    manifest = json.loads((first.index_dir / "manifest.json").read_text())
    assert manifest["records"] == N_ROWS and manifest["settings"]["max_pixels"] == 12544
    probes = _count_probes(monkeypatch)
    again = _open(cfg, demo_data)
    assert probes[0] > 0 and again.lengths() == first.lengths()


def test_the_planner_costs_are_kept_beside_the_index(data, demo_data, monkeypatch):
    """A second start reads each sample's module costs back (equal); another model config computes them again."""
    from dhp import inputs as inputs_mod
    from dhp.config import load_config

    over = [f"data.path={data}", f"data.tokenizer={demo_data.tokenizer}", f"data.image_root={demo_data.root}",
            "data.max_pixels=12544", "data.on_error=skip", "runtime.backend=local"]
    run = inputs_mod.resolve_inputs(load_config(None, over))
    ds = inputs_mod.open_dataset(inputs_mod.dataset_spec(run, run.train_path))
    first = inputs_mod.module_costs(run.family, run.model_cfg, ds)
    assert len(list(ds.index_dir.glob("costs-*.npz"))) == 1
    computed = []
    real = inputs_mod._compute_costs
    monkeypatch.setattr(inputs_mod, "_compute_costs", lambda *a: computed.append(1) or real(*a))
    assert inputs_mod.module_costs(run.family, run.model_cfg, ds) == first and not computed
    other = inputs_mod.resolve_inputs(load_config(None, [*over, "model.preset=3b"]))
    costs = inputs_mod.module_costs(other.family, other.model_cfg, ds)
    assert computed and costs != first and len(list(ds.index_dir.glob("costs-*.npz"))) == 2


def test_the_per_sample_flops_are_kept_beside_the_index(data, demo_data, monkeypatch):
    """The MFU's per-sample FLOPs equal ``dhp.observe.flops.sample_flops`` over every sample's info (a trained and a
    frozen vision encoder), and a second start reads them back instead of visiting every sample."""
    from dhp import inputs as inputs_mod
    from dhp.config import load_config
    from dhp.observe.flops import sample_flops

    over = [f"data.path={data}", f"data.tokenizer={demo_data.tokenizer}", f"data.image_root={demo_data.root}",
            "data.max_pixels=12544", "data.on_error=skip", "runtime.backend=local"]
    run = inputs_mod.resolve_inputs(load_config(None, over))
    ds = inputs_mod.open_dataset(inputs_mod.dataset_spec(run, run.train_path))
    infos = [ds.info(i) for i in range(len(ds))]
    kept = {t: inputs_mod.sample_flops(run.family, run.model_cfg, ds, {"vision": t}) for t in (True, False)}
    for t, flops in kept.items():
        assert flops == sample_flops(run.family, run.model_cfg, infos, {"vision": t})
    assert kept[True]["vision"] != kept[False]["vision"] and kept[True]["text"] == kept[False]["text"]
    monkeypatch.setattr(inputs_mod, "_compute_flops", lambda *a: pytest.fail("computed again"))
    assert inputs_mod.sample_flops(run.family, run.model_cfg, ds, {"vision": True}) == kept[True]
    assert len(list(ds.index_dir.glob("flops-*.npz"))) == 1


def test_a_node_without_the_drivers_index_checks_its_own_against_the_digest(data, demo_data, tmp_path):
    cfg = _cfg(data, demo_data)
    driver = _open(cfg, demo_data)
    elsewhere = str(tmp_path / "not-on-this-node")
    worker = _open(cfg, demo_data, index_dir=elsewhere, index_digest=driver.index.digest())
    assert worker.lengths() == driver.lengths()
    with pytest.raises(DataError, match="not the file the driver validated"):
        _open(replace(cfg, max_pixels=56 * 56), demo_data, index_dir=elsewhere, index_digest=driver.index.digest())
