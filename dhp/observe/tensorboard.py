"""Every metric of a step as TensorBoard scalars (``output.tensorboard=true``), under ``output.dir/tensorboard``.

``tensorboard`` is an optional extra (``pip install 'dhp[tensorboard]'``): ``torch.utils.tensorboard``
needs it. Scalars are tagged by their metrics.jsonl name (``loss``, ``lr``, ``mfu_text``, ...), one point per
step.
"""

from __future__ import annotations

import math
from pathlib import Path

from dhp.errors import ConfigError

INSTALL_HINT = "output.tensorboard=true needs the tensorboard package: pip install 'dhp[tensorboard]'"


def require_tensorboard() -> None:
    """Fail early, naming the key and the fix, when tensorboard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401 - imports tensorboard
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None


class Scalars:
    def __init__(self, log_dir: Path) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, row: dict) -> None:
        step = int(row["step"])
        for key, value in row.items():
            if key == "step" or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
