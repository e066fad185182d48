"""The layout of one module group: a (dp, inner) mesh of its ranks, and the process groups of each mesh dim.

A module group of ``dp * inner`` ranks (inner = sp for the vision encoder, tp
for the language model) is a 2D mesh, inner dimension contiguous: module rank
``r`` is replica ``r // inner``, position ``r % inner`` inside it. Collectives
along a mesh dim need their own process groups; ``dist.new_group`` is
collective over the whole default group, so every actor of every module creates
every subgroup, in the same order (``all_mesh_groups``), and keeps its own.
DTensor meshes are then built from those groups (``DeviceMesh.from_group``),
never by DeviceMesh itself, which would create groups over the shared world.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ModuleLayout:
    """How the ranks of one module group are arranged."""

    module: str
    dp: int
    inner: int = 1  # sp (vision) or tp (text) ranks per replica
    inner_name: str = "tp"

    @property
    def size(self) -> int:
        return self.dp * self.inner

    def replica_of(self, rank: int) -> int:
        return rank // self.inner

    def inner_rank(self, rank: int) -> int:
        return rank % self.inner

    def ranks_of_replica(self, replica: int) -> list[int]:
        return [replica * self.inner + i for i in range(self.inner)]

    def groups(self, offset: int) -> dict[str, list[list[int]]]:
        """Global ranks of every subgroup along each mesh dim ("dp", inner_name), module ranks + ``offset``."""
        dp = [[offset + d * self.inner + i for d in range(self.dp)] for i in range(self.inner)]
        inner = [[offset + d * self.inner + i for i in range(self.inner)] for d in range(self.dp)]
        return {"dp": dp, self.inner_name: inner}


def all_mesh_groups(layouts: list[ModuleLayout]) -> list[tuple[str, str, list[int]]]:
    """(module, dim, global ranks) of every mesh subgroup of every module, in the one order all actors use."""
    out = []
    offset = 0
    for layout in layouts:
        for dim, groups in layout.groups(offset).items():
            out.extend((layout.module, dim, ranks) for ranks in groups)
        offset += layout.size
    return out


def create_mesh_groups(layouts: list[ModuleLayout], backend: str, global_rank: int,
                       timeout: Any = None) -> dict[str, Any]:
    """On one actor: create all mesh subgroups (collectively), return this actor's group per dim."""
    import torch.distributed as dist

    mine: dict[str, Any] = {}
    for _, dim, ranks in all_mesh_groups(layouts):
        group = dist.new_group(ranks=ranks, backend=backend, timeout=timeout)
        if global_rank in ranks:
            mine[dim] = group
    return mine


def device_mesh(layout: ModuleLayout, offset: int, groups: dict[str, Any], device_type: str):
    """This module's 2D DeviceMesh ("dp", inner) over the groups made by ``create_mesh_groups``."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh

    mesh = torch.arange(offset, offset + layout.size).view(layout.dp, layout.inner)
    return DeviceMesh.from_group(
        [groups["dp"], groups[layout.inner_name]], device_type, mesh=mesh,
        mesh_dim_names=("dp", layout.inner_name),
    )
