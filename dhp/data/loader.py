"""A loader that runs ahead: the samples of the rounds a worker encodes next, decoded in background threads.

Why: an encoder rank otherwise decodes, resizes and patchifies its samples in
its own thread, at the start of each forward: the device waits for PIL. The
driver tells each encoder worker which samples its next round holds
(``prefetch``) before the current round's forward runs, and a thread pool
(``data.loader_workers`` threads; 0: load in the caller, as the reference does)
decodes them meanwhile; the language model's workers read their next round's
samples (no pixels) the same way. Each sample is decoded once per replica rank, and
handed out once (``take``): a sample of a later step is loaded again.

Media in an object store (``data.image_root=s3://...``, a URL in a record) are fetched here too: the data set's
``get`` opens each through fsspec (``dhp.storage.open_media``, one request bounded by ``data.media_timeout_s``), so
the background threads download a round's media while the current round computes; nothing is copied to disk.

Errors keep their names: a broken file raises the data set's own error (file,
sample, fix) from the pool, and ``take`` re-raises it in the worker's thread,
in the forward that needed the sample; a load never waits forever (``timeout_s``).

Host-to-device copies: on a CUDA machine the background threads also put each
sample's tensors in pinned (page-locked) host memory (``pin_tensors``), so that
the copy to the device (``to_device``, ``non_blocking=True``; a batch's pixels
concatenated straight into pinned memory by ``cat_to_device``) is a DMA the host
does not wait for: the kernels that consume the data are queued behind it on the
same stream while it runs. Pageable memory would make every such copy a staged,
synchronous one. Without CUDA nothing is pinned (``pin_memory`` needs a device)
and ``to_device`` is a plain copy: the same code path runs on the CPU.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

LOAD_TIMEOUT_S = 600.0
Pin = Callable[[torch.Tensor], torch.Tensor]


def pinnable(t: torch.Tensor) -> bool:
    """Whether ``t`` is worth pinning: a non-empty tensor in pageable host memory."""
    return t.device.type == "cpu" and t.numel() > 0 and not t.is_pinned()


def default_pin() -> Pin | None:
    """``torch.Tensor.pin_memory`` where CUDA is available (it needs a device), else None: nothing is pinned."""
    return torch.Tensor.pin_memory if torch.cuda.is_available() else None


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it: a tensor, a dataclass (a ``Sample``, a ``Batch``; a
    new instance, the original untouched), a dict, list or tuple of those; anything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: map_tensors(getattr(obj, f.name), fn) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    if isinstance(obj, dict):
        return {k: map_tensors(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def pin_tensors(obj: Any, pin: Pin | None = None) -> Any:
    """``obj`` (see ``map_tensors``) with each of its ``pinnable`` tensors pinned by ``pin`` (default:
    ``default_pin()``); ``obj`` itself where there is nothing to pin with (no CUDA)."""
    pin = pin or default_pin()
    if pin is None:
        return obj
    return map_tensors(obj, lambda t: pin(t) if pinnable(t) else t)


def cat_to_device(parts: list[torch.Tensor], device: str | torch.device, dim: int = 0,
                  empty: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """``torch.cat(parts, dim)`` on ``device`` (a batch's pixels or audio frames, from its samples' tensors): on
    CUDA the host parts are concatenated straight into pinned memory (``empty``: how it is allocated, default
    ``torch.empty(..., pin_memory=True)``) and copied ``non_blocking``; a single part the loader already pinned
    goes as it is. To the host, or without CUDA, a plain concatenation."""
    from dhp.ops.attention import has_values

    device = torch.device(device)
    if device.type == "cpu" or (empty is None and not torch.cuda.is_available()) \
            or not all(has_values(p) for p in parts):  # (the planner's fake tensors: nothing to pin)
        return torch.cat(parts, dim).to(device)
    filled = [p for p in parts if p.numel()]
    if len(filled) == 1 and filled[0].is_pinned() and filled[0].shape == torch.cat(parts, dim).shape:
        host = filled[0]
    else:
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        dtype = parts[0].dtype
        for p in parts[1:]:
            dtype = torch.promote_types(dtype, p.dtype)
        host = (empty or _pinned_empty)(shape, dtype=dtype)
        torch.cat(parts, dim, out=host)
    return host.to(device, non_blocking=True)


def _pinned_empty(shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def to_device(obj: Any, device: str | torch.device) -> Any:
    """``obj`` (see ``map_tensors``) with every tensor on ``device``: host-to-device copies are issued
    ``non_blocking`` (from pinned memory the host does not wait; from pageable memory CUDA copies
    synchronously, as a plain copy would), so call it ahead of the compute that needs the tensors."""
    device = torch.device(device)
    return map_tensors(obj, lambda t: t.to(device, non_blocking=t.device.type == "cpu" and device.type != "cpu"))


class AheadLoader:
    """Loads samples by id in ``workers`` background threads; ``take`` returns them (or loads them itself)."""

    def __init__(self, load: Callable[..., Any], workers: int, pixels: bool = True,
                 timeout_s: float = LOAD_TIMEOUT_S, pin: Pin | bool = True) -> None:
        """``load(i, pixels=...)``: the data set's ``get``; ``pixels``: what the prefetched samples carry (the
        language model's worker prefetches placeholders and grids only, ``pixels=False``); ``pin``: how the
        background pins a loaded sample's tensors: True, ``default_pin()`` (on CUDA machines only); False,
        never (samples whose tensors are packed into new ones before any copy)."""
        if workers < 0:
            raise ValueError(f"data.loader_workers must be >= 0, got {workers}")
        self.load, self.timeout_s, self.pixels = load, timeout_s, pixels
        self.pin: Pin | None = default_pin() if pin is True else (pin or None)
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
                sample = self.load(i, pixels=self.pixels)
                return pin_tensors(sample, self.pin) if self.pin is not None else sample
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


__all__ = ["AheadLoader", "cat_to_device", "default_pin", "map_tensors", "pin_tensors", "pinnable", "to_device"]
