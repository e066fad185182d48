"""What every backend shares: the step's result, the backend protocol, and the end of a step.

A leaf for the driver loop (``dhp.train``), the local backend and the Ray
backend, so that none of them imports another's file.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import torch

from dhp.data.sampler import StepPlan


@dataclass
class StepStats:
    loss: float  # global token mean
    supervised_tokens: int
    grad_norm: float
    lr: float
    timings: dict[str, float] = field(default_factory=dict)  # "{module}_{phase}" -> seconds
    router_bytes: int = 0
    router_bytes_by_direction: dict[str, int] = field(default_factory=dict)  # "forward" (embeddings), "backward"
    worker_memory_gb: float = 0.0  # peak over the workers (Ray backend)
    comm_bytes: dict[str, int] = field(default_factory=dict)  # "{module}_{collective}" -> bytes, all ranks
    imbalance: dict[str, float] = field(default_factory=dict)  # module -> busiest replica's busy time / mean
    memory_gb_by_module: dict[str, float] = field(default_factory=dict)  # module -> peak over its ranks
    spans: list[dict] = field(default_factory=list)  # the step's timeline: module, rank, phase, round, start, end
    busy_fraction: dict[str, float] = field(default_factory=dict)  # module -> mean over ranks of busy / step time
    devices: dict[str, dict] = field(default_factory=dict)  # module -> {"device_name", "threads"} of its rank 0


class Backend(Protocol):
    """Runs steps on the module engines, wherever they live."""

    modules: list[str]

    def run_step(self, plan: StepPlan, upcoming: StepPlan | None = None) -> StepStats: ...  # upcoming: a hint
    def state_dict(self) -> dict[str, torch.Tensor]: ...  # whole-model, our names
    def rank_state_dicts(self) -> dict[str, list[dict[str, torch.Tensor]]]: ...  # module -> every rank's weights
    def save_checkpoint(self, path: Path) -> dict[str, float]: ...  # every group writes its shards; seconds each
    def load_checkpoint(self, path: Path, step: int, same_layout: bool) -> None: ...
    def workers(self) -> list[dict]: ...  # module, rank, node, pid of every worker
    def shutdown(self) -> None: ...


def process_memory_gb() -> float:
    """Peak memory of this process: CUDA allocations on a GPU, peak RSS (kB -> GB) otherwise."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def clip_coefficient(grad_norm: float, max_norm: float) -> float:
    """As torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), at most 1; max_norm <= 0 disables."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (grad_norm + 1e-6))


def global_norm(norm_sq: list[float]) -> float:
    """One gradient norm over all modules, from each module's squared norm."""
    return math.sqrt(sum(norm_sq))


def no_supervised_tokens() -> RuntimeError:
    return RuntimeError("a global batch with no supervised token: check the data's assistant replies")


def imbalance(busy_per_replica: list[float]) -> float:
    """The busiest replica's busy time over the mean (1.0: perfectly balanced, or nothing to do)."""
    mean = sum(busy_per_replica) / len(busy_per_replica) if busy_per_replica else 0.0
    return max(busy_per_replica) / mean if mean > 0 else 1.0
