"""Runs on a multi-node Ray cluster simulated on this machine (``ray.cluster_utils.Cluster``): groups placed on
their own labelled node pools (read back from workers.json) with parity, a group the cluster cannot hold refused
by name before any worker starts, and a node removed mid-run survived with the result of an uninterrupted run.

One Cluster for the whole module (a head without CPUs and three one-CPU nodes: one labelled ``pool=vision`` with
a custom ``encoder_slot`` resource, two labelled ``pool=text``). The session's local Ray (``ray_cluster`` in
conftest.py, one per xdist worker) is shut down while the Cluster runs and started again after, so the tests of
this worker that come later find it as before. The last test takes a node away; the others do not depend on
the order (the uninterrupted run is a fixture, made on all three nodes).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
from safetensors.torch import load_file

from dhp.config import load_config
from dhp.errors import ConfigError
from dhp.runtime.cluster import init_local_ray
from dhp.train import train

pytestmark = pytest.mark.xdist_group("ray_cluster_utils")  # one Cluster: the module's tests on one worker

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STEPS = 4
SGD = ["train.optimizer=sgd", "train.lr=0.05", "train.momentum=0.9"]
POOLS = ["vision.resources.label_selector={pool: vision}", "vision.resources.custom={encoder_slot: 1}",
         "text.resources.label_selector={pool: text}", "text.resources.strategy=spread"]
# a lost node is known to the GCS within ~6 s (Ray's defaults: ~30 s; the tests need not wait that long)
HEALTH_CHECKS = {"health_check_period_ms": 1000, "health_check_timeout_ms": 2000, "health_check_failure_threshold": 3}
LAYOUT = ["runtime.backend=ray", "runtime.placement=disaggregated", "vision.parallel.sp=2", "text.parallel.tp=2",
          "runtime.cpus_per_worker=0.5", "runtime.gpus_per_worker=0", *POOLS]


def _pythonpath() -> str:
    return os.pathsep.join(p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, object]]:
    """{name: Ray node} of a head and three labelled nodes; the driver connected to it."""
    from ray.cluster_utils import Cluster

    session_ray = ray.is_initialized()
    if session_ray:
        ray.shutdown()
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                      "_system_config": HEALTH_CHECKS})
    nodes = {"vision": c.add_node(num_cpus=1, labels={"pool": "vision"}, resources={"encoder_slot": 2}),
             "text_a": c.add_node(num_cpus=1, labels={"pool": "text"}),
             "text_b": c.add_node(num_cpus=1, labels={"pool": "text"})}
    try:
        ray.init(address=c.address, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": _pythonpath()}})
        yield {"cluster": c, **nodes}
    finally:
        ray.shutdown()
        c.shutdown()
        if session_ray:  # as tests/distributed/conftest.py started it
            init_local_ray(num_cpus=4, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": _pythonpath()}})


@pytest.fixture(scope="module")
def base(demo_data) -> list[str]:
    return [f"data.path={demo_data.train}", f"data.tokenizer={demo_data.tokenizer}", "data.max_pixels=12544",
            "train.global_batch_size=4", "train.micro_batch_size=2", "train.warmup_steps=1",
            f"train.steps={STEPS}", "train.checkpoint_every=2", "train.eval_at_end=false", *SGD]


@pytest.fixture(scope="module")
def reference(base, tmp_path_factory) -> Path:
    """The single-process run (local backend: needs no Ray)."""
    out = tmp_path_factory.mktemp("cluster_reference")
    run(base + ["runtime.backend=local"], out)
    return out


@pytest.fixture(scope="module")
def pooled(cluster, base, tmp_path_factory) -> Path:
    """The uninterrupted run on the cluster, every group on its own node pool."""
    out = tmp_path_factory.mktemp("cluster_pooled")
    run(base + LAYOUT, out)
    return out


def run(overrides: list[str], out: Path, *extra: str) -> dict:
    return train(load_config(None, overrides + [f"output.dir={out}", *extra]))


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(out: Path, ref: Path) -> None:
    assert losses(out) == pytest.approx(losses(ref), rel=1e-5)
    a, b = (load_file(str(p / "final" / "model.safetensors")) for p in (out, ref))
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def nodes_of(out: Path) -> dict[str, set[str]]:
    workers = json.loads((out / "workers.json").read_text())
    found: dict[str, set[str]] = {}
    for w in workers:
        assert w["ip"] and w["node_id"], w
        found.setdefault(w["module"], set()).add(w["node_id"])
    return found


def _alive_dhp() -> tuple[list[str], int]:
    actors = [a["Name"] for a in ray._private.state.actors().values()
              if a["State"] == "ALIVE" and a["Name"].startswith("dhp-")]
    pgs = [p for p in ray.util.placement_group_table().values() if p["state"] != "REMOVED"]
    return actors, len(pgs)


def test_a_group_the_cluster_cannot_hold_is_refused_by_name(cluster, base, tmp_path):
    """Before any worker starts: labels no node has, an accelerator no node has, more of a custom resource than
    the pool holds; each refusal names the group and what it lacks."""
    cases = [
        (["vision.resources.label_selector={pool: audio}"], ["vision", "pool: audio", "pool=text", "pool=vision"]),
        (["text.resources.accelerator_type=H100"], ["text", "accelerator type H100"]),
        (["vision.resources.custom={encoder_slot: 1.5}"], ["vision", "do not all fit", "encoder_slot"]),
    ]
    for extra, words in cases:
        with pytest.raises(ConfigError) as err:
            run(base + LAYOUT, tmp_path / "refused", *extra, "runtime.capacity_wait_s=0")
        for w in words:
            assert w in str(err.value), (w, str(err.value))
        assert _alive_dhp() == ([], 0)


def test_groups_run_on_their_node_pools_with_parity(cluster, pooled, reference):
    """vision's two SP ranks on the vision node (pack), text's two TP ranks spread over the two text nodes, as
    workers.json says; losses and final weights equal the single-process run's."""
    ids = {name: cluster[name].node_id for name in ("vision", "text_a", "text_b")}
    assert nodes_of(pooled) == {"vision": {ids["vision"]}, "text": {ids["text_a"], ids["text_b"]}}
    assert_same_run(pooled, reference)
    assert _alive_dhp() == ([], 0)


