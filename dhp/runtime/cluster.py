"""Joining or starting Ray, and the backend/transport choices that depend only on the cluster's devices.

Kept apart from the worker groups because it is the one place that decides how
Ray itself runs. A local Ray (no address, no RAY_ADDRESS) is started bound to
the loopback interface: a single-machine run has no peer to talk to, so its
GCS, raylet, object manager and worker gRPC servers listen on 127.0.0.1 only
(Ray's token authentication stays on as well). Ray 2.60 offers no option for
that: ``ray.init(_node_ip_address="127.0.0.1")`` is turned back into the
machine's routable IP (``services.resolve_ip_for_localhost``); Ray only keeps
the loopback address when ``ray_constants.ENABLE_RAY_CLUSTER`` is off (its
setting on macOS/Windows), and every gRPC server of Ray binds 127.0.0.1 when the
node IP is 127.0.0.1. ``init_local_ray`` turns that flag off for the duration of
``ray.init`` only, and checks the outcome.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Literal

import ray

Transport = Literal["auto", "p2p", "cuda_ipc", "direct", "object_store"]
TRANSPORTS = ("auto", "p2p", "cuda_ipc", "direct", "object_store")
DataPlane = Literal["p2p", "cuda_ipc", "ray"]  # how embeddings and their gradients move between groups

LOOPBACK = "127.0.0.1"
LOOPBACK_HOSTS = frozenset({"127.0.0.1", "::1", "localhost"})

log = logging.getLogger(__name__)


def start_ray(address: str | None = None, num_cpus: int | None = None) -> bool:
    """Starts a local Ray (address None and no RAY_ADDRESS) or joins one ("auto", host:port, RAY_ADDRESS).

    Idempotent: if Ray is already initialized in this process nothing happens.
    Returns True when this call started Ray (the caller then owns its shutdown).
    A local Ray listens on the loopback interface only (``init_local_ray``).
    """
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address in (None, "local"):
        init_local_ray(num_cpus=num_cpus, log_to_driver=True)
    else:
        check_reachable(address)
        ray.init(address=address)  # resources belong to the cluster; num_cpus is not allowed when joining
    return True


def check_reachable(address: str, timeout_s: float = 10.0) -> None:
    """A cluster address (``host:port``, ``ray://host:port``) that nothing answers at is a ConfigError now: Ray
    itself retries such an address for minutes (seen: still waiting after 2 minutes for a refused port). Other
    forms (``auto``) are Ray's to resolve."""
    import socket

    from dhp.errors import ConfigError

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            pass
    except OSError as e:
        where = ("runtime.ray_address" if address != os.environ.get("RAY_ADDRESS") else "RAY_ADDRESS")
        raise ConfigError(f"{where}={address}: no Ray cluster answers there ({type(e).__name__}: {e}); start one "
                          "(`ray start --head` on its head node), give its head's address (host:6379), or unset "
                          f"{where} for a local Ray") from None


def init_local_ray(num_cpus: int | None = None, **init_kwargs: Any) -> str:
    """Starts a new single-node Ray whose servers listen on 127.0.0.1 only; returns the node IP Ray took.

    ``init_kwargs`` go to ``ray.init`` (``runtime_env``, ``log_to_driver``...); the
    dashboard is off unless asked for. If this Ray version ignores the loopback
    request, Ray still starts (bound as Ray chooses) and a warning says so.
    """
    init_kwargs.setdefault("include_dashboard", False)
    # "local": a new instance even where another one runs on this machine (a `ray start`, a simulated cluster):
    # without it ray.init joins the newest one it finds in /tmp/ray and refuses num_cpus
    init_kwargs.setdefault("address", "local")
    from ray._private import ray_constants  # Ray 2.60 internal: see the module docstring

    had_flag = hasattr(ray_constants, "ENABLE_RAY_CLUSTER")
    saved = getattr(ray_constants, "ENABLE_RAY_CLUSTER", None)
    ray_constants.ENABLE_RAY_CLUSTER = False  # node IP = loopback, so every gRPC server binds 127.0.0.1
    try:
        ray.init(num_cpus=num_cpus, **init_kwargs)
    finally:
        if had_flag:
            ray_constants.ENABLE_RAY_CLUSTER = saved
        else:
            del ray_constants.ENABLE_RAY_CLUSTER
    node_ip = node_ip_address()
    if node_ip not in LOOPBACK_HOSTS:
        log.warning("local Ray took node IP %s, not %s: its servers may listen beyond this machine", node_ip, LOOPBACK)
    return node_ip


# The environment that tunes the collectives: set on the driver, it reaches every worker on every node (a worker
# on another node does not inherit the driver's environment; Ray merges these into the job's env_vars).
PASSTHROUGH_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_CPP_LOG_LEVEL", "FI_", "UCX_",
                        "CUDA_DEVICE_MAX_CONNECTIONS")


