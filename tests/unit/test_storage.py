"""The shared-output probe (dhp.storage) and the placement plan's per-group resources and fit check, without Ray."""

from __future__ import annotations

from pathlib import Path

import pytest

from dhp.errors import ConfigError
from dhp.runtime.cluster import worker_env
from dhp.runtime.placement import (
    GroupResources,
    LayoutError,
    NodeInfo,
    check_fits,
    label_matches,
    plan_placement,
)
from dhp.storage import PROBE_DIR, check_shared_dir, check_writable


def _writer(roots: dict[str, Path], out: Path):
    """A probe writer as a node would run it: node n sees ``out`` at ``roots[n]`` (its own disk, or the same)."""
    def write(paths: dict[str, str], token: str) -> None:
        for node, path in paths.items():
            mine = roots[node] / Path(path).relative_to(out.absolute())
            mine.parent.mkdir(parents=True, exist_ok=True)
            mine.write_text(token)
    return write


def test_a_shared_output_dir_passes_and_leaves_nothing(tmp_path):
    out = tmp_path / "run"
    check_shared_dir(out, ["a", "b", "c"], _writer({n: out for n in "abc"}, out))
    assert not (out / PROBE_DIR).exists()


def test_an_output_dir_local_to_each_node_is_refused_naming_the_nodes(tmp_path):
    out = tmp_path / "run"
    roots = {"a": out, "b": tmp_path / "disk_of_b", "c": tmp_path / "disk_of_c"}
    with pytest.raises(ConfigError) as err:
        check_shared_dir(out, list(roots), _writer(roots, out), describe=lambda n: f"node-{n}")
    text = str(err.value)
    assert "node-b" in text and "node-c" in text and "node-a" not in text
    assert f"output.dir={out}" in text and "every node mounts" in text


NODES = [NodeInfo("v" * 8, "10.0.0.1", {"CPU": 4.0, "GPU": 2.0, "accelerator_type:L40S": 1.0}, {"pool": "vision"}),
         NodeInfo("t" * 8, "10.0.0.2", {"CPU": 8.0, "GPU": 4.0, "accelerator_type:H100": 1.0}, {"pool": "text"})]
TOTAL = {"CPU": 12.0, "GPU": 6.0}


def _plan(placement: str, sizes: dict[str, int], **res: GroupResources):
    return plan_placement(placement, sizes, 1.0, 1.0, res)


def test_disaggregated_groups_get_their_own_pools_labels_and_bundles():
    plan = _plan("disaggregated", {"vision": 2, "text": 4},
                 vision=GroupResources(2.0, 1.0, "L40S", {"pool": "vision"}, {"slot": 1.0}, "pack"),
                 text=GroupResources(1.0, 1.0, "H100", {"pool": "text"}, {}, "spread"))
    assert plan.pools == {"vision": ("pack", [0, 1]), "text": ("spread", [2, 3, 4, 5])}
    assert plan.bundles[0] == {"CPU": 2.0, "GPU": 1.0, "slot": 1.0, "accelerator_type:L40S": 0.001}
    assert plan.bundles[2] == {"CPU": 1.0, "GPU": 1.0, "accelerator_type:H100": 0.001}
    assert plan.labels_of(1) == {"pool": "vision"} and plan.labels_of(5) == {"pool": "text"}
    assert [plan.local_index(("text", r)) for r in range(4)] == [0, 1, 2, 3]
    with pytest.raises(LayoutError, match="slot"):  # the custom resource: no node has it
        check_fits(plan, TOTAL, nodes=NODES)
    fits = _plan("disaggregated", {"vision": 2, "text": 4},
                 vision=GroupResources(2.0, 1.0, "L40S", {"pool": "vision"}),
                 text=GroupResources(1.0, 1.0, "H100", {"pool": "text"}, strategy="spread"))
    check_fits(fits, TOTAL, nodes=NODES)


@pytest.mark.parametrize(("res", "words"), [
    ({"vision": GroupResources(1.0, 1.0, label_selector={"pool": "audio"})}, ["vision", "pool: audio", "pool=text"]),
    ({"text": GroupResources(1.0, 1.0, "A100", {"pool": "text"})}, ["text", "accelerator type A100"]),
    ({"text": GroupResources(1.0, 1.0, None, {"pool": "vision"})}, ["text", "do not all fit", "beside vision"]),
])
def test_a_group_that_does_not_fit_is_named(res, words):
    groups = {"vision": GroupResources(1.0, 1.0, None, {"pool": "vision"}), **res}
    plan = _plan("disaggregated", {"vision": 2, "text": 2}, **groups)
    with pytest.raises(LayoutError) as err:
        check_fits(plan, TOTAL, nodes=NODES)
    for w in words:
        assert w in str(err.value), (w, str(err.value))


