"""The Ray runtime of dhp: placement, worker groups with their process groups, dispatch, tensor transport.

Model-agnostic: the Ray backend (``dhp.backends``) plugs in its worker classes (subclasses of ``WorkerBase``,
one per kind of module engine) and names each group after its module; nothing here knows what a vision
encoder is, nor which model family runs.

Files, one concern each: ``cluster`` (start/join Ray, loopback binding, backend
and transport choice), ``errors`` (``WorkerError``), ``dispatch`` (how calls
split over ranks and how results are collected), ``placement`` and ``mesh``
(where workers run, how a group's ranks form replicas), ``worker_base`` (the
worker side), ``worker_group`` and ``binding`` (the driver side of one module),
``process_groups`` (torch groups across modules), ``data_plane`` (the worker side of moving embeddings and
gradients between groups: point to point, CUDA IPC), ``runtime`` (the lifecycle).
"""

from dhp.runtime.binding import BoundMethod, Pending, get_watching
from dhp.runtime.cluster import choose_backend, resolve_transport, start_ray
from dhp.runtime.dispatch import Broadcast, Collect, DispatchError, Mode, Split, dispatch, produces_tensors
from dhp.runtime.errors import WorkerError
from dhp.runtime.placement import (
    GroupResources,
    LayoutError,
    PlacementPlan,
    create_placement_group,
    create_placement_groups,
    plan_placement,
)
from dhp.runtime.process_groups import DistributedSetup, init_process_groups
from dhp.runtime.runtime import GroupSpec, Runtime
from dhp.runtime.worker_base import WorkerBase
from dhp.runtime.worker_group import WorkerGroup

__all__ = [
    "BoundMethod",
    "Broadcast",
    "Collect",
    "DispatchError",
    "DistributedSetup",
    "GroupResources",
    "LayoutError",
    "Mode",
    "GroupSpec",
    "Pending",
    "PlacementPlan",
    "Runtime",
    "Split",
    "WorkerBase",
    "WorkerError",
    "WorkerGroup",
    "get_watching",
    "choose_backend",
    "create_placement_group",
    "create_placement_groups",
    "dispatch",
    "init_process_groups",
    "plan_placement",
    "produces_tensors",
    "resolve_transport",
    "start_ray",
]
