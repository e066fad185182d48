"""The Ray runtime of dhp: placement, worker groups with their process groups, dispatch, tensor transport.

Model-agnostic: a model family plugs in worker classes (subclasses of
``WorkerBase``); nothing here knows what a vision encoder is.
"""

from dhp.runtime.dispatch import Broadcast, DispatchError, Mode, dispatch, produces_tensors
from dhp.runtime.group import (
    DistributedSetup,
    ModuleSpec,
    Runtime,
    WorkerBase,
    WorkerError,
    WorkerGroup,
    choose_backend,
    init_process_groups,
    resolve_transport,
    start_ray,
)
from dhp.runtime.placement import LayoutError, PlacementPlan, create_placement_group, plan_placement

__all__ = [
    "Broadcast",
    "DispatchError",
    "DistributedSetup",
    "LayoutError",
    "Mode",
    "ModuleSpec",
    "PlacementPlan",
    "Runtime",
    "WorkerBase",
    "WorkerError",
    "WorkerGroup",
    "choose_backend",
    "create_placement_group",
    "dispatch",
    "init_process_groups",
    "plan_placement",
    "produces_tensors",
    "resolve_transport",
    "start_ray",
]