def test_collocated_groups_share_bundles_and_must_agree_on_their_nodes():
    plan = _plan("collocated", {"vision": 1, "text": 2},
                 vision=GroupResources(1.0, 1.0, "H100", {"pool": "text"}, {"slot": 1.0}),
                 text=GroupResources(2.0, 1.0, None, {"pool": "text"}, {"slot": 2.0}))
    assert plan.bundles == [{"CPU": 3.0, "slot": 3.0, "accelerator_type:H100": 0.001, "GPU": 1.0},
                            {"CPU": 2.0, "slot": 2.0, "GPU": 1.0}]
    assert plan.actor_resources[("vision", 0)].num_gpus == 0.5 and plan.actor_resources[("text", 1)].num_gpus == 1.0
    assert plan.pools == {"all": ("pack", [0, 1])} and plan.group_of(0) == "vision+text"
    with pytest.raises(LayoutError, match="label_selector.pool"):
        _plan("collocated", {"vision": 1, "text": 1}, vision=GroupResources(1.0, 1.0, None, {"pool": "vision"}),
              text=GroupResources(1.0, 1.0, None, {"pool": "text"}))
    with pytest.raises(LayoutError, match="strategy"):
        _plan("collocated", {"vision": 1, "text": 1}, vision=GroupResources(1.0, 1.0, strategy="spread"))


def test_label_selectors_read_as_ray_reads_them():
    labels = {"pool": "text", "zone": "b"}
    assert label_matches({"pool": "text"}, labels) and not label_matches({"pool": "vision"}, labels)
    assert label_matches({"pool": "!vision"}, labels) and not label_matches({"pool": "!text"}, labels)
    assert label_matches({"zone": "in(a, b)"}, labels) and not label_matches({"zone": "!in(a,b)"}, labels)
    assert label_matches({"gpu": "!h100"}, labels) and not label_matches({"gpu": "h100"}, labels)


def test_the_collectives_environment_passes_to_the_workers():
    env = {"NCCL_SOCKET_IFNAME": "eth0", "GLOO_SOCKET_IFNAME": "eth0", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
           "HOME": "/root", "PATH": "/bin"}
    assert worker_env(env) == {k: v for k, v in env.items() if k not in ("HOME", "PATH")}


def test_resources_keys_parse_and_refuse_what_would_do_nothing():
    from dhp.config import load_config

    cfg = load_config(None, ["runtime.backend=ray", "vision.resources.label_selector={pool: vision}",
                             "vision.resources.custom={vision_slot: 1}", "text.resources.accelerator_type=H100",
                             "text.resources.num_gpus=1", "text.resources.strategy=spread"], check_files=False)
    assert cfg.vision.resources.label_selector == {"pool": "vision"} and cfg.vision.resources.custom == {
        "vision_slot": 1.0}
    assert (cfg.text.resources.accelerator_type, cfg.text.resources.num_gpus, cfg.text.resources.strategy) == (
        "H100", 1.0, "spread")
    for overrides, key in ((["vision.resources.label_selector=pool"], "vision.resources.label_selector"),
                           (["text.resources.custom={slot: 0}"], "text.resources.custom.slot"),
                           (["text.resources.num_gpus=1.5"], "text.resources.num_gpus"),
                           (["runtime.capacity_wait_s=-1"], "runtime.capacity_wait_s")):
        with pytest.raises(ConfigError, match=key):
            load_config(None, ["runtime.backend=ray", *overrides], check_files=False)
    with pytest.raises(ConfigError, match="vision.resources: .*runtime.backend=ray"):
        load_config(None, ["runtime.backend=local", "vision.resources.num_cpus=2"], check_files=False)


def test_a_local_output_dir_is_checked_before_anything_starts(tmp_path):
    """A file where output.dir (or a folder above it) should be, or a place that takes no new folder, is a config
    error before any worker starts; a good path is left as it was (the probe made and removed)."""
    (tmp_path / "notes.txt").write_text("mine")
    for out in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "run"):
        with pytest.raises(ConfigError, match=rf"output.dir={out}: {tmp_path / 'notes.txt'} is a file"):
            check_writable(out)
    check_writable(tmp_path / "new" / "run")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]  # nothing made, no probe left
    if Path("/proc/self").is_dir():  # Linux: /proc takes no new folder, even for root
        with pytest.raises(ConfigError, match="output.dir=/proc/dhp_run: cannot write in /proc"):
            check_writable(Path("/proc/dhp_run"))
