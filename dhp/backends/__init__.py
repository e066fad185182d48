"""Backends run the module engines: ``local`` (one process, the reference) or ``ray`` (a worker group per module).

Both implement ``dhp.backends.base.Backend``; the driver loop (``dhp.train``) sees only that protocol.
"""

from __future__ import annotations

from dhp.backends.base import Backend
from dhp.data.llava import SFTDataset
from dhp.inputs import DatasetSpec, RunInputs


def make_backend(inputs: RunInputs, dataset: SFTDataset, spec: DatasetSpec) -> Backend:
    if inputs.cfg.runtime.backend == "local":
        from dhp.backends.local import LocalBackend

        return LocalBackend(inputs, dataset)
    from dhp.backends.ray_backend import RayBackend

    return RayBackend(inputs, spec)
