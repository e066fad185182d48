"""The files a data set is stored in, read one sample at a time by its position: JSONL, a JSON list, parquet, an
Arrow file, and a directory written by HF ``datasets`` (``Dataset.save_to_disk``).

Why by position: a worker that parses a whole million-sample file to use the few samples of its rounds holds every
record in memory, in every process. A ``RecordFile`` instead knows where each sample is (the byte span of a JSON
line or list element, found once by ``scan`` and kept in the data set's index; the row of a parquet or Arrow file,
found from the file's own metadata) and reads one when asked: a worker's memory holds the index's arrays
(memory-mapped) and the rows it reads, not the data set.

A parquet row group is read whole (parquet's unit of reading) and the last one kept, per reader; write parquet with
row groups of a few hundred to a few thousand rows (HF ``datasets`` and most converters do). Arrow files (an HF
``datasets`` directory's, or one given alone) are memory-mapped: a row is a zero-copy slice.

``fingerprint`` identifies a file's contents for the index cache: its size, modification time and a hash of its
first and last bytes (a changed file changes one of them in practice; a media file replaced in place is caught
when it is decoded, by the grid it was validated with).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

from dhp.errors import DataError

HEAD_BYTES = 1 << 16  # bytes hashed at each end of a file by ``fingerprint``
SAVE_TO_DISK_STATE = "state.json"  # what HF datasets' save_to_disk writes beside its Arrow files
PARQUET_SUFFIXES = (".parquet", ".pq")
ARROW_SUFFIXES = (".arrow", ".feather", ".ipc")

Item = tuple[Any, str | None]  # (the parsed sample, or None; the problem found parsing it, or None)


def fingerprint(path: Path) -> str:
    """Size, modification time and a hash of the head and tail of ``path`` (a file, or every file of a directory)."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    digest = hashlib.sha256()
    for f in files:
        stat = f.stat()
        digest.update(f"{f.relative_to(path) if path.is_dir() else f.name}:{stat.st_size}:{stat.st_mtime_ns}"
                      .encode())
        with f.open("rb") as fh:
            digest.update(fh.read(HEAD_BYTES))
            if stat.st_size > 2 * HEAD_BYTES:
                fh.seek(-HEAD_BYTES, os.SEEK_END)
                digest.update(fh.read(HEAD_BYTES))
    return digest.hexdigest()[:32]


class RecordFile:
    """A data file's samples by position: ``len``, ``read(k)``; ``spans`` where the format needs them."""

    kind = ""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __len__(self) -> int:
        raise NotImplementedError

    def read(self, k: int) -> Item:
        """Sample ``k`` (0-based, in file order) parsed, or (None, the problem)."""
        raise NotImplementedError

    def read_range(self, start: int, stop: int) -> list[Item]:
        """Samples ``start`` to ``stop`` (what an index-building task reads)."""
        return [self.read(k) for k in range(start, stop)]

    def spans(self) -> np.ndarray | None:
        """Byte offsets of the samples (n + 1, the last the end) for the index, or None: rows address them."""
        return None

    def ranges(self, size: int) -> list[tuple[int, int]]:
        """The file's records as runs of about ``size`` (what the index build hands out, one per task)."""
        n = len(self)
        return [(lo, min(n, lo + size)) for lo in range(0, n, size)]


class JsonLines(RecordFile):
    """JSONL (one sample per non-blank line) or a JSON list (one sample per element), read by byte span."""

    kind = "json"

    def __init__(self, path: Path, spans: np.ndarray | None = None) -> None:
        super().__init__(path)
        self._spans = spans if spans is not None else scan_json(path)
        self._local = threading.local()

    def __len__(self) -> int:
        return len(self._spans) // 2

    def spans(self) -> np.ndarray:
        return self._spans

    def _handle(self) -> Any:
        fh = getattr(self._local, "fh", None)
        if fh is None:
            fh = self._local.fh = self.path.open("rb")
        return fh

    def read(self, k: int) -> Item:
        start, stop = int(self._spans[2 * k]), int(self._spans[2 * k + 1])
        fh = self._handle()
        fh.seek(start)
        return parse_json(fh.read(stop - start))

    def read_range(self, start: int, stop: int) -> list[Item]:
        if stop <= start:
            return []
        lo, hi = int(self._spans[2 * start]), int(self._spans[2 * stop - 1])
        with self.path.open("rb") as fh:
            fh.seek(lo)
            blob = fh.read(hi - lo)
        return [parse_json(blob[int(self._spans[2 * k]) - lo:int(self._spans[2 * k + 1]) - lo])
                for k in range(start, stop)]


def parse_json(raw: bytes) -> Item:
    try:
        return json.loads(raw.decode("utf-8")), None
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 text ({e}); fix the line's encoding"
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e}); fix the line"