def _remove_when(out: Path, step: int, c: object, node: object, removed: list) -> None:
    """Once step ``step``'s checkpoint is complete: the node goes, and with it every process it ran (the raylet
    by ``remove_node``; its workers, which outlive their raylet by a moment, killed as a lost machine's are)."""
    deadline = time.monotonic() + 300
    marker = out / "checkpoints" / f"step_{step:06d}" / "COMPLETE"
    while time.monotonic() < deadline:
        if marker.is_file():
            pids = [w["pid"] for w in json.loads((out / "workers.json").read_text()) if w["node_id"] == node.node_id]
            c.remove_node(node, allow_graceful=False)
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            removed.append(pids)
            return
        time.sleep(0.02)


def test_a_lost_node_is_survived(cluster, base, pooled, tmp_path):
    """Node text_b (a text rank on it) removed once step 2's checkpoint is written, with max_failures=1: every
    group restarts on the remaining nodes (both text ranks on text_a) from that checkpoint, and the run ends
    equal to the uninterrupted one. Then a layout the remaining nodes cannot hold waits for capacity, and stops
    with the resume command."""
    out = tmp_path / "lost"
    removed: list[str] = []
    remover = threading.Thread(target=_remove_when, args=(out, 2, cluster["cluster"], cluster["text_b"], removed))
    remover.start()
    summary = run(base + LAYOUT, out, "runtime.max_failures=1")
    remover.join()
    assert removed and removed[0], "the run finished before the node could be removed"
    assert summary["failures_survived"] == 1
    assert nodes_of(out) == {"vision": {cluster["vision"].node_id}, "text": {cluster["text_a"].node_id}}
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
    assert_same_run(out, pooled)
    assert _alive_dhp() == ([], 0)
    # a layout the remaining nodes cannot hold (text's two ranks at one CPU each need both text nodes): the driver
    # waits runtime.capacity_wait_s for capacity, then stops naming the group and how to resume
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as err:
        run(base + LAYOUT, tmp_path / "short", "text.resources.num_cpus=1", "runtime.capacity_wait_s=2")
    assert time.monotonic() - t0 >= 2
    for words in ("text:", "waited 2 s", "runtime.capacity_wait_s", "lost 1 node", "train.resume=auto"):
        assert words in str(err.value), (words, str(err.value))
    assert _alive_dhp() == ([], 0)



def test_a_local_ray_started_beside_a_running_cluster_is_its_own(cluster):
    """`dhp train` with no ray_address starts its own local Ray even while another instance runs on the machine
    (here the simulated cluster, which Ray records as the newest one): ray.init would otherwise join that one and
    refuse the local Ray's num_cpus."""
    code = ("import ray\nfrom dhp.runtime.cluster import start_ray\nstart_ray(num_cpus=1)\n"
            "print(ray.cluster_resources().get('CPU'), len(ray.nodes()), ray.util.get_node_ip_address())\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1.0", "1", "127.0.0.1"]  # one node, the CPU asked for, on loopback
