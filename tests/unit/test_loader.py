"""The loader that runs ahead (``dhp.data.loader.AheadLoader``): samples decoded in background threads, handed
out once, errors re-raised by name in the caller, no wait without end."""

from __future__ import annotations

import threading
import time

import pytest

from dhp.data.loader import AheadLoader
from dhp.errors import DataError


class FakeData:
    """Records which thread loads what; sample 3 is a broken file; sample 9 never finishes in time."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, bool, str]] = []
        self.release = threading.Event()

    def get(self, i: int, pixels: bool = True) -> tuple[int, bool]:
        self.calls.append((i, pixels, threading.current_thread().name))
        if i == 3:
            raise DataError(f"data.jsonl sample {i}: image broken.png cannot be processed; fix or remove the file")
        if i == 9:
            self.release.wait(5)
        return i, pixels


def test_prefetched_samples_load_in_the_background_once() -> None:
    data = FakeData()
    loader = AheadLoader(data.get, workers=2)
    loader.prefetch(0, [1, 2])
    loader.prefetch(0, [2])  # asked twice: loaded once
    assert loader.take(1) == (1, True) and loader.take(2) == (2, True)
    assert sorted(i for i, _, _ in data.calls) == [1, 2]
    assert all(name.startswith("dhp-loader") for _, _, name in data.calls)
    assert loader.take(1) == (1, True)  # handed out once: a later step's sample is loaded again, here
    assert data.calls[-1][2] == threading.current_thread().name
    (span,) = loader.finished_spans()
    assert span["phase"] == "load" and span["round"] == 0 and span["start"] <= span["end"]
    loader.close()


def test_a_broken_sample_is_named_in_the_caller() -> None:
    loader = AheadLoader(FakeData().get, workers=1)
    loader.prefetch(1, [3])
    with pytest.raises(DataError, match="sample 3: image broken.png"):
        loader.take(3)
    loader.close()


def test_a_load_never_waits_without_end() -> None:
    data = FakeData()
    loader = AheadLoader(data.get, workers=1, timeout_s=0.2)
    loader.prefetch(0, [9])
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="sample 9: the background loader did not finish it within 0.2 s"):
        loader.take(9)
    assert time.perf_counter() - t0 < 3
    data.release.set()
    loader.close()


def test_the_text_side_prefetches_without_pixels_and_zero_workers_load_in_place() -> None:
    data = FakeData()
    text = AheadLoader(data.get, workers=1, pixels=False)
    text.prefetch(0, [4])
    assert text.take(4, pixels=False) == (4, False)
    assert data.calls == [(4, False, data.calls[0][2])] and data.calls[0][2].startswith("dhp-loader")
    off = AheadLoader(data.get, workers=0)
    off.prefetch(0, [5])  # nothing in the background
    assert off.take(5) == (5, True) and data.calls[-1][2] == threading.current_thread().name
    with pytest.raises(ValueError, match="data.loader_workers must be >= 0"):
        AheadLoader(data.get, workers=-1)
    text.close()
