"""What a new user meets before training starts: GPUs by default on the Ray backend (decided from the cluster's
resources, faked here), the start line naming every group's device and backend, `dhp bench` fitted to the
machine's CPUs, the video demo making its own data, a Hub id told how to download, and data errors in the
terms of the sample's own form."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dhp.config import ConfigError, ModelError, load_config
from dhp.runtime.placement import LayoutError, decide_gpus_per_worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("placement", "sizes", "gpus", "expected"), [
    ("disaggregated", {"vision": 1, "text": 1}, 0, 0.0),  # no GPU: CPU and gloo
    ("disaggregated", {"vision": 2, "text": 2}, 8, 1.0),  # a GPU per worker
    ("disaggregated", {"vision": 2, "text": 2}, 4, 1.0),
    ("collocated", {"vision": 2, "text": 2}, 2, 1.0),  # rank i of both groups share bundle i's GPU
    ("disaggregated", {"vision": 1, "text": 1}, 1, 0.5),  # one-rank groups may share a device
    ("disaggregated", {"vision": 1, "audio": 1, "text": 1}, 1, 1 / 3),
])
def test_auto_gpus_follow_the_cluster(placement, sizes, gpus, expected):
    assert decide_gpus_per_worker("auto", placement, sizes, gpus) == pytest.approx(expected)


def test_auto_gpus_refuse_a_layout_the_gpus_cannot_hold():
    with pytest.raises(LayoutError, match=r"needs 4 GPUs, one per worker, but the Ray cluster has 2; .*"
                                          r"runtime.gpus_per_worker=0"):
        decide_gpus_per_worker("auto", "disaggregated", {"vision": 2, "text": 2}, 2)
    assert decide_gpus_per_worker(0.25, "disaggregated", {"vision": 2, "text": 2}, 8) == 0.25  # as given


def _inputs(demo_data, *over):
    from dhp.inputs import resolve_inputs

    return resolve_inputs(load_config(None, [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}",
                                             "runtime.backend=ray", *over]))


def test_the_ray_backend_takes_the_gpus_and_the_start_line_says_so(demo_data, monkeypatch):
    from dhp.backends import ray_backend
    from dhp.runtime import cluster
    from dhp.train import groups_text

    inputs = _inputs(demo_data, "runtime.placement=disaggregated", "vision.parallel.sp=2", "text.parallel.tp=2")
    assert inputs.cfg.runtime.gpus_per_worker == "auto"  # the default
    monkeypatch.setattr(cluster, "cluster_gpus", lambda address=None: 4.0)  # a fake cluster of 4 GPUs
    on_gpus = ray_backend.resolve_worker_gpus(inputs)
    assert on_gpus.cfg.runtime.gpus_per_worker == 1.0
    assert groups_text(on_gpus.cfg, ["vision", "text"]) == (
        "vision sp2 on cuda (nccl, 1 GPU per worker), text tp2 on cuda (nccl, 1 GPU per worker); disaggregated")
    monkeypatch.setattr(cluster, "cluster_gpus", lambda address=None: 0.0)
    on_cpus = ray_backend.resolve_worker_gpus(inputs)
    assert groups_text(on_cpus.cfg, ["vision", "text"]).startswith("vision sp2 on cpu (gloo, 1 CPU per worker)")
    monkeypatch.setattr(cluster, "cluster_gpus", lambda address=None: 2.0)
    with pytest.raises(ConfigError, match="runtime.gpus_per_worker=auto: the layout"):
        ray_backend.resolve_worker_gpus(inputs)
    chosen = _inputs(demo_data, "runtime.gpus_per_worker=0")
    assert ray_backend.resolve_worker_gpus(chosen).cfg.runtime.gpus_per_worker == 0.0  # a number is kept


def test_gpus_per_worker_values():
    assert load_config(None, ["runtime.gpus_per_worker=0.5"], check_files=False).runtime.gpus_per_worker == 0.5
    with pytest.raises(ConfigError, match="runtime.gpus_per_worker"):
        load_config(None, ["runtime.gpus_per_worker=many"], check_files=False)


def test_bench_fits_the_machine_before_ray_starts(capsys):
    from dhp.bench import default_layouts, machine_share
    from dhp.config import load_config

    layouts = default_layouts(4)
    demo = ROOT / "dhp" / "configs" / "demo.yaml"  # cpus_per_worker: 1, as `dhp bench` with no argument reads

    def share(overrides: list[str], cpus: int) -> float | None:  # as run_bench reads the layouts, files unchecked
        base = load_config(demo, overrides, check_files=False)
        cfgs = [load_config(demo, [*overrides, *layout], check_files=False) for layout in layouts.values()]
        return machine_share(base, cfgs, overrides, cpus)

    assert share([], cpus=2) == 0.5
    assert "4 workers per layout on this machine's 2 CPUs: runtime.cpus_per_worker=0.5" in capsys.readouterr().out
    assert share([], cpus=8) is None  # fits as is
    assert share(["runtime.cpus_per_worker=2"], cpus=2) is None  # the user's choice is kept


def test_video_demo_makes_its_own_data(tmp_path, monkeypatch):
    from dhp.data import demo
    from dhp.inputs import resolve_inputs

    made = demo.make_demo_dataset
    monkeypatch.setenv("DHP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(demo, "make_demo_dataset", lambda out, seed=0: made(out, seed=seed, n_train=16, n_eval=4))
    inputs = resolve_inputs(load_config(ROOT / "configs" / "video_demo.yaml"))
    root = tmp_path / "cache" / "demo"
    assert (inputs.train_path, inputs.eval_path, inputs.tokenizer_dir) == (
        root / "video_train.jsonl", root / "video_eval.jsonl", root / "tokenizer")
    assert json.loads(inputs.train_path.read_text().splitlines()[0])["video"]


def test_a_hub_id_is_told_how_to_download():
    with pytest.raises(ModelError, match=r"looks like a Hugging Face Hub id: dhp reads local directories only; "
                                         r"download it first \(`huggingface-cli download Qwen/Qwen2.5-VL-3B-Instruct "):
        load_config(None, ["model.hf_path=Qwen/Qwen2.5-VL-3B-Instruct"])


def test_image_parts_are_named_as_parts_and_numbering_is_stated(demo_data, tmp_path):
    from dhp.config import DataConfig
    from dhp.data.llava import SFTDataset
    from dhp.data.tokenizer import Tokenizer
    from dhp.errors import DataError
    from dhp.models.qwen2_5_vl.processor import Qwen2_5_VLProcessor

    good = json.loads(demo_data.train.read_text().splitlines()[0])
    bare = {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "which?"}]},
                         {"role": "assistant", "content": "3"}]}
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bare) + "\n")
    with pytest.raises(DataError) as e:
        cfg, tok = DataConfig(path=str(path), image_root=str(demo_data.root)), Tokenizer(demo_data.tokenizer)
        SFTDataset(cfg, tok, processor=Qwen2_5_VLProcessor(cfg, tok))
    head, *lines = str(e.value).splitlines()
    assert "(samples are numbered from 0, in file order)" in head
    (line,) = lines
    assert line.startswith(f"{path} sample 1: 1 <image> placeholder but 0 images: the content has 1 "
                           '{"type": "image"} part')
    assert "list exactly one file per bare part in 'images'" in line


def test_plan_says_it_is_at_work(capsys):
    """`dhp plan` of a large model measures for minutes: a line when it starts, one every ``every_s``, its time."""
    import time

    from dhp.plan.command import Heartbeat

    with Heartbeat("7b on 8 GPUs", every_s=0.05):
        time.sleep(0.2)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "dhp: plan: 7b on 8 GPUs; this can take minutes"
    assert any(line.startswith("dhp: plan: still measuring, ") for line in err[1:-1])
    assert err[-1].startswith("dhp: plan: measured in ")


def test_bench_layouts_for_two_workers_and_any_count_of_custom_ones():
    """`dhp bench --workers 2` (a two-device machine): the three default layouts collocated at degree 2, not
    refused; a custom layout needs no default (any worker count); an odd count's defaults are refused."""
    from dhp.bench import default_layouts, parse_layouts
    from dhp.config import ConfigError

    two = default_layouts(2)
    assert all("runtime.placement=collocated" in v for v in two.values())
    assert {"vision.parallel.sp=2", "text.parallel.tp=2"} <= set(two["dhp"])
    assert {"vision.parallel.tp=2", "text.parallel.tp=2"} <= set(two["uniform_tp"])
    assert {"vision.parallel.dp=2", "vision.parallel.zero=3", "text.parallel.dp=2", "text.parallel.zero=3"} <= set(
        two["fsdp"])
    four = default_layouts(4)
    assert all("runtime.placement=disaggregated" in v for v in four.values())
    assert {"vision.parallel.sp=2", "text.parallel.tp=2"} <= set(four["dhp"])
    custom = parse_layouts("mine=vision.parallel.dp=3;text.parallel.dp=3", 3)
    assert custom == {"mine": ["vision.parallel.dp=3", "text.parallel.dp=3"]}
    with pytest.raises(ConfigError, match="--workers 3: the default layouts need an even number"):
        parse_layouts("dhp,mine=vision.parallel.dp=3", 3)
    with pytest.raises(ConfigError, match="unknown layout 'dhpp'; known: dhp, uniform_tp, fsdp"):
        parse_layouts("dhpp", 4)
