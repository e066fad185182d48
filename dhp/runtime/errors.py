"""The error a failed worker method becomes on the driver.

A leaf module (no Ray, no torch) so that every other runtime file, driver side
or worker side, can raise or catch it without importing the rest.
"""

from __future__ import annotations

import re

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


class WorkerError(RuntimeError):
    """A worker method failed; the message names module, rank and method and holds the worker's traceback.

    ``what`` says what went wrong in words ("failed in forward()" unless given: a producer that died while
    making another group's input has no method name to give).
    """

    def __init__(self, module: str, rank: int, method: str, detail: str, what: str | None = None):
        self.module, self.rank, self.method = module, rank, method
        self.what = what or f"failed in {method}()"
        # Ray colours its traceback and leaves caret lines of the internal frames it hides: drop both.
        detail = "\n".join(ln for ln in _ANSI.sub("", detail).splitlines() if ln.strip(" ^~"))
        super().__init__(f"{module} rank {rank} {self.what}; worker traceback:\n{detail}")


__all__ = ["WorkerError"]
