"""Progress of a long phase (validating a data set, evaluating, writing a checkpoint) on stderr.

A tqdm bar when stderr is a terminal, else one plain line at every tenth of the
work. A phase that may be short (``after_s`` > 0) says nothing until it has run
that long, so quick phases and tests stay quiet.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """``with Progress(total, "validating x.jsonl", unit="sample") as p: ... p.update()``."""

    def __init__(self, total: int, desc: str, unit: str = "sample", after_s: float = 0.0,
                 stream: TextIO | None = None, marks: int = 10) -> None:
        self.total, self.desc, self.unit, self.after_s = total, desc, unit, after_s
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.step = max(1, -(-total // max(marks, 1)))  # ceil(total / marks)
        self.done = 0
        self.start = time.perf_counter()
        self.shown = False
        self.bar = None
        if after_s <= 0:
            self._show()

    def _show(self) -> None:
        self.shown = True
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.done, desc=self.desc, unit=self.unit,
                            file=self.stream, dynamic_ncols=True, leave=False)
        else:
            self._line(f"dhp: {self.desc}: {self.total} {self.unit}s")

    def _line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def update(self, n: int = 1) -> None:
        before, self.done = self.done, self.done + n
        if not self.shown:
            if time.perf_counter() - self.start < self.after_s:
                return
            self._show()
            before = -1  # print the current position at once
        if self.bar is not None:
            if before >= 0:
                self.bar.update(n)
        elif before < 0 or self.done // self.step > before // self.step or self.done == self.total:
            pct = 100 * self.done // max(self.total, 1)
            self._line(f"dhp: {self.desc}: {self.done}/{self.total} {self.unit}s ({pct}%), "
                       f"{time.perf_counter() - self.start:.0f} s")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