def scan_json(path: Path) -> np.ndarray:
    """[start, stop] byte offsets of each sample of a JSONL file (non-blank lines) or JSON list (its elements),
    flat: 2 * n int64. Raises DataError for a file that is neither (naming the file and the fix)."""
    if not path.is_file():
        raise DataError(f"data file {path} does not exist; set data.path to a LLaVA JSON or JSONL file, a parquet "
                        "or Arrow file or an HF datasets directory (README: data forms)")
    data = path.read_bytes()
    if data.lstrip()[:1] == b"[":
        return _scan_list(path, data)
    starts, stops, pos = [], [], 0
    for line in data.splitlines(keepends=True):
        body = line.rstrip(b"\r\n")
        if body.strip():
            starts.append(pos)
            stops.append(pos + len(body))
        pos += len(line)
    spans = np.empty(2 * len(starts), dtype=np.int64)
    spans[0::2], spans[1::2] = starts, stops
    if len(starts) > 1 and parse_json(data[starts[0]:stops[0]])[1] is not None:  # maybe one object over lines
        try:
            whole = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError):
            whole = None
        if whole is not None:
            raise DataError(f"{path}: one JSON {type(whole).__name__} over several lines; give a JSON list of "
                            "samples ([{...}, {...}]) or JSONL (one sample per line)")
    return spans


def _scan_list(path: Path, data: bytes) -> np.ndarray:
    """The byte span of each element of a JSON list."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e}); data.path must be a JSON or JSONL file") from None
    decoder = json.JSONDecoder()
    ascii_only = len(text) == len(data)
    spans: list[int] = []
    pos = text.index("[") + 1
    byte_pos, char_pos = 0, 0
    try:
        while True:
            pos = _skip(text, pos)
            if text[pos] == "]":
                break
            _, end = decoder.raw_decode(text, pos)
            if ascii_only:
                spans += [pos, end]
            else:  # character offsets -> byte offsets, counted forward once
                byte_pos += len(text[char_pos:pos].encode())
                start = byte_pos
                byte_pos += len(text[pos:end].encode())
                char_pos = end
                spans += [start, byte_pos]
            pos = _skip(text, end)
            if text[pos] == ",":
                pos += 1
            elif text[pos] != "]":
                raise json.JSONDecodeError("expected ',' or ']'", text, pos)
    except (json.JSONDecodeError, IndexError) as e:
        raise DataError(f"{path}: not valid JSON ({e}); fix the file") from None
    return np.asarray(spans, dtype=np.int64)


def _skip(text: str, pos: int) -> int:
    while text[pos] in " \t\r\n":
        pos += 1
    return pos


class _Table(RecordFile):
    """Rows of Arrow data (parquet, HF datasets): row ``k`` as a dict of plain Python values."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._lock = threading.Lock()

    @staticmethod
    def _rows(table: Any) -> list[Item]:
        return [(row, None) for row in table.to_pylist()]


class Parquet(_Table):
    """One parquet file; a row group at a time."""

    kind = "parquet"

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        pq = _pyarrow_parquet(path)
        self._file = pq.ParquetFile(str(path))
        sizes = [self._file.metadata.row_group(g).num_rows for g in range(self._file.num_row_groups)]
        self._ends = np.cumsum(sizes, dtype=np.int64)
        self._cached: tuple[int, Any] | None = None

    def __len__(self) -> int:
        return int(self._ends[-1]) if len(self._ends) else 0

    def _group(self, g: int) -> Any:
        with self._lock:
            if self._cached is None or self._cached[0] != g:
                self._cached = None  # (the group kept before is dropped, and the pool's freed memory returned,
                _release_unused()  # before the next is read: a reader holds one group, not the groups it read)
                self._cached = (g, self._file.read_row_group(g))
            return self._cached[1]

    def read(self, k: int) -> Item:
        g = int(np.searchsorted(self._ends, k, side="right"))
        first = int(self._ends[g - 1]) if g else 0
        return self._rows(self._group(g).slice(k - first, 1))[0]

    def ranges(self, size: int) -> list[tuple[int, int]]:
        """Runs of whole row groups, up to ``size`` records each (a larger group alone, cut in runs of ``size``):
        each row group is then read by one task only, once."""
        out: list[tuple[int, int]] = []
        lo = prev = 0  # the run being gathered starts at lo; the group at hand is [prev, end)
        for end in (int(e) for e in self._ends):
            if end - prev > size:  # a large group: the run so far, then the group in pieces
                if prev > lo:
                    out.append((lo, prev))
                out += [(a, min(end, a + size)) for a in range(prev, end, size)]
                lo = end
            elif end - lo > size:  # this group would take the run past size: the run ends before it
                out.append((lo, prev))
                lo = prev
            prev = end
        if prev > lo:
            out.append((lo, prev))
        return out

    def read_range(self, start: int, stop: int) -> list[Item]:
        out: list[Item] = []
        k = start
        while k < stop:
            g = int(np.searchsorted(self._ends, k, side="right"))
            first = int(self._ends[g - 1]) if g else 0
            end = min(stop, int(self._ends[g]))
            out += self._rows(self._file.read_row_group(g).slice(k - first, end - k))
            k = end
        return out


