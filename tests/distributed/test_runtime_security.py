"""A single-machine run listens on the loopback interface only: Ray's servers, the torch stores, gloo.

A local Ray is started by ``dhp.runtime.cluster.init_local_ray`` (here by the
conftest, as ``start_ray`` does for a run), with every Ray server bound to
127.0.0.1; the process groups' stores are served on sockets bound to the node
IP (so 127.0.0.1 too) and gloo is kept on the loopback interface. This test
lists every listening TCP socket of this Ray session's processes (the driver and
all its descendants: GCS, raylet, agents, workers) while a two-group runtime is
up, and fails on any that is not a loopback address.
"""

from __future__ import annotations

import ipaddress
import os

import pytest
import ray
import torch
import torch.distributed as dist

from dhp.runtime import GroupSpec, Runtime, WorkerBase, WorkerGroup
from dhp.runtime.placement import ActorResources
from dhp.runtime.process_groups import _setup_module_worlds


class TinyWorker(WorkerBase):
    def sums(self) -> tuple[float, float]:
        """Sums over the module group and over the whole world (so every gloo pair has connected)."""
        group, world = torch.ones(1), torch.ones(1)
        dist.all_reduce(group, group=self.pg)
        dist.all_reduce(world)
        return group.item(), world.item()


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return addr.is_loopback or (mapped is not None and mapped.is_loopback)


def _listening_sockets() -> list[tuple[str, int, str, int]]:
    """(ip, port, process name, pid) of every listening TCP socket of this process and its descendants."""
    import psutil  # Ray ships it (ray/thirdparty_files), on sys.path once ray is imported

    me = psutil.Process(os.getpid())
    out = []
    for proc in [me, *me.children(recursive=True)]:
        try:
            name = " ".join(proc.cmdline()[:1]) or proc.name()
            conns = proc.net_connections(kind="tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        out.extend((c.laddr.ip, c.laddr.port, name, proc.pid) for c in conns if c.status == psutil.CONN_LISTEN)
    return out


def test_single_machine_run_listens_on_loopback_only(ray_cluster: dict) -> None:
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    modules = {"a": GroupSpec(TinyWorker, 2), "b": GroupSpec(TinyWorker, 1)}
    with Runtime(modules, placement="disaggregated", cpus_per_worker=0.25) as rt:
        pending = [rt["a"].sums.submit(), rt["b"].sums.submit()]  # together: the world all-reduce needs every rank
        assert [p.get(timeout_s=60) for p in pending] == [[(2.0, 3.0)] * 2, [(1.0, 3.0)]]
        worker_pids = {pid for g in rt.groups.values() for pid in ray.get([a.__ray_call__.remote(
            lambda self: os.getpid()) for a in g.actors])}
        sockets = _listening_sockets()
    names = " ".join(name for *_, name, _ in sockets)
    assert "gcs_server" in names and "raylet" in names, sockets  # the check does see Ray's own servers
    in_workers = [s for s in sockets if s[3] in worker_pids]
    # each worker serves Ray's gRPC; rank 0 of "a" also the world's store; gloo pairs listen too
    assert len(in_workers) > len(worker_pids), in_workers
    wide = [s for s in sockets if not _is_loopback(s[0])]
    assert wide == [], f"listening beyond loopback: {wide}"


def test_module_worlds_rendezvous_on_loopback(ray_cluster: dict) -> None:
    """The GPU layout's rendezvous (each module its own default group, rank 0 serving the store on the socket
    it bound in ``dhp_master_address``), run here with gloo since the tests have no GPU."""
    groups = [WorkerGroup(TinyWorker, m, n, None, resources=ActorResources(0.25, 0.0)) for m, n in (("a", 2), ("b", 1))]
    try:
        _setup_module_worlds(groups, "gloo")
        coords = [g.call("dhp_coordinates") for g in groups]
        assert [[(c["rank"], c["world_size"], c["global_world_size"]) for c in cs] for cs in coords] == [
            [(0, 2, 2), (1, 2, 2)], [(0, 1, 1)]]
        assert groups[0].sums() == [(2.0, 2.0)] * 2 and groups[1].sums() == [(1.0, 1.0)]  # world = the module
        sockets = _listening_sockets()
    finally:
        for g in groups:
            g.kill()
    assert [s for s in sockets if not _is_loopback(s[0])] == []


@pytest.mark.parametrize("ip", ["0.0.0.0", "::", "192.0.2.2", "fd00::2"])
def test_non_loopback_addresses_are_caught(ip: str) -> None:
    assert not _is_loopback(ip)
    assert _is_loopback("127.0.0.1") and _is_loopback("::1") and _is_loopback("::ffff:127.0.0.1")
