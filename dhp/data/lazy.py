"""``data.validate=lazy``: the index from media headers at the start, every medium read through in the background.

Why: reading a million images through before the first step takes the better part of an hour; their headers take
seconds, and headers are all the batch planner needs (token counts and media shapes). ``lazy`` builds the index as
``headers`` does and reads each sample's media through (``Media.probe``, what ``full`` runs while it builds the
index) on a few threads of the driver, in the order the plan consumes the samples, ``LOOKAHEAD_STEPS`` steps ahead
of training. Before step ``s`` is planned every sample of ``s`` has been read (the driver waits for those samples
only, normally long done, never more than ``WAIT_S`` for one). A sample that fails:

* under ``data.on_error=raise`` stops the run before step ``s`` with a ``DataError`` naming the file, the sample
  and the fix; the checkpoints written so far stay;
* under ``data.on_error=skip`` is replaced, in step ``s`` only, by a substitute: the first good sample, not already
  in the step, from a position drawn from (seed, step, the bad sample's id). The step keeps its size, so every
  group's plan is balanced over the same ids, and the plan stays a function of (seed, epoch, step) and of the
  data's content, never of timing: layout parity and exact resume hold. The sample is named once, when its step
  is reached, and counted in the step's metrics and the run's summary.

The plan is made in one place, the driver (``LazyPlanner.plan``, which ``dhp.train`` calls for every step); the
backends and their workers receive it and never plan, so every group runs the same substituted plan.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from dhp.data.llava import DataIssue, SFTDataset, opened
from dhp.data.processor import Media
from dhp.data.sampler import BatchPlanner, StepPlan
from dhp.errors import DataError, DhpError

LOOKAHEAD_STEPS = 16  # the steps ahead of training whose samples are read in the background
WAIT_S = 600.0  # the longest the driver waits for one sample's media to be read before it stops the run
MAX_THREADS = 8  # reader threads at most (PIL releases the GIL while it decodes; more threads add little)
UNKNOWN, QUEUED, GOOD, BAD, FAILED = range(5)  # a sample's state in the reader


def record_of(dataset: Any, i: int) -> tuple[SFTDataset, int]:
    """(the file's data set, its record) of sample ``i`` of ``dataset`` (one file, or a mix of files)."""
    locate = getattr(dataset, "locate", None)
    if locate is not None:  # a mix (dhp.data.mix.MixedDataset)
        ds, j = locate(i)
        return ds, ds.source_index(j)
    return dataset, dataset.source_index(i)


def read_through(dataset: Any, i: int) -> DataIssue | None:
    """Sample ``i``'s media read through as ``data.validate=full`` reads them (``Media.probe``), each checked
    against the shape its header gave the index; the problem found, or None. Kinds whose probe reads headers only
    (no ``probe_header`` of their own) were read in full by the index already and are not read again."""
    ds, k = record_of(dataset, i)
    rec = ds.record(k)
    if rec.problem:  # (the file changed since its index was built)
        return DataIssue(str(ds.file), k, rec.problem)
    facts, _ = ds.index.meta_of(k)
    for kind, items in rec.media.items():
        media = ds.processor.kind(kind)
        if not items or media is None or type(media).probe_header is Media.probe_header:
            continue
        for source, fact in zip(items, facts.get(kind, ()), strict=True):
            try:
                found = media.probe(opened(source, timeout_s=ds.media_timeout_s))
            except (OSError, ValueError) as e:
                return DataIssue(str(ds.file), k, str(e) if str(source) in str(e) else f"{kind} {source}: {e}")
            if found != fact:
                return DataIssue(str(ds.file), k, f"{kind} {source} changed since it was indexed ({found}, {fact} "
                                                  "before); start once with data.index_cache=false")
    return None


class Reader:
    """Reads samples through (``read_through``) on daemon threads, in the order they are asked for, and keeps what
    it found: a state per sample (one byte) and the problems of the bad ones."""

    def __init__(self, dataset: Any, threads: int, wait_s: float = WAIT_S) -> None:
        self.dataset, self.n_threads, self.wait_s = dataset, max(1, threads), wait_s
        self.state = np.zeros(len(dataset), np.int8)
        self.found: dict[int, DataIssue | BaseException] = {}
        self._cond = threading.Condition()
        self._queue: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._closed = threading.Event()

    def submit(self, ids: Sequence[int]) -> None:
        """Queue the samples of ``ids`` not yet read or queued (the threads start on the first call)."""
        with self._cond:
            new = [i for i in ids if self.state[i] == UNKNOWN]
            self.state[new] = QUEUED
        if self._closed.is_set():  # (closed: nothing runs in the background any more)
            return
        if new and not self._threads:
            self._threads = [threading.Thread(target=self._work, name=f"dhp-lazy-read-{t}", daemon=True)
                             for t in range(self.n_threads)]
            for t in self._threads:
                t.start()
        for i in new:
            self._queue.put(i)

    def _work(self) -> None:
        while (i := self._queue.get()) is not None and not self._closed.is_set():
            self._read(i)

    def _read(self, i: int) -> None:
        try:
            issue = read_through(self.dataset, i)
            state = GOOD if issue is None else BAD
        except Exception as e:  # noqa: BLE001 - the reader's own failure: raised where the sample is waited for
            issue, state = e, FAILED
        with self._cond:
            self.state[i] = state
            if issue is not None:
                self.found[i] = issue
            self._cond.notify_all()

    def problems(self, ids: Sequence[int]) -> dict[int, DataIssue]:
        """The problems of the bad samples of ``ids``, once every one of them is read (queued first if need be).
        Samples not all read within ``wait_s`` seconds stop the run naming one; the reader's own error is raised."""
        self.submit(ids)
        if self._closed.is_set():
            for i in ids:
                if self.state[i] < GOOD:
                    self._read(i)
        deadline = time.monotonic() + self.wait_s
        with self._cond:
            for i in ids:  # (waits for these samples only)
                if not self._cond.wait_for(lambda i=i: self.state[i] >= GOOD, deadline - time.monotonic()):
                    ds, k = record_of(self.dataset, i)
                    raise DataError(f"{ds.file} sample {k}: its media were not read within {self.wait_s:g} s "
                                    "(data.validate=lazy reads them before its step): a hung or very slow file "
                                    "system? Check the files, or start with data.validate=full")
        for i in ids:
            if self.state[i] == FAILED:
                error = self.found[i]
                if isinstance(error, DhpError):
                    raise error
                ds, k = record_of(self.dataset, i)
                raise RuntimeError(f"reading {ds.file} sample {k} through failed: {type(error).__name__}: "
                                   f"{error}") from error
        return {i: self.found[i] for i in ids if self.state[i] == BAD}

    def is_good(self, i: int) -> bool:
        """Whether sample ``i`` reads through; read now, in this thread, when it is not known yet."""
        if self.state[i] < GOOD:
            self._read(i)
        return not self.problems([i])

    def close(self) -> None:
        """Stop the threads, the samples still queued left unread (read in the caller if asked for later)."""
        self._closed.set()
        for _ in self._threads:
            self._queue.put(None)
        self._threads = []


class LazyPlanner:
    """A ``BatchPlanner`` whose ``plan(step)`` returns a step whose samples all read through (see the module
    docstring): it raises, or replaces each bad sample by a deterministic substitute. Every other attribute is the
    planner's."""

    def __init__(self, planner: BatchPlanner, dataset: Any, on_error: str, threads: int, steps: int,
                 log: Callable[[str], None] | None = None) -> None:
        self.planner, self.dataset, self.on_error, self.steps = planner, dataset, on_error, steps
        self.reader = Reader(dataset, threads)
        self.skipped: dict[int, DataIssue] = {}  # sample id -> its problem, for the samples skipped so far
        self._log = log or (lambda line: print(line, flush=True))
        self._ahead = -1  # the last step whose samples were queued

    def __getattr__(self, name: str) -> Any:
        if name == "planner":  # (not set yet)
            raise AttributeError(name)
        return getattr(self.planner, name)

    def plan(self, step: int) -> StepPlan:
        _, ids = self.planner.step_ids(step)
        self.reader.submit(ids)
        self._look_ahead(step)
        bad = self.reader.problems(ids)
        if not bad:
            return self.planner.plan(step)
        if self.on_error == "raise":
            raise DataError(_raise_message(step, [bad[i] for i in ids if i in bad]), list(bad.values()))
        return self.planner.plan(step, self._substituted(step, ids, bad))

    def _look_ahead(self, step: int) -> None:
        """Queue the samples of the next ``LOOKAHEAD_STEPS`` steps (of the run's) not yet queued, in plan order."""
        for ahead in range(max(step + 1, self._ahead + 1), min(step + LOOKAHEAD_STEPS, self.steps - 1) + 1):
            self.reader.submit(self.planner.step_ids(ahead)[1])
            self._ahead = ahead

    def _substituted(self, step: int, ids: list[int], bad: dict[int, DataIssue]) -> list[int]:
        """``ids`` with each bad sample replaced (``substitute``), each named the first time its step is reached."""
        out, taken = list(ids), set(ids)
        for pos, i in enumerate(ids):
            if i not in bad:
                continue
            sub = self.substitute(step, i, taken)
            taken.add(sub)
            out[pos] = sub
            if i not in self.skipped:
                self.skipped[i] = bad[i]
                ds, k = record_of(self.dataset, sub)
                self._log(f"dhp: step {step + 1}: skipped {bad[i]} (data.validate=lazy, data.on_error=skip); "
                          f"its place in the step goes to {ds.file} sample {k}")
        return out

    def substitute(self, step: int, bad: int, taken: set[int]) -> int:
        """The sample that takes bad sample ``bad``'s place in ``step``: from a position drawn from (seed, step,
        ``bad``), the first sample on (cyclically) that is not in ``taken`` and reads through."""
        n = len(self.dataset)
        digest = hashlib.blake2b(f"{self.planner.seed}/{step}/{bad}".encode(), digest_size=8).digest()
        start = int.from_bytes(digest, "little") % n
        for c in range(start, start + n):
            if c % n not in taken and self.reader.is_good(c % n):
                return c % n
        raise DataError(f"{self.dataset.file}: step {step + 1} needs a sample in place of a bad one, and every other "
                        "sample is bad or already in the step; fix the data")

    def close(self) -> None:
        self.reader.close()


def _raise_message(step: int, issues: list[DataIssue]) -> str:
    head = (f"{issues[0]}; found before step {step + 1} (data.validate=lazy reads each sample's media through "
            "before its step): fix the file, or set data.on_error=skip to leave such samples out")
    return "\n".join([head, *(str(i) for i in issues[1:])])


def lazy_planner(planner: BatchPlanner, dataset: Any, cfg: Any) -> BatchPlanner | LazyPlanner:
    """The run's planner: ``planner`` itself unless ``data.validate=lazy`` (``cfg``: the run's config)."""
    if cfg.data.validate != "lazy":
        return planner
    threads = min(MAX_THREADS, int(cfg.data.index_workers) or os.cpu_count() or 1)
    return LazyPlanner(planner, dataset, cfg.data.on_error, threads, cfg.train.steps)


def read_in_full(spec: Any) -> Any:
    """A ``DatasetSpec`` read in full when it is opened (``data.validate=full`` in place of lazy): for a data set
    read outside the training steps, e.g. the held-out set evaluated at the end, whose samples no plan reaches."""
    if spec.data_cfg.validate != "lazy":
        return spec
    return replace(spec, data_cfg=replace(spec.data_cfg, validate="full"))


__all__ = ["LOOKAHEAD_STEPS", "WAIT_S", "LazyPlanner", "Reader", "lazy_planner", "read_in_full", "read_through",
           "record_of"]
