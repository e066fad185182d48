"""Several data files as one data set, each source with a weight: ``data.path="a.jsonl:0.3,shards/*.parquet:0.7"``.

Why: fine-tuning sets are mixes (LLaVA-665k beside a captioning set, a text-only
set kept in to hold language skills), and LLaMA-Factory (``mix_strategy``,
``interleave_probs``) and ms-swift (``dataset#N``) let a user say how much of
each. Here ``data.path`` is a comma-separated list of sources; a source is a
path or a glob (its files, sorted, are one source), with ``:WEIGHT`` after it
or not. Without weights the sources are concatenated. With weights (every
source then has one) the mixed set has as many samples as its sources
together, source ``s`` contributing ``weight_s / sum(weights)`` of them: a
source with fewer samples than its share is repeated (whole passes, then a
random subset of it), one with more is subsampled. The choice is drawn once
from ``data.mix_seed``, so it is the same in every process and at every
resume; the batch planner then shuffles the mixed set's ids per epoch as it
shuffles any data set's.

Each file keeps its own index (``dhp.data.index``) and its own sample numbers
in error messages (file, sample).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from dhp.data_path import check_sources, expand, is_mix, parse_sources  # the data.path syntax (a leaf)


def mixture(sizes: list[int], weights: list[float | None], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(source, sample within the source) of each sample of the mixed set (see the module docstring)."""
    total = sum(sizes)
    if weights[0] is None:
        counts = list(sizes)
    else:
        w = np.asarray(weights, dtype=np.float64)
        counts = np.floor(w / w.sum() * total).astype(int).tolist()
        rest = total - sum(counts)  # the largest remainders get one more
        order = np.argsort(-(w / w.sum() * total - counts), kind="stable")
        for s in order[:rest]:
            counts[s] += 1
    rng = np.random.default_rng(seed)
    src, local = [], []
    for s, (n, want) in enumerate(zip(sizes, counts, strict=True)):
        passes, extra = divmod(want, n)
        ids = np.concatenate([np.tile(np.arange(n), passes), np.sort(rng.choice(n, extra, replace=False))])
        src.append(np.full(len(ids), s, dtype=np.int32))
        local.append(ids.astype(np.int64))
    return np.concatenate(src), np.concatenate(local)


class MixedDataset:
    """Several ``SFTDataset``s (one per file; a source's files together) as one: the same interface, sample ids
    over the mix."""

    def __init__(self, sources: list[list[Any]], weights: list[float | None], seed: int, name: str) -> None:
        self.sources, self.weights, self.name = sources, weights, name
        self.parts = [ds for files in sources for ds in files]
        sizes = [sum(len(ds) for ds in files) for files in sources]
        self._src, self._local = mixture(sizes, weights, seed)
        self._first = np.cumsum([0] + [len(files) for files in sources])  # each source's first part
        self.skipped = [issue for ds in self.parts for issue in ds.skipped]
        self.file = Path(name)
        self.index_dir = None  # each file's index is found in the cache by the workers

    def __len__(self) -> int:
        return len(self._src)

    @property
    def num_skipped(self) -> int:
        return sum(ds.num_skipped for ds in self.parts)

    def locate(self, i: int) -> tuple[Any, int]:
        """(the file's data set, its sample) of mixed sample ``i``."""
        if not 0 <= i < len(self):
            raise IndexError(f"{self.name}: sample {i} out of range (the mix has {len(self)} samples)")
        s, j = int(self._src[i]), int(self._local[i])
        offsets = np.cumsum([0] + [len(ds) for ds in self.sources[s]])
        f = int(np.searchsorted(offsets, j, side="right")) - 1
        return self.sources[s][f], j - int(offsets[f])

    def describe(self) -> list[str]:
        """One line per source: its pattern, weight, files, good samples and samples in the mix."""
        patterns = [p for p, _ in parse_sources(self.name)]
        lines = []
        for s, files in enumerate(self.sources):
            weight = f" weight {self.weights[s]:g}," if self.weights[s] is not None else ""
            lines.append(f"source {s}: {patterns[s]}:{weight} {len(files)} file(s), {sum(len(d) for d in files)} "
                         f"good samples, {int((self._src == s).sum())} in the mix")
        return lines

    def source_of(self, i: int) -> int:
        """The source (its position in ``data.path``) of mixed sample ``i``."""
        return int(self._src[i])

    def lengths(self) -> list[int]:
        """Exact token count of every mixed sample (from the files' indexes)."""
        per = [np.asarray(ds.lengths(), dtype=np.int64) for ds in self.parts]
        out = []
        for s in range(len(self.sources)):  # (the mix's ids are grouped by source, in source order)
            mine = np.concatenate(per[self._first[s]:self._first[s + 1]])
            out.append(mine[self._local[self._src == s]])
        return np.concatenate(out).tolist()

    def info(self, i: int) -> Any:
        ds, j = self.locate(i)
        return replace(ds.info(j), index=i)

    def __getitem__(self, i: int) -> Any:
        return self.get(i)

    def get(self, i: int, pixels: bool = True) -> Any:
        ds, j = self.locate(i)
        sample = ds.get(j, pixels=pixels)
        sample.index = i
        return sample


__all__ = ["MixedDataset", "check_sources", "expand", "is_mix", "mixture", "parse_sources"]
