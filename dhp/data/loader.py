"""A loader that runs ahead: the samples of the rounds a worker encodes next, decoded in background threads.

Why: an encoder rank otherwise decodes, resizes and patchifies its samples in
its own thread, at the start of each forward: the device waits for PIL. The
driver tells each encoder worker which samples its next round holds
(``prefetch``) before the current round's forward runs, and a thread pool
(``data.loader_workers`` threads; 0: load in the caller, as the reference does)
decodes them meanwhile; the language model's workers read their next round's
samples (no pixels) the same way. Each sample is decoded once per replica rank, and
handed out once (``take``): a sample of a later step is loaded again.

Errors keep their names: a broken file raises the data set's own error (file,
sample, fix) from the pool, and ``take`` re-raises it in the worker's thread,
in the forward that needed the sample; a load never waits forever (``timeout_s``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

LOAD_TIMEOUT_S = 600.0


class AheadLoader:
    """Loads samples by id in ``workers`` background threads; ``take`` returns them (or loads them itself)."""

    def __init__(self, load: Callable[..., Any], workers: int, pixels: bool = True,
                 timeout_s: float = LOAD_TIMEOUT_S) -> None:
        """``load(i, pixels=...)``: the data set's ``get``; ``pixels``: what the prefetched samples carry (the
        language model's worker prefetches placeholders and grids only, ``pixels=False``)."""
        if workers < 0:
            raise ValueError(f"data.loader_workers must be >= 0, got {workers}")
        self.load, self.timeout_s, self.pixels = load, timeout_s, pixels
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="dhp-loader") if workers else None
        self._ahead: dict[int, Future] = {}
        self.waited_s = 0.0  # time ``take`` spent waiting for the background (or loading itself): waiting for data
        self._lock = threading.Lock()
        self.spans: list[dict[str, Any]] = []  # one "load" span per prefetched round: wall-clock start and end

    def prefetch(self, key: Hashable, sample_ids: list[int]) -> None:
        """Start loading ``sample_ids`` (a round ``key``) in the background; returns at once."""
        if self.pool is None or not sample_ids:
            return
        span = {"phase": "load", "round": key, "start": time.time(), "end": None}
        todo = [i for i in sample_ids if i not in self._ahead]
        remaining = [len(todo)]

        def one(i: int) -> Any:
            try:
                return self.load(i, pixels=self.pixels)
            finally:
                with self._lock:
                    remaining[0] -= 1
                    if remaining[0] == 0:
                        span["end"] = time.time()

        if not todo:
            return
        self.spans.append(span)
        for i in todo:
            self._ahead[i] = self.pool.submit(one, i)

    def take(self, i: int, pixels: bool = True) -> Any:
        """Sample ``i``: the background's result if it was prefetched (its error re-raised here), else loaded now."""
        future = self._ahead.pop(i, None) if pixels == self.pixels else None
        t0 = time.perf_counter()
        try:
            if future is None:
                return self.load(i, pixels=pixels)
            return future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise TimeoutError(f"sample {i}: the background loader did not finish it within {self.timeout_s:g} s"
                               ) from None
        finally:
            self.waited_s += time.perf_counter() - t0

    def pop_waited(self) -> float:
        """Seconds ``take`` waited since the last call."""
        waited, self.waited_s = self.waited_s, 0.0
        return waited

    def finished_spans(self) -> list[dict[str, Any]]:
        """The load spans that have ended (and forget them)."""
        done = [s for s in self.spans if s["end"] is not None]
        self.spans = [s for s in self.spans if s["end"] is None]
        return done

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


__all__ = ["AheadLoader"]