def worker_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The driver's NCCL/gloo/torch.distributed variables, for every worker's ``runtime_env``."""
    env = os.environ if environ is None else environ
    return {k: v for k, v in env.items() if k.startswith(PASSTHROUGH_PREFIXES)}


def node_ip_address() -> str:
    """The IP address Ray uses for this node (127.0.0.1 for a local Ray started by ``init_local_ray``)."""
    return ray.util.get_node_ip_address()


def cluster_gpus(address: str | None = None) -> float:
    """The GPUs the Ray cluster a run would use has: Ray's own count once Ray is up (or joined, for an address
    or RAY_ADDRESS); for a local Ray yet to start, the devices torch sees here (what Ray would detect)."""
    address = address or os.environ.get("RAY_ADDRESS") or None
    if not ray.is_initialized() and address is None:
        import torch

        return float(torch.cuda.device_count()) if torch.cuda.is_available() else 0.0
    start_ray(address)
    return float(ray.cluster_resources().get("GPU", 0.0))


def choose_backend(gpus_per_worker: float) -> str:
    """The collective backend of the module groups: NCCL when workers hold GPUs, gloo otherwise."""
    return "nccl" if gpus_per_worker > 0 else "gloo"


def check_transport(transport: str) -> None:
    if transport not in TRANSPORTS:
        raise ValueError(f"runtime.transport must be one of {', '.join(TRANSPORTS)}, got {transport!r}")


def resolve_data_plane(transport: Transport, placement: str, backend: str, gpus_per_worker: float) -> DataPlane:
    """How embeddings and their gradients move between the module groups.

    ``p2p``: torch.distributed point-to-point (``batch_isend_irecv``) between the sending and the receiving
    ranks, over process groups that span all of them (NCCL between GPUs, gloo on CPU); the driver passes
    only small metadata (``dhp.runtime.data_plane``). ``cuda_ipc``: workers that share a GPU hand each other
    CUDA IPC handles (with the producer's event) through Ray; the tensors never leave the device.
    ``ray``: the tensors themselves go through Ray (its object store, or Ray Direct Transport).

    ``auto``: p2p between disaggregated workers (whole GPUs, or CPU processes over gloo, so CI runs the
    GPU data plane's logic); CUDA IPC where workers share a GPU (collocated on CUDA, or fractional GPUs, where one
    NCCL communicator cannot hold two ranks of one device); the object store for collocated CPU workers.
    """
    check_transport(transport)
    shares_gpu = backend == "nccl" and (placement == "collocated" or 0 < gpus_per_worker < 1)
    if transport == "auto":
        if shares_gpu:
            return "cuda_ipc"
        return "p2p" if placement == "disaggregated" else "ray"
    if transport == "cuda_ipc" and backend != "nccl":
        raise ValueError("runtime.transport=cuda_ipc needs workers on CUDA devices (runtime.gpus_per_worker > 0)")
    if transport == "p2p" and shares_gpu:
        raise ValueError("runtime.transport=p2p: NCCL cannot join two ranks of one GPU; workers that share a GPU "
                         "use runtime.transport=cuda_ipc (or auto)")
    return transport if transport in ("p2p", "cuda_ipc") else "ray"


def resolve_transport(transport: Transport, backend: str, gpus_per_worker: float) -> str | None:
    """The Ray ``tensor_transport`` for tensor-producing methods, or None for the object store.

    "auto" is Ray Direct Transport over NCCL between GPUs, and the object store
    elsewhere: on CPU (gloo), because RDT over gloo (ray 2.60) was seen to lose
    a transfer under CPU load, the receiver failing after 60 s (docs/runtime.md);
    and where workers share a GPU (collocated, fractional GPUs), because one NCCL
    communicator cannot hold two ranks on one device. "direct" forces RDT.
    """
    check_transport(transport)
    if transport in ("object_store", "p2p", "cuda_ipc"):  # no Ray Direct Transport: the object store carries
        return None  # whatever still goes through Ray (the driver's metadata; cuda_ipc's small handles)
    if transport == "auto" and (backend != "nccl" or 0 < gpus_per_worker < 1):
        return None
    return "NCCL" if backend == "nccl" else "GLOO"


__all__ = [
    "LOOPBACK",
    "Transport",
    "DataPlane",
    "choose_backend",
    "resolve_data_plane",
    "cluster_gpus",
    "init_local_ray",
    "node_ip_address",
    "resolve_transport",
    "start_ray",
    "worker_env",
]
