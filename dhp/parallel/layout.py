"""What one rank knows of its module's layout: a (dp, inner) mesh, inner being sp or tp.

A leaf shared by the engines, the workers and the model families' ``parallelize``
functions (which read ``inner_kind``, ``inner_group`` and ``mesh``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass
class Parallel:
    """``dp_group`` spans the data-parallel replicas at this inner position, ``inner_group`` the ranks of this
    replica, ``module_group`` all ranks of the module; ``mesh`` is the 2D DeviceMesh ("dp", inner) over them.
    The single-process reference has none. ``config`` is the module's ``ParallelConfig`` (its sizes)."""

    config: Any
    inner_kind: str = "none"  # "sp" | "tp" | "none"
    dp_rank: int = 0
    inner_rank: int = 0
    dp_group: Any = None
    inner_group: Any = None
    module_group: Any = None
    mesh: Any = None

    @property
    def inner(self) -> int:
        return self.config.sp if self.inner_kind == "sp" else self.config.tp

    @property
    def distributed(self) -> bool:
        return self.module_group is not None and dist.get_world_size(self.module_group) > 1
