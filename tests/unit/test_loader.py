"""The loader that runs ahead (``dhp.data.loader.AheadLoader``): samples decoded in background threads, handed
out once, errors re-raised by name in the caller, no wait without end; their tensors pinned in the background
(on CUDA) and copied to the device ``non_blocking`` (``pin_tensors``, ``to_device``)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
import torch

from dhp.data.loader import AheadLoader, cat_to_device, default_pin, pin_tensors, pinnable, to_device
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


@dataclass
class Media:
    """A sample's shape: tensors (one empty, as a sample without video has), and host metadata."""

    pixels: torch.Tensor
    grid: torch.Tensor
    name: str
    video: torch.Tensor = field(default_factory=lambda: torch.zeros(0, 1176))


class RecordingPin:
    """Stands in for ``Tensor.pin_memory`` (which needs CUDA): records what it is asked to pin."""

    def __init__(self) -> None:
        self.pinned: list[tuple[int, ...]] = []

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        self.pinned.append(tuple(t.shape))
        return t.clone()


def test_every_non_empty_host_tensor_is_pinned_in_the_background() -> None:
    pin = RecordingPin()
    sample = Media(torch.ones(4, 6), torch.zeros(0, 3, dtype=torch.long), "a.png")
    out = pin_tensors({"media": sample, "ids": [torch.arange(5)], "n": 3}, pin)
    assert sorted(pin.pinned) == [(4, 6), (5,)]  # the empty grid is not worth a pinned block
    assert out["n"] == 3 and out["media"].name == "a.png" and torch.equal(out["media"].pixels, sample.pixels)
    assert out["media"] is not sample and out["media"].pixels is not sample.pixels  # a new instance, the old kept
    assert pinnable(torch.ones(2)) and not pinnable(torch.ones(0)) and not pinnable(torch.ones(2, device="meta"))
    if default_pin() is None:  # no CUDA: nothing pinned, the object itself comes back
        assert not torch.cuda.is_available() and pin_tensors(sample) is sample
    # the background loader pins what it loaded, and only what it loaded ahead
    recorder = RecordingPin()

    def load(i: int, pixels: bool = True) -> Media:
        return Media(torch.ones(2, 8), torch.tensor([[1, 1, 2]]), f"{i}.png")

    loader = AheadLoader(load, workers=1, pin=recorder)
    loader.prefetch(0, [1])
    got = loader.take(1)
    assert isinstance(got, Media) and got.name == "1.png" and sorted(recorder.pinned) == [(1, 3), (2, 8)]
    assert got.video.shape == (0, 1176)  # no video: its empty tensor stays as it is, unpinned
    n = len(recorder.pinned)
    loader.take(2)  # loaded in the caller (not prefetched): not pinned
    assert len(recorder.pinned) == n
    loader.close()
    off = AheadLoader(load, workers=1, pin=False)
    assert off.pin is None
    off.close()


def test_to_device_copies_non_blocking_from_the_host_only(monkeypatch) -> None:
    calls: list[tuple[str, bool]] = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        calls.append((str(args[0]), kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to)
    sample = Media(torch.ones(2, 3), torch.tensor([[1, 1, 2]]), "b.png")
    out = to_device((sample, torch.arange(4)), "meta")  # a device other than the host's (no CUDA here)
    assert out[0].pixels.device.type == "meta" and out[1].device.type == "meta" and out[0].name == "b.png"
    assert calls == [("meta", True)] * 4  # pixels, grid, the empty video, the ids
    calls.clear()
    same = to_device(torch.ones(2), "cpu")  # to the host: never non_blocking (it could be read before it lands)
    assert same.device.type == "cpu" and calls == [("cpu", False)]


def test_a_batch_is_concatenated_into_pinned_memory_and_copied_non_blocking(monkeypatch) -> None:
    allocated: list[tuple[list[int], torch.dtype]] = []

    def empty(shape: list[int], dtype: torch.dtype) -> torch.Tensor:  # stands in for pinned memory (no CUDA here)
        allocated.append((shape, dtype))
        return torch.empty(shape, dtype=dtype)

    calls: list[bool] = []
    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        calls.append(kwargs.get("non_blocking", False))
        return real_to(self, *args, **kwargs)

    parts = [torch.zeros(0, 4), torch.ones(2, 4), 2 * torch.ones(3, 4)]
    host = cat_to_device(parts, "cpu")  # to the host: a plain concatenation
    assert torch.equal(host, torch.cat(parts)) and not allocated
    monkeypatch.setattr(torch.Tensor, "to", to)
    out = cat_to_device(parts, "meta", empty=empty)
    assert out.device.type == "meta" and out.shape == (5, 4) and calls == [True]
    assert allocated == [([5, 4], torch.float32)]
    frames = cat_to_device([torch.zeros(128, 0), torch.ones(128, 7)], "meta", dim=1, empty=empty)
    assert frames.shape == (128, 7) and allocated[-1] == ([128, 7], torch.float32)