class _ArrowTable(_Table):
    """Rows of Arrow tables memory-mapped whole (``self._table``): a row is a zero-copy slice."""

    kind = "arrow"
    _table: Any

    def __len__(self) -> int:
        return self._table.num_rows

    def read(self, k: int) -> Item:
        return self._rows(self._table.slice(k, 1))[0]

    def read_range(self, start: int, stop: int) -> list[Item]:
        return self._rows(self._table.slice(start, stop - start))


class ArrowDir(_ArrowTable):
    """A directory written by HF ``datasets`` ``save_to_disk``: ``state.json`` listing Arrow stream files."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        pa = _pyarrow(path)
        state = json.loads((path / SAVE_TO_DISK_STATE).read_text())
        names = [f["filename"] for f in state.get("_data_files", [])]
        if not names:
            raise DataError(f"{path}: {SAVE_TO_DISK_STATE} lists no data files; save the data set again with "
                            "Dataset.save_to_disk")
        tables = [read_arrow(pa, path / name) for name in names]
        self._table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]


class ArrowFile(_ArrowTable):
    """One Arrow file (``.arrow``, ``.feather``, ``.ipc``): an HF ``datasets`` cache or shard file (the IPC stream
    format), or the IPC file format (Feather v2) pyarrow and pandas write."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._table = read_arrow(_pyarrow(path), path)


def read_arrow(pa: Any, path: Path) -> Any:
    """The table of an Arrow IPC file, memory-mapped (zero-copy: the rows stay in the mapped file), in either IPC
    format: the stream (HF ``datasets``' files) or the file format (Feather v2)."""
    source = pa.memory_map(str(path), "r")
    try:
        return pa.ipc.open_stream(source).read_all()
    except pa.ArrowInvalid:
        source.seek(0)
    try:
        return pa.ipc.open_file(source).read_all()
    except pa.ArrowInvalid as e:
        raise DataError(f"{path}: not an Arrow IPC stream or file ({e}); give a JSON/JSONL, parquet or Arrow "
                        "file, or a save_to_disk directory") from None


def _release_unused() -> None:
    """Return the memory Arrow's allocator keeps after frees to the system (pyarrow >= 13; else nothing)."""
    import pyarrow as pa

    release = getattr(pa.default_memory_pool(), "release_unused", None)
    if release is not None:
        release()


def record_form(path: Path) -> str:
    """How ``path``'s records are stored, as ``open_records`` reads them: ``save_to_disk`` (a directory), ``parquet``,
    ``arrow`` (by the suffix), else ``json`` (JSONL or a JSON list). Part of the index's key: the same bytes read
    another way make another index."""
    if path.is_dir():
        return "save_to_disk"
    suffix = path.suffix.lower()
    return "parquet" if suffix in PARQUET_SUFFIXES else "arrow" if suffix in ARROW_SUFFIXES else "json"


def open_records(path: Path, spans: np.ndarray | None = None) -> RecordFile:
    """The reader of ``path`` by its form (``record_form``): a directory from ``save_to_disk``, a parquet or Arrow
    file, else JSON/JSONL."""
    form = record_form(path)
    if form == "save_to_disk":
        if (path / SAVE_TO_DISK_STATE).is_file():
            return ArrowDir(path)
        if (path / "dataset_dict.json").is_file():
            splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
            raise DataError(f"{path} holds several splits ({', '.join(splits)}); set data.path to one of them, "
                            f"e.g. {path / (splits[0] if splits else 'train')}")
        raise DataError(f"data.path {path} is a directory but not a data set saved by HF datasets (no "
                        f"{SAVE_TO_DISK_STATE}); give a JSON/JSONL or parquet file, or a save_to_disk directory")
    if form == "parquet":
        if not path.is_file():
            raise DataError(f"data file {path} does not exist; set data.path to an existing parquet file")
        return Parquet(path)
    if form == "arrow":
        if not path.is_file():
            raise DataError(f"data file {path} does not exist; set data.path to an existing Arrow file")
        return ArrowFile(path)
    return JsonLines(path, spans)


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow as pa
        import pyarrow.ipc  # noqa: F401
    except ImportError:
        raise DataError(f"{path}: reading parquet and HF datasets files needs pyarrow; pip install pyarrow") from None
    return pa


def _pyarrow_parquet(path: Path) -> Any:
    _pyarrow(path)
    import pyarrow.parquet as pq

    return pq


__all__ = ["ArrowDir", "JsonLines", "Parquet", "RecordFile", "fingerprint", "open_records", "scan_json"]
