"""The worker side of a module group: identity (module, rank) and the module's torch process group.

This file runs inside the Ray actors. It imports no driver code (no placement,
no worker groups), so a worker class only pulls in what a worker needs.

Listening sockets: the rendezvous store of a process group is a TCP server. A
``torch.distributed.TCPStore`` master binds every interface whatever host it is
given, so the store's socket is made here, bound to this node's Ray IP (127.0.0.1
under a local Ray, see ``dhp.runtime.cluster``), and handed to the store
(``master_listen_fd``). The socket is held from the moment its port is
announced until the store takes it, so no other process can take the port in
between. Under a loopback node IP, gloo's own connections are kept on the
loopback interface too (``GLOO_SOCKET_IFNAME``, unless already set).
"""

from __future__ import annotations

import datetime
import os
import socket
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import ray

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})
STORE_TIMEOUT = datetime.timedelta(minutes=5)


def _listening_socket(host: str) -> socket.socket:
    """A TCP socket bound to ``host`` (never the wildcard), on a free port, already listening."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _loopback_interface() -> str | None:
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names else "lo0" if "lo0" in names else None


class WorkerBase:
    """Base class of dhp workers: identity (module, rank) and the module's process group.

    Subclasses are plain classes; ``WorkerGroup`` wraps them with ``ray.remote``.
    Identity is bound right after construction, so use ``self.rank`` etc. in
    methods (an ``init_model`` step), not in ``__init__``. After
    ``init_process_groups``: ``self.pg`` is the module's process group,
    ``self.rank``/``self.world_size`` the rank and size inside it,
    ``self.global_rank``/``self.global_world_size`` those in the default group.
    """

    module: str = ""
    rank: int = 0
    n_ranks: int = 1
    pg: Any = None
    world_size: int = 1
    global_rank: int = 0
    global_world_size: int = 1
    module_world: bool = False  # True: the default group is this module's own; False: one world, subgroups
    data_plane_groups: dict[str, Any] | None = None  # the p2p data plane's groups by direction (over all actors)
    _dhp_store_socket: socket.socket | None = None

    def dhp_bind(self, module: str, rank: int, n_ranks: int) -> None:
        self.module, self.rank, self.n_ranks = module, rank, n_ranks

    def dhp_ping(self) -> tuple[str, int]:
        return self.module, self.rank

    def dhp_master_address(self) -> tuple[str, int]:
        """An address and port on this node where this worker will serve a process group's store.

        The port is bound (to the node's Ray IP, not every interface) and held
        until ``setup_distributed``/``dhp_init_world`` makes this worker the store's master.
        """
        if self._dhp_store_socket is not None:
            self._dhp_store_socket.close()
        host = ray.util.get_node_ip_address()
        self._dhp_store_socket = _listening_socket(host)
        return host, self._dhp_store_socket.getsockname()[1]

    def dhp_init_world(self, backend: str, master: tuple[str, int], rank: int, world_size: int) -> None:
        """Makes torch's default process group over ``world_size`` actors, rendezvous at ``master``.

        Run on every actor of every module before the Ray collective group is
        created: Ray then uses this default group instead of making its own
        (whose store would listen on every interface).
        """
        import torch.distributed as dist

        extra: dict[str, Any] = {}
        if backend == "nccl":  # one world over GPU workers (the p2p data plane): eager NCCL init on this device
            import torch

            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
            extra["device_id"] = torch.device("cuda", 0)
        else:
            self._keep_gloo_local(master[0])
        store = self._store(master, rank, world_size)
        dist.init_process_group(backend, store=store, world_size=world_size, rank=rank,
                                timeout=self.collective_timeout(), **extra)

    def dhp_init_data_plane(self, backend: str) -> None:
        """The point-to-point data plane's process groups over every actor, one per direction
        (``dhp.runtime.data_plane``); collective: every actor calls it, in the same order, after the module
        groups. A one-element all-reduce on each makes every rank connect now, not in the first step."""
        import torch
        import torch.distributed as dist

        from dhp.runtime.data_plane import DIRECTIONS

        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        self.data_plane_groups = {}
        for direction in DIRECTIONS:
            group = dist.new_group(backend=backend, timeout=self.collective_timeout())
            dist.all_reduce(torch.ones(1, device=device), group=group)
            self.data_plane_groups[direction] = group

    def collective_timeout(self) -> timedelta | None:
        """How long a collective may wait before it fails (``collective_timeout_s`` of the worker; None: torch's)."""
        seconds = getattr(self, "collective_timeout_s", None)
        return None if seconds is None else timedelta(seconds=seconds)

    def setup_distributed(
        self,
        backend: str,
        module_ranks: Sequence[tuple[str, list[int]]] | None = None,
        master: tuple[str, int] | None = None,
    ) -> dict[str, Any]:
        """Creates this worker's module process group; returns its coordinates.

        ``module_ranks`` (shared world, CPU): the default group already spans all
        actors (``dhp_init_world``, then the Ray collective group); a subgroup is
        made for every module, in the given order, on every actor. ``master``
        (GPU): this module's actors form their own default group, rendezvous at
        ``master`` (rank 0 of the module serves the store).
        """
        import torch.distributed as dist

        if master is not None:
            self._init_module_world(dist, backend, master)
        else:
            self._init_subgroups(dist, backend, module_ranks or [])
        return self.dhp_coordinates()

    def _store(self, master: tuple[str, int], rank: int, world_size: int) -> Any:
        """The rendezvous store: served by rank 0 on its held socket, a client elsewhere."""
        import torch.distributed as dist

        host, port = master
        sock = self._dhp_store_socket if rank == 0 else None
        if sock is not None and sock.getsockname()[1] == port:
            self._dhp_store_socket = None
            fd = sock.detach()  # the store owns the socket from here on
            return dist.TCPStore(host, port, world_size, True, timeout=STORE_TIMEOUT, wait_for_workers=False,
                                 master_listen_fd=fd)
        return dist.TCPStore(host, port, world_size, rank == 0, timeout=STORE_TIMEOUT, wait_for_workers=False)

    @staticmethod
    def _keep_gloo_local(host: str) -> None:
        if host in LOOPBACK_HOSTS and "GLOO_SOCKET_IFNAME" not in os.environ:
            ifname = _loopback_interface()
            if ifname is not None:
                os.environ["GLOO_SOCKET_IFNAME"] = ifname

    def _init_module_world(self, dist: Any, backend: str, master: tuple[str, int]) -> None:
        if backend == "nccl":
            import torch

            torch.cuda.set_device(0)  # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU
        else:
            self._keep_gloo_local(master[0])
        store = self._store(master, self.rank, self.n_ranks)
        dist.init_process_group(backend, store=store, world_size=self.n_ranks, rank=self.rank,
                                timeout=self.collective_timeout())
        self.pg = dist.group.WORLD
        self.module_world = True  # this module's own default group (module-local ranks)
        self._set_coordinates(dist)

    def _init_subgroups(self, dist: Any, backend: str, module_ranks: Sequence[tuple[str, list[int]]]) -> None:
        if not dist.is_initialized():
            raise RuntimeError(f"{self.module} rank {self.rank}: no default process group; create the collective first")
        for module, ranks in module_ranks:  # every actor creates every subgroup, same order: new_group is collective
            group = dist.new_group(ranks=list(ranks), backend=backend, timeout=self.collective_timeout())
            if module == self.module:
                self.pg = group
        if self.pg is None:
            raise RuntimeError(f"{self.module} rank {self.rank}: module missing from {[m for m, _ in module_ranks]}")
        self._set_coordinates(dist)

    def _set_coordinates(self, dist: Any) -> None:
        self.world_size = dist.get_world_size(self.pg)
        self.global_rank = dist.get_rank()
        self.global_world_size = dist.get_world_size()
        if dist.get_rank(self.pg) != self.rank or self.world_size != self.n_ranks:
            raise RuntimeError(
                f"{self.module} rank {self.rank}/{self.n_ranks}: process group says rank "
                f"{dist.get_rank(self.pg)}/{self.world_size}"
            )

    def dhp_coordinates(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "rank": self.rank,
            "world_size": self.world_size,
            "global_rank": self.global_rank,
            "global_world_size": self.global_world_size,
        }


__all__ = ["WorkerBase"]
