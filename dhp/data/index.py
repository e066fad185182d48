"""A data set's index: what validation found about every sample, as columns on disk, memory-mapped by every process.

Why: validating a million samples (parse, read every media header, count tokens) takes minutes, and the batch
planner needs its result (each sample's exact token count and media shapes) before the first step. Done at every
start, in one process, and kept as Python objects in every worker, it costs minutes and gigabytes. The index is
built once (``dhp.data.llava.build_index``, over a process pool), written under the cache
(``$DHP_CACHE/index``, default ``~/.cache/dhp/index``) keyed by the data's fingerprint and every setting that
changes what validation finds, and read back at the next start in the time it takes to map a few files. Every
process (driver, workers) maps the same files: their pages are shared, and a worker's memory does not grow with the
data set beyond them.

Columns (one entry per record of the file, in file order; ``.npy`` files):

* ``status`` int8: 0 good, 1 has a problem (listed in ``issues.json``: record, message);
* ``tokens`` int32: the exact token count of a good record (-1 otherwise): what the planner balances;
* ``kinds`` uint8: a bit per kind of media the record carries (``KINDS`` order);
* ``spans`` int64 [2n]: the byte span of each record in a JSON/JSONL file (absent for parquet/Arrow: rows);
* ``meta`` uint8 and ``meta_offsets`` int64 [n + 1]: per good record, the pickled (probe facts by kind, special
  token counts): the processor's media shapes (image grids, video frame plans, audio frames), opaque here.

``manifest.json`` holds the key's inputs (fingerprint, settings) so a stale or foreign index is never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dhp.storage import dhp_cache

KINDS = ("image", "video", "audio")  # bit k of the kinds column: the record carries KINDS[k]
FORMAT = 1  # bumped when the layout or the meaning of a column changes: older indexes are rebuilt
GOOD, BAD = 0, 1


def index_root() -> Path:
    """Where indexes are cached: ``$DHP_CACHE/index`` (default ``~/.cache/dhp/index``), beside the demo set and
    the copies of URL inputs."""
    return dhp_cache("index")


def stable(obj: Any) -> Any:
    """``obj`` as JSON-able values that do not depend on the process (no ids, sets sorted): what a key hashes."""
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, dict):
        return {str(k): stable(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [stable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return sorted(str(stable(v)) for v in obj)
    if hasattr(obj, "__dict__"):
        return {"type": f"{type(obj).__module__}.{type(obj).__qualname__}", **stable(vars(obj))}
    return repr(obj)


@dataclass
class SampleIndex:
    """The columns of one data file's validation (see the module docstring); ``directory``: where it is stored."""

    status: np.ndarray
    tokens: np.ndarray
    kinds: np.ndarray
    meta: np.ndarray
    meta_offsets: np.ndarray
    issues: list[tuple[int, str]]
    fingerprint: str
    spans: np.ndarray | None = None
    directory: Path | None = None
    transient: int = 0  # media whose fetch failed while it was built (not stored: such an index is not cached)

    def __len__(self) -> int:
        return len(self.status)

    def good(self) -> np.ndarray:
        """Record indices of the good records, in file order."""
        return np.flatnonzero(np.asarray(self.status) == GOOD)

    def meta_of(self, k: int) -> tuple[dict[str, tuple], dict[int, int]]:
        """(probe facts by kind, special token counts) of good record ``k``."""
        lo, hi = int(self.meta_offsets[k]), int(self.meta_offsets[k + 1])
        if lo == hi:
            return {}, {}
        return pickle.loads(self.meta[lo:hi].tobytes())

    def digest(self) -> str:
        """A hash of what the plan depends on (each record's status and token count): equal on two nodes that
        validated the same data."""
        h = hashlib.sha256(np.ascontiguousarray(self.status).tobytes())
        h.update(np.ascontiguousarray(self.tokens).tobytes())
        return h.hexdigest()[:32]

    def carrying(self, kind: str) -> np.ndarray:
        """Record indices of the records that carry media of ``kind``."""
        return np.flatnonzero(np.asarray(self.kinds) & (1 << KINDS.index(kind)))


def kinds_bits(media: dict[str, list]) -> int:
    return sum(1 << k for k, kind in enumerate(KINDS) if media.get(kind))


def pack_meta(blobs: list[bytes]) -> tuple[np.ndarray, np.ndarray]:
    """Per-record pickled blobs -> (one uint8 array, offsets [n + 1])."""
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    return np.frombuffer(b"".join(blobs), dtype=np.uint8), offsets


def save(index: SampleIndex, directory: Path, manifest: dict[str, Any]) -> Path:
    """Write ``index`` to ``directory`` atomically (a temporary folder renamed into place: a reader never sees a
    half-written index; two processes building the same one both succeed, one rename winning)."""
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = directory.parent / f".{directory.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    columns = {"status": index.status, "tokens": index.tokens, "kinds": index.kinds, "meta": index.meta,
               "meta_offsets": index.meta_offsets}
    if index.spans is not None:
        columns["spans"] = index.spans
    for name, array in columns.items():
        np.save(tmp / f"{name}.npy", np.ascontiguousarray(array))
    (tmp / "issues.json").write_text(json.dumps(index.issues))
    (tmp / "manifest.json").write_text(json.dumps({**manifest, "fingerprint": index.fingerprint, "format": FORMAT,
                                                   "records": len(index)}, indent=1))
    try:
        os.replace(tmp, directory)
    except OSError:  # another process put the same index there first
        shutil.rmtree(tmp, ignore_errors=True)
    index.directory = directory
    return directory


def load(directory: Path) -> SampleIndex | None:
    """The index stored in ``directory`` (its columns memory-mapped), or None when there is none or it is of
    another format."""
    manifest_file = directory / "manifest.json"
    if not manifest_file.is_file():
        return None
    try:
        manifest = json.loads(manifest_file.read_text())
        if manifest.get("format") != FORMAT:
            return None
        cols = {name: _mapped(directory / f"{name}.npy")
                for name in ("status", "tokens", "kinds", "meta", "meta_offsets")}
        spans_file = directory / "spans.npy"
        spans = _mapped(spans_file) if spans_file.is_file() else None
        issues = [(int(k), str(m)) for k, m in json.loads((directory / "issues.json").read_text())]
    except (OSError, ValueError):  # a damaged index: rebuilt
        return None
    return SampleIndex(**cols, issues=issues, fingerprint=manifest["fingerprint"], spans=spans, directory=directory)


def _mapped(file: Path) -> np.ndarray:
    """A column memory-mapped (an empty one, which cannot be mapped, read)."""
    try:
        return np.load(file, mmap_mode="r")
    except ValueError:
        return np.load(file)


def manifest_of(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "manifest.json").read_text())


__all__ = ["BAD", "FORMAT", "GOOD", "KINDS", "SampleIndex", "index_root", "kinds_bits", "load", "manifest_of",
           "pack_meta", "save", "stable"]
