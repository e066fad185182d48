"""One local Ray for all distributed tests: starting Ray costs ~4 s, so it is started once per session.

Worker classes defined in test modules must be importable inside Ray workers,
so the workers get this folder and the repository root on PYTHONPATH. Ray is
started the way ``dhp.runtime.start_ray`` starts a local Ray (``init_local_ray``:
every server bound to 127.0.0.1), so the tests see the bindings a run has.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from dhp.runtime.cluster import init_local_ray

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[dict[str, float]]:
    """A local Ray with 4 CPUs, shared by the whole session; shut down at the end."""
    started = not ray.is_initialized()
    if started:
        path = os.pathsep.join(p for p in (str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
        init_local_ray(
            num_cpus=4,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
    try:
        yield ray.cluster_resources()
    finally:
        if started:
            ray.shutdown()
