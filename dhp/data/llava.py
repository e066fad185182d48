"""Supervised fine-tuning data (JSON list or JSONL, one sample each), checked before the first step.

Accepted sample forms (README, "Data forms"): LLaVA (``conversations`` of
``from``/``value`` turns with ``<image>`` tags, ``image``/``images``);
chat ``messages`` of ``role``/``content`` with ``<image>`` tags and ``images``
(LLaMA-Factory's ShareGPT style); and the HF chat-content form, where
``content`` is a list of ``{"type": "text", "text": ...}`` and
``{"type": "image"}`` parts (transformers' chat templates, TRL), an image part
taking the next entry of ``images`` or naming its own file (``image``,
``path``, ``url``, ``image_url``). Media are local files or object-store URLs (``s3://``, ``gs://``...);
relative paths are relative to ``data.image_root`` (a folder or a URL prefix; default: the data file's folder,
for a data file read from a URL the folder it was read from); in parquet and
HF ``datasets`` rows (``dhp.data.sources``) an image may also be the bytes of an
HF Image struct (``{"bytes": ..., "path": ...}``).

Videos (``docs/video.md``) work the same way: ``<video>`` tags (or ``{"type":
"video"}`` parts) and a ``video`` (one clip) or ``videos`` (a list of clips)
entry, each clip a video file (mp4, webm, avi) or a list of frame images.
Audio (``docs/audio.md``) too: ``<audio>`` tags (or ``{"type": "audio"}``
parts) and an ``audio`` or ``audios`` entry of WAV/FLAC/OGG files.

What a medium becomes (its token count, its model inputs, the position ids of
the sequence) is the model family's: its processor (``dhp.data.processor``),
which this module calls and never second-guesses. This module owns the forms,
the checks and the error reports.

Why a pre-flight check: a broken sample found at step 10,000 of a multi-node
run wastes the run. ``SFTDataset`` validates every sample when it is built
(files exist and decode, ``<image>`` count matches the images, roles are known,
an assistant turn exists, the exact token count fits ``data.max_length``) and
either raises one ``DataError`` listing every problem or, with
``data.on_error=skip``, drops those samples and records why. Token counts come
from media headers only (no pixel decoding), so batch plans are exact and cheap.

What validation finds is the file's index (``dhp.data.index``): built once per file and settings (over a process
pool for a large file: ``build_index``), cached (``cached_index``), memory-mapped by every process; a sample's
record is read from the file when it is asked for (``SFTDataset.record``), so no process holds the parsed file.
"""

from __future__ import annotations

import hashlib
import io
import json
import multiprocessing
import os
import pickle
import sys
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dhp.config import DataConfig
from dhp.data import index
from dhp.data.batch import Sample
from dhp.data.processor import TAGS, Processor
from dhp.data.sources import RecordFile, fingerprint, open_records, record_form
from dhp.data.tokenizer import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Tokenizer
from dhp.errors import DataError
from dhp.models.spec import SampleInfo
from dhp.progress import Progress
from dhp.storage import MEDIA_TIMEOUT_S, AnyPath, UrlPath, is_remote, media_exists, media_ref, media_root, open_media

LLAVA_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
MESSAGE_ROLES = ("system", "user", "assistant")
MAX_LISTED_ISSUES = 20
LONGER_THAN = "tokens, longer than data.max_length"
PROGRESS_AFTER_S = 2.0  # validation that takes longer than this shows its progress


@dataclass(frozen=True)
class DataIssue:
    file: str
    index: int  # the sample's position in the file (0-based)
    message: str  # what is wrong and how to fix it

    def __str__(self) -> str:
        return f"{self.file} sample {self.index}: {self.message}"


class UnreadMedia(DataError):
    """The data carries a kind of media the model family's processor does not read (audio for a vision model)."""

    def __init__(self, message: str, file: Path, kind: str, samples: list[int]) -> None:
        super().__init__(message)
        self.file, self.kind, self.samples = file, kind, samples  # the media kind, the samples that carry it


@dataclass
class _Record:
    """One sample of the file, normalised: chat messages and absolute image paths."""

    index: int
    messages: list[dict[str, str]]
    images: list[AnyPath]  # a local path or a URL (``dhp.storage.UrlPath``), or inline bytes
    problem: str | None = None  # a structural problem found while parsing
    videos: list[AnyPath | list[AnyPath]] = field(default_factory=list)  # a file, or a list of frame images
    audios: list[AnyPath] = field(default_factory=list)
    parts: bool = False  # HF chat content: media given as {"type": "image"} parts, not <image> tags

    @property
    def media(self) -> dict[str, list]:
        """The sample's media items by kind, in order of appearance."""
        return {"image": self.images, "video": self.videos, "audio": self.audios}


@dataclass(frozen=True)
class ValidationResult:
    num_records: int
    lengths: dict[int, int]  # record index -> exact token count (good records)
    issues: list[DataIssue]
    facts: dict[int, dict[str, tuple]] = field(default_factory=dict)  # record -> {kind: the processor's probe facts}
    token_counts: dict[int, dict[int, int]] = field(default_factory=dict)  # record -> {special token id: count}


class _Checker:
    """The checks of one record (structure, media headers, exact token count): what validation runs per sample, in
    the process that opened the data set or in a worker of the index-building pool."""

    file: Path
    image_root: AnyPath  # a local folder or a URL prefix
    cfg: DataConfig
    tokenizer: Tokenizer
    processor: Processor

    def _check(self, rec: _Record) -> tuple[list[str], int, dict[str, tuple], dict[int, int]]:
        """(problems, exact token count, the processor's probe facts by kind, special token counts) of ``rec``."""
        if rec.problem:
            return [rec.problem], -1, {}, {}
        problems = _check_conversation(rec)
        facts: dict[str, tuple] = {}
        for kind, items in rec.media.items():
            if self.processor.kind(kind) is None:
                if items:  # (reported for the whole file first: UnreadMedia)
                    problems.append(f"carries {kind}, which the {self.processor.family} processor does not read")
                continue
            found = []
            for source in items:
                fact, problem = self._probe(kind, source)
                if problem:
                    problems.append(problem)
                found.append(fact)
            if found:
                facts[kind] = tuple(found)
        if problems:
            return problems, -1, {}, {}
        ids = self.tokenizer.conversation_ids(rec.messages, self.processor.blocks(facts))
        special = self._special_ids()
        counts = {t: n for t, n in Counter(ids).items() if t in special}
        if len(ids) > self.cfg.max_length:
            hints = "".join(f"{self.processor.kind(k).shrink_hint()}, " for k in facts)
            return [f"{len(ids)} {LONGER_THAN}={self.cfg.max_length} (samples are never "
                    f"truncated); raise data.max_length, {hints}or shorten the sample"], -1, {}, {}
        return [], len(ids), facts, counts

    def _probe(self, kind: str, source: Any) -> tuple[Any, str | None]:
        """The processor's fact of one media item from its header, or a problem naming the file and the fix. A
        medium in an object store is fetched now (its first block for a header, all of it for ``full``)."""
        files = source if isinstance(source, list) else [source]
        frame = "frame " if isinstance(source, list) else ""
        handle = None
        try:
            for f in files[1:]:  # (the first is found missing when it is opened below; later frames by a stat/HEAD)
                if not isinstance(f, InlineMedia) and not media_exists(f, self.media_timeout_s):
                    return None, self._missing(kind, frame, f)
            media = self.processor.kind(kind)
            probe = media.probe if self.cfg.validate == "full" else media.probe_header  # (lazy: as headers)
            handle = opened(source, whole=self.cfg.validate == "full", timeout_s=self.media_timeout_s)
            return probe(handle), None
        except Exception as e:
            first = files[0]
            if not isinstance(first, InlineMedia) and not is_remote(first) and not media_exists(first):
                return None, self._missing(kind, frame, first)  # (looked for only when its probe failed)
            if isinstance(e, (OSError, ValueError)):
                return None, self._unusable(kind, frame, source, e, handle)
            raise

    def _unusable(self, kind: str, frame: str, source: Any, e: Exception, handle: Any) -> str:
        """The problem of a medium that raised ``e`` when probed (``handle``: what it was opened as, if it was)."""
        files = source if isinstance(source, list) else [source]
        remote = is_remote(files[0])
        if remote and isinstance(e, FileNotFoundError) and e.filename:
            return self._missing(kind, frame, e.filename)
        failed = _failure(handle)
        if failed is not None or (remote and handle is None and isinstance(e, OSError)):
            self.transient += 1  # (a failed request, not a bad medium: this index is not cached)
            return (f"{kind} {_name(source)} could not be fetched ({failed or e}); it is left out of this start's "
                    "index only, so check the storage and start again")
        return str(e) if str(files[0]) in str(e) else f"{kind} {_name(source)}: {e}"

    transient = 0  # media whose fetch failed (timeouts, connections) since this checker was made
    _special: frozenset[int] | None = None

    def _special_ids(self) -> frozenset[int]:
        """The tokenizer's special ids (asked for once per checker: the tokenizer builds the list at each call)."""
        if self._special is None:
            self._special = frozenset(self.tokenizer.special_ids())
        return self._special

    @property
    def media_timeout_s(self) -> float:
        return float(getattr(self.cfg, "media_timeout_s", MEDIA_TIMEOUT_S))

    def _missing(self, kind: str, frame: str, f: Any) -> str:
        return f"{kind} {frame}file {f} does not exist; fix the path (relative to {self.image_root}) or add it"

    def _check_range(self, records: RecordFile, start: int, stop: int, progress: Progress | None = None) -> _Chunk:
        """The index columns of records ``start`` to ``stop`` (``progress``: told of each record)."""
        n = stop - start
        chunk = _Chunk(np.full(n, index.BAD, np.int8), np.full(n, -1, np.int32), np.zeros(n, np.uint8), [], [])
        transient = self.transient
        for j, (item, err) in enumerate(records.read_range(start, stop)):
            rec = _record(start + j, item, err, self.image_root)
            chunk.kinds[j] = index.kinds_bits(rec.media)
            problems, n_tokens, facts, counts = self._check(rec)
            if progress is not None:
                progress.update()
            if problems:
                chunk.issues += [(rec.index, p) for p in problems]
                chunk.meta.append(b"")
                continue
            chunk.status[j], chunk.tokens[j] = index.GOOD, n_tokens
            chunk.meta.append(pickle.dumps((facts, counts), protocol=pickle.HIGHEST_PROTOCOL))
        chunk.transient = self.transient - transient
        return chunk


@dataclass
class _Chunk:
    """The index columns of a run of records, as one pool task returns them."""

    status: np.ndarray
    tokens: np.ndarray
    kinds: np.ndarray
    meta: list[bytes]
    issues: list[tuple[int, str]]
    transient: int = 0  # media whose fetch failed for another reason than their content (the index is not cached)


class SFTDataset(_Checker):
    """LLaVA-style SFT samples -> ``Sample`` (ids, labels, positions, media by the family's processor); indexes
    only good samples. What validation found is the data set's index (``dhp.data.index``), built once and cached;
    a sample's record is read from the file when it is asked for."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, path: str | Path | None = None,
                 validated: ValidationResult | None = None, *, processor: Processor,
                 index_dir: str | Path | None = None, index_digest: str | None = None) -> None:
        """``processor``: the model family's (``Family.processor``): what media become. ``validated``: the outcome
        of validating this same file (``self.validation``), e.g. from the driver, so that workers opening the data
        set do not read every media header again; ``index_dir``: the same as a stored index (``self.index_dir``),
        memory-mapped; where this process does not see that folder, its own index must have ``index_digest`` (the
        driver's ``self.index.digest()``)."""
        path = path if path is not None else cfg.path
        if path is None:
            raise DataError("data.path: set it to a training data file (a JSON list or JSONL file, a parquet or "
                            "Arrow file or an HF datasets directory; README: data forms)")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.processor = processor
        self.file = Path(path)
        self.image_root = media_root(cfg.image_root, self.file)
        self.index = self._open_index(validated, index_dir, index_digest)
        self._file_records = open_records(self.file, self.index.spans)
        self._records = _Records(self)
        self._check_kinds()
        issues = [DataIssue(str(self.file), k, m) for k, m in self.index.issues]
        if issues and cfg.on_error == "raise":
            raise DataError(_summary(self.file, issues, self.image_root, cfg, len(self.index)), issues)
        self.skipped = issues
        self._shift = _bad_shift(self.index)
        self._n_good = len(self.index) - len(self._shift)
        if not self._n_good:
            if not len(self.index):
                raise DataError(f"data file {self.file} holds no samples (it is empty); give a JSON list or JSONL "
                                "file with one sample per line (README: data forms)")
            raise DataError(_summary(self.file, issues, self.image_root, cfg, len(self.index), skipping=True),
                            issues)

    def _open_index(self, validated: ValidationResult | None, index_dir: str | Path | None,
                    digest: str | None) -> index.SampleIndex:
        if validated is not None:
            n = len(open_records(self.file))
            if validated.num_records != n:
                raise DataError(f"{self.file} changed since it was validated: {n} records, "
                                f"{validated.num_records} before")
            return _from_validation(validated, self.file)
        if index_dir is not None and Path(index_dir).is_dir():
            stored = index.load(Path(index_dir))
            if stored is None or stored.fingerprint != fingerprint(self.file):
                n = len(stored) if stored is not None else "?"
                raise DataError(f"{self.file} changed since it was validated (its index {index_dir} holds {n} "
                                "records of another version of the file); restart the run so that it is validated "
                                "again")
            return stored
        built = cached_index(self)  # (a node that does not see the driver's cache: its own index, checked below)
        if digest is not None and built.digest() != digest:
            raise DataError(f"{self.file} on this node is not the file the driver validated (another number of "
                            "good samples or other token counts); give every node the same data, or set DHP_CACHE to "
                            "a folder every node shares")
        return built

    @property
    def index_dir(self) -> Path | None:
        """Where the data set's index is stored (hand it to another process opening the same file), or None."""
        return self.index.directory

    def _check_kinds(self) -> None:
        """Every kind of media in the file is one the processor reads (else its tags would be plain text)."""
        for kind in TAGS:
            if self.processor.kind(kind) is not None:
                continue
            carrying = self.index.carrying(kind)
            if len(carrying):
                raise UnreadMedia(f"{self.file}: {len(carrying)} sample(s) carry {kind} (the first: sample "
                                  f"{carrying[0]}) but the {self.processor.family} processor reads no {kind}; use a "
                                  f"model family with a {kind} encoder, or drop the {kind}", self.file, kind,
                                  [int(k) for k in carrying])

    @property
    def validation(self) -> ValidationResult:
        """What validation found, as Python objects (``index_dir`` hands the same to another process for less)."""
        good = [int(k) for k in self.index.good()]
        meta = {k: self.index.meta_of(k) for k in good}
        return ValidationResult(len(self.index), {k: int(self.index.tokens[k]) for k in good}, list(self.skipped),
                                {k: m[0] for k, m in meta.items()}, {k: m[1] for k, m in meta.items()})

    # ---- indexing ---------------------------------------------------------------------
    def __len__(self) -> int:
        return self._n_good

    @property
    def num_skipped(self) -> int:
        return len({issue.index for issue in self.skipped})

    def source_index(self, i: int) -> int:
        """Position in the data file of dataset sample ``i`` (``i`` plus the bad records before it)."""
        return i + int(np.searchsorted(self._shift, i, side="right")) if len(self._shift) else i

    def lengths(self) -> list[int]:
        """Exact token count of every sample (from the index: no media read)."""
        tokens = np.asarray(self.index.tokens)
        return (tokens[self.index.good()] if len(self._shift) else tokens).tolist()

    def info(self, i: int) -> SampleInfo:
        """What the planner needs of sample ``i`` (token count, special-token counts, and the processor's shape
        facts: e.g. vision grids, audio frames), no decoding."""
        k = self.source_index(i)
        facts, counts = self.index.meta_of(k)
        return SampleInfo(i, int(self.index.tokens[k]), token_counts=counts, **self.processor.info(facts))

    def __getitem__(self, i: int) -> Sample:
        return self.get(i)

    def record(self, k: int) -> _Record:
        """Record ``k`` of the file (0-based, file order), read and normalised now."""
        item, err = self._file_records.read(k)
        return _record(k, item, err, self.image_root)

    def get(self, i: int, pixels: bool = True) -> Sample:
        """Sample ``i``; ``pixels=False`` decodes no media (the text side needs only their shapes, known from
        validation)."""
        if not 0 <= i < self._n_good:
            raise IndexError(f"{self.file}: sample {i} out of range (dataset has {self._n_good} samples)")
        rec = self.record(self.source_index(i))
        facts, _ = self.index.meta_of(rec.index)
        decoded = self._decode(rec, facts) if pixels else None
        ids, labels = self.tokenizer.encode_conversation(rec.messages, self.processor.blocks(facts))
        sample = Sample(i, torch.tensor(ids, dtype=torch.long), torch.tensor(labels, dtype=torch.long),
                        torch.zeros(0, dtype=torch.long), self.processor.collate(facts, decoded))
        sample.position_ids = self.processor.position_ids(sample)
        return sample

    def _decode(self, rec: _Record, facts: dict[str, tuple]) -> dict[str, list]:
        """Every media item of the record, decoded by the processor (in order, per kind)."""
        out: dict[str, list] = {}
        for kind, items in rec.media.items():
            if not items:
                continue
            media = self.processor.kind(kind)
            out[kind] = []
            for source, fact in zip(items, facts[kind], strict=True):
                try:
                    out[kind].append(media.decode(opened(source, timeout_s=self.media_timeout_s), fact))
                except (OSError, ValueError) as e:
                    raise DataError(f"{self.file} sample {rec.index}: {kind} {_name(source)} cannot be processed "
                                    f"({e}); fix or remove the file, or drop the sample") from e
        return out

    # ---- pre-flight check -------------------------------------------------------------
    def validate(self) -> list[DataIssue]:
        """Every problem of every sample in the file (empty: all good), checked again now in this process."""
        chunk = self._check_range(self._file_records, 0, len(self._file_records))
        return [DataIssue(str(self.file), k, m) for k, m in chunk.issues]


def _bad_shift(ix: index.SampleIndex) -> np.ndarray:
    """The bad records' positions, each less its rank (sorted): good sample ``i`` is record ``i`` plus the number
    of these that are at most ``i``. What a process keeps to address the good samples: a number per bad record,
    not one per sample."""
    bad = np.flatnonzero(np.asarray(ix.status) != index.GOOD)
    return bad - np.arange(len(bad), dtype=bad.dtype)


class _Records:
    """The file's records by position, each read when asked for (``SFTDataset.record``)."""

    def __init__(self, ds: SFTDataset) -> None:
        self.ds = ds

    def __len__(self) -> int:
        return len(self.ds.index)

    def __getitem__(self, k: int) -> _Record:
        if not 0 <= k < len(self):
            raise IndexError(f"{self.ds.file}: record {k} out of range ({len(self)} records)")
        return self.ds.record(k)


# ---- the index: built once over a process pool, cached ------------------------------------------------------------

POOL_MIN_RECORDS = 20000  # smaller files are indexed in the calling process (a pool of spawned processes starts slower)
CHUNK_RECORDS = 2048  # records per pool task
SETTINGS_IGNORED = ("path", "eval_path", "on_error", "loader_workers", "eval_samples", "max_new_tokens",
                    "index_workers", "index_cache", "mix_seed",
                    "media_timeout_s", "pad_to_multiple_of")  # data keys that change nothing validation finds


def index_key(ds: _Checker, fp: str) -> tuple[str, dict[str, Any]]:
    """(the index's cache key, what it hashes): the file, how it is read (``record_form``) and its fingerprint,
    and every setting that changes what validation finds (the data keys, the image root, the processor's values,
    the tokenizer's file)."""
    settings = {k: v for k, v in vars(ds.cfg).items() if k not in SETTINGS_IGNORED}
    if settings.get("validate") == "lazy":  # the same index as headers (lazy reads the rest in the run)
        settings["validate"] = "headers"
    tok_file = Path(ds.tokenizer.path) / "tokenizer.json"
    root = ds.image_root if isinstance(ds.image_root, UrlPath) else ds.image_root.absolute()
    manifest = {"file": str(ds.file.absolute()), "form": record_form(ds.file), "fingerprint": fp,
                "image_root": str(root), "settings": index.stable(settings), "processor": index.stable(ds.processor),
                "tokenizer": hashlib.sha256(tok_file.read_bytes()).hexdigest()[:32] if tok_file.is_file() else ""}
    blob = json.dumps(manifest, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:24], manifest


def cached_index(ds: _Checker) -> index.SampleIndex:
    """The file's index from the cache when it was built for this file and these settings, else built now (over
    a process pool when large) and stored (``data.index_cache``)."""
    if not ds.file.exists():
        open_records(ds.file)  # its DataError: the file does not exist (named, with the fix)
    fp = fingerprint(ds.file)
    key, manifest = index_key(ds, fp)
    directory = index.index_root() / key
    use_cache = getattr(ds.cfg, "index_cache", True)
    if use_cache:
        stored = index.load(directory)
        if stored is not None and stored.fingerprint == fp:
            return stored
    records = open_records(ds.file)  # (a malformed file: its DataError, before anything is built)
    built = build_index(ds, records, fp)
    if built.transient:
        print(f"dhp: {built.transient} medium(s) of {ds.file} could not be fetched (named in the data report); its "
              "index is kept for this start only, so that the next start fetches them again", file=sys.stderr)
    elif use_cache:
        try:
            index.save(built, directory, manifest)
        except OSError as e:  # a read-only cache: the run goes on, the next start validates again
            print(f"dhp: cannot store the data index under {directory.parent} ({e}); set DHP_CACHE to a writable "
                  "folder to start faster next time", file=sys.stderr)
    return built


def build_index(ds: _Checker, records: RecordFile, fp: str) -> index.SampleIndex:
    """Validate every record of ``records``: in this process for a small file, else over ``data.index_workers``
    processes (0: one per CPU core), each checking runs of ``CHUNK_RECORDS``."""
    n = len(records)
    ranges = records.ranges(CHUNK_RECORDS)
    workers = int(getattr(ds.cfg, "index_workers", 0)) or os.cpu_count() or 1
    chunks: list[_Chunk] = []
    with Progress(n, f"validating {ds.file}", after_s=PROGRESS_AFTER_S) as progress:
        if n >= POOL_MIN_RECORDS and workers > 1:
            try:
                chunks = _pooled(ds, records, ranges, workers, progress)
            except (BrokenProcessPool, RuntimeError) as e:  # e.g. a script without a __main__ guard cannot spawn
                print(f"dhp: validating {ds.file} in this process: its pool of {workers} could not start ({e})",
                      file=sys.stderr)
                chunks = []
        if not chunks:
            chunks = [ds._check_range(records, lo, hi, progress) for lo, hi in ranges]
    meta, meta_offsets = index.pack_meta([b for c in chunks for b in c.meta])
    return index.SampleIndex(_column(chunks, "status", np.int8), _column(chunks, "tokens", np.int32),
                             _column(chunks, "kinds", np.uint8), meta, meta_offsets,
                             [i for c in chunks for i in c.issues], fp, spans=records.spans(),
                             transient=sum(c.transient for c in chunks))


def _pooled(ds: _Checker, records: RecordFile, ranges: list[tuple[int, int]], workers: int,
            progress: Progress) -> list[_Chunk]:
    """The chunks of ``ranges`` checked over ``workers`` spawned processes, in order."""
    job = _PoolJob(ds.file, ds.cfg, str(ds.tokenizer.path), ds.processor, ds.image_root, records.spans())
    ctx = multiprocessing.get_context("spawn")  # no fork of a process holding threads (Ray, torch)
    chunks = []
    with ProcessPoolExecutor(min(workers, len(ranges)), mp_context=ctx, initializer=_pool_start,
                             initargs=(job, os.getpid())) as pool:
        for (lo, hi), chunk in zip(ranges, pool.map(_pool_check, ranges), strict=True):
            chunks.append(chunk)
            progress.update(hi - lo)
    return chunks


def _column(chunks: list[_Chunk], name: str, dtype: Any) -> np.ndarray:
    return np.concatenate([getattr(c, name) for c in chunks]) if chunks else np.zeros(0, dtype)


@dataclass
class _PoolJob:
    """What a worker of the index-building pool checks records with (sent once, to its initializer)."""

    file: Path
    cfg: DataConfig
    tokenizer_dir: str
    processor: Processor
    image_root: AnyPath
    spans: np.ndarray | None


_POOL: dict[str, Any] = {}  # in a pool worker: its checker and reader


def _pool_start(job: _PoolJob, parent: int) -> None:
    from dhp.lifetime import exit_with_parent

    exit_with_parent(parent)
    checker = _Checker()
    checker.file, checker.cfg, checker.processor, checker.image_root = job.file, job.cfg, job.processor, job.image_root
    checker.tokenizer = Tokenizer(job.tokenizer_dir)
    _POOL["checker"], _POOL["records"] = checker, open_records(job.file, job.spans)


def _pool_check(bounds: tuple[int, int]) -> _Chunk:
    return _POOL["checker"]._check_range(_POOL["records"], *bounds)


def _from_validation(v: ValidationResult, file: Path) -> index.SampleIndex:
    """A ``ValidationResult`` (Python objects) as an in-memory index."""
    n = v.num_records
    status, tokens = np.full(n, index.BAD, np.int8), np.full(n, -1, np.int32)
    blobs = [b""] * n
    for k, length in v.lengths.items():
        status[k], tokens[k] = index.GOOD, length
        blobs[k] = pickle.dumps((v.facts.get(k, {}), v.token_counts.get(k, {})))
    for issue in v.issues:
        status[issue.index] = index.BAD
    kinds = np.array([index.kinds_bits({kind: [1] for kind in v.facts.get(k, {})}) for k in range(n)], np.uint8)
    meta, offsets = index.pack_meta(blobs)
    return index.SampleIndex(status, tokens, kinds, meta, offsets, [(i.index, i.message) for i in v.issues],
                             fingerprint(file))


def _summary(file: Path, issues: list[DataIssue], image_root: AnyPath, cfg: DataConfig, num_records: int,
             skipping: bool = False) -> str:
    """The error: one line that says what is wrong and the fix (the cause shared by every problem when there is
    one: a wrong image root, a too small data.max_length), then the first problems, one per line."""
    n_samples = len({i.index for i in issues})
    missing = [i for i in issues if i.message.startswith("image file ")]
    too_long = [i for i in issues if LONGER_THAN in i.message]
    fix = "fix them, or set data.on_error=skip to drop those samples"
    if skipping:
        head = (f"{file}: no usable samples: data.on_error=skip dropped all {n_samples} (each has a problem, the "
                "first ones below); fix them")
    else:
        head = f"{file}: {len(issues)} problem(s) in {n_samples} sample(s); {fix}"
    if missing and len(missing) == len(issues) and 2 * n_samples >= num_records:  # most images: a wrong root
        where = (f"data.image_root={image_root}" if cfg.image_root
                 else f"{image_root} (data.image_root is unset: the data file's folder)")
        head = (f"{file}: {len(missing)} image file(s) not found under {where}; set data.image_root to the folder "
                "the image paths in the file are relative to, or fix the paths")
    elif too_long and len(too_long) == len(issues):
        longest = max(int(i.message.split()[0]) for i in too_long)
        head = (f"data.max_length={cfg.max_length}: {len(too_long)} sample(s) of {file} are longer (up to {longest} "
                f"tokens; samples are never cut); raise data.max_length to at least {longest}, lower "
                f"data.max_pixels, or " + ("shorten them" if skipping else "set data.on_error=skip to drop them"))
    lines = [str(i) for i in issues[:MAX_LISTED_ISSUES]]
    if lines:
        head += " (samples are numbered from 0, in file order)"
    more = len(issues) - len(lines)
    tail = [f"... and {more} more"] if more > 0 else []
    return "\n".join([head, *lines, *tail])


def _check_conversation(rec: _Record) -> list[str]:
    problems = []
    if not rec.messages:
        return ["empty conversation; give at least one user and one assistant turn"]
    if not any(m["role"] == "assistant" for m in rec.messages):
        problems.append("no assistant turn, nothing to learn; add a 'gpt'/'assistant' reply or drop the sample")
    for tag, given, kind, noun in ((IMAGE_PLACEHOLDER, rec.images, "image", "image"),
                                   (VIDEO_PLACEHOLDER, rec.videos, "video", "video"),
                                   (AUDIO_PLACEHOLDER, rec.audios, "audio", "audio clip")):
        n = sum(m["content"].count(tag) for m in rec.messages)
        if n != len(given):
            plural = "s" if len(given) != 1 else ""
            found = f"{n} {tag} placeholder{'s' if n != 1 else ''} but {len(given)} {noun}{plural}"
            problems.append(f"{found}: {_parts_fix(n, kind)}" if rec.parts else f"{found}; make them equal")
    return problems


def _parts_fix(n: int, kind: str) -> str:
    """The fix for HF chat content, in its own terms: the sample has ``{"type": kind}`` parts, not tags."""
    return (f"the content has {n} {{\"type\": \"{kind}\"}} part{'s' if n != 1 else ''} (dhp counts each as a "
            f"{kind} placeholder); give each part its file ('path', '{kind}' or 'url' in the part) or list exactly "
            f"one file per bare part in '{kind}s'")


def _name(clip: AnyPath | list[AnyPath]) -> str:
    return f"of {len(clip)} frames from {clip[0]}" if isinstance(clip, list) and clip else str(clip)


# ---- reading ----------------------------------------------------------------------------


def _record(index: int, item: Any, error: str | None, image_root: AnyPath) -> _Record:
    if error:
        return _Record(index, [], [], error)
    if not isinstance(item, dict):
        return _Record(index, [], [], f"expected an object with 'conversations' or 'messages', got {item!r:.60}")
    try:
        listed = _image_list(item)
        listed_videos = _video_list(item)
        videos = listed_videos
        audios = _audio_list(item)
        if "conversations" in item:
            messages, paths = _from_llava(item["conversations"]), listed
        elif "messages" in item:
            messages, paths, videos, audios = _from_messages(item["messages"], listed, listed_videos, audios)
        else:
            raise ValueError("no 'conversations' or 'messages' key; use one of the forms in the README (data forms)")
        system = item.get("system")
        if system is not None:
            if not isinstance(system, str):
                raise ValueError(f"'system' must be a string, got {system!r:.60}")
            if messages and messages[0]["role"] == "system":
                raise ValueError("a 'system' key and a system message; give the system prompt once")
            messages = [{"role": "system", "content": system}, *messages]
        images = [_local_image(p, image_root) for p in paths]
        clips = [[_local_image(f, image_root, "video frame") for f in v] if isinstance(v, list)
                 else _local_image(v, image_root, "video") for v in videos]
        sounds = [_local_image(a, image_root, "audio") for a in audios]
    except ValueError as e:
        return _Record(index, [], [], str(e))
    parts = "messages" in item and any(isinstance(m, dict) and isinstance(m.get("content"), list)
                                       for m in item["messages"])
    return _Record(index, messages, images, videos=clips, audios=sounds, parts=parts)


def _video_list(item: dict[str, Any]) -> list[str | list[str]]:
    """The sample's clips: ``video`` is one clip, ``videos`` a list of clips; a clip is a file path or a list of
    frame image paths."""
    if "video" in item:
        value = item["video"]
        if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            return [value]
        raise ValueError(f"'video' must be a video file path or a list of frame image paths, got {value!r:.60}")
    value = item.get("videos")
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) or (isinstance(v, list) and v and all(
            isinstance(f, str) for f in v)) for v in value):
        return list(value)
    raise ValueError(f"'videos' must be a list of clips (each a video file path or a list of frame image paths), "
                     f"got {value!r:.60}")


def _image_list(item: dict[str, Any]) -> list[str]:
    """The sample's ``image`` (LLaVA) or ``images`` (messages, LLaMA-Factory, TRL) entry: paths, in order."""
    return _path_list(item, "image")


def _audio_list(item: dict[str, Any]) -> list[str]:
    """The sample's ``audio`` (one path, or a list) or ``audios`` entry: audio file paths, in order."""
    return _path_list(item, "audio")


def _path_list(item: dict[str, Any], kind: str) -> list[Any]:
    """``item[kind]`` or ``item[kind + "s"]``: one path or a list of paths; an entry may also be the struct HF
    ``datasets`` Image features store (``{"bytes": ..., "path": ...}``, as in parquet and ``save_to_disk`` sets)."""
    key = kind if item.get(kind) is not None else kind + "s"
    value = item.get(key)
    if value is None:
        return []
    if isinstance(value, (str, dict)):
        value = [value]
    if isinstance(value, list) and all(isinstance(v, str) or _is_struct(v) for v in value):
        return list(value)
    raise ValueError(f"'{key}' must be a path or a list of paths (or of {{'bytes', 'path'}} structs), got "
                     f"{value!r:.60}")


def _is_struct(value: Any) -> bool:
    """An HF ``datasets`` media struct: ``{"bytes": b"..." or None, "path": "..." or None}``."""
    return isinstance(value, dict) and set(value) <= {"bytes", "path"} and (
        isinstance(value.get("bytes"), bytes) or isinstance(value.get("path"), str))


class InlineMedia:
    """A media item stored inside the data file (a parquet or Arrow cell's bytes); ``opened`` gives the processor a
    file object of it. Its ``str`` names it in messages (the struct's path when it has one)."""

    def __init__(self, data: bytes, name: str | None) -> None:
        self.data, self.name = data, name

    def __str__(self) -> str:
        return f"{self.name} (inline bytes)" if self.name else "(inline bytes in the data file)"

    __repr__ = __str__


def opened(source: Any, whole: bool = True, timeout_s: float = MEDIA_TIMEOUT_S) -> Any:
    """What a processor reads: a local path as it is, inline bytes as a fresh file object (``str``: their name), a
    medium in an object store as a file fetched now (``dhp.storage.open_media``: ``whole``, or its first block for
    a header read). A frame list item by item; for a header read only its first frame is fetched (the processors
    read the first frame's header only)."""
    if isinstance(source, list):
        return [opened(f, whole, timeout_s) if whole or j == 0 else f for j, f in enumerate(source)]
    if isinstance(source, InlineMedia):
        buf = _NamedBytes(source.data)
        buf.label = str(source)
        return buf
    return open_media(source, whole, timeout_s)


def _failure(handle: Any) -> OSError | None:
    """The failed request of an opened medium (or of a frame list's), if one failed: not the medium's fault."""
    for h in handle if isinstance(handle, list) else [handle]:
        if getattr(h, "failed", None) is not None:
            return h.failed
    return None


class _NamedBytes(io.BytesIO):
    """Inline bytes as a file object that messages name by the medium's label (PIL's errors take its ``repr``)."""

    label = ""

    def __str__(self) -> str:
        return self.label

    __repr__ = __str__


def _local_image(path: Any, image_root: AnyPath, what: str = "image") -> AnyPath | InlineMedia:
    """A sample's image (or video, audio) path: a URL (``s3://``, ``gs://``...) as itself, a relative path under
    ``image_root`` (a folder or a URL prefix). An image given inline (an HF struct with bytes) is kept as its
    bytes."""
    if isinstance(path, dict):
        if isinstance(path.get("bytes"), bytes):
            if what != "image":
                raise ValueError(f"{what} {path.get('path') or ''} given as inline bytes; dhp reads {what}s from "
                                 f"files: store the {what} files and give their paths")
            return InlineMedia(path["bytes"], path.get("path"))
        path = path["path"]
    if path.startswith("data:"):
        raise ValueError(f"an inline (data: URI) {what}; dhp reads {what} files only: save it as a file and give "
                         "its path")
    try:
        return media_ref(path, image_root)
    except ValueError as e:
        raise ValueError(f"{what} {e}") from None


def _from_llava(turns: Any) -> list[dict[str, str]]:
    if not isinstance(turns, list):
        raise ValueError("'conversations' must be a list of {'from', 'value'} turns")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise ValueError(f"turn {k} must be an object with a string 'value'")
        role = LLAVA_ROLES.get(turn.get("from"))
        if role is None:
            raise ValueError(f"turn {k}: unknown role {turn.get('from')!r}; use 'human', 'gpt' or 'system'")
        out.append({"role": role, "content": turn["value"]})
    return out


def _from_messages(messages: Any, listed: list[str], listed_videos: list | None = None,
                   listed_audios: list[str] | None = None) -> tuple[list[dict[str, str]], list[str], list, list[str]]:
    """Chat messages with string content (``<image>`` tags) or HF chat content (a list of parts); their images.

    Images in order of appearance: an image part naming its file (``image``, ``path``, ``url``, ``image_url``)
    brings it; an ``<image>`` tag or a bare ``{"type": "image"}`` part takes the next one of ``images``."""
    if not isinstance(messages, list):
        raise ValueError("'messages' must be a list of {'role', 'content'} messages")
    out: list[dict[str, str]] = []
    images: list[str] = []
    videos: list = []
    audios: list = []
    pending = iter(listed)
    pending_videos = iter(listed_videos or [])
    pending_audios = iter(listed_audios or [])
    for k, msg in enumerate(messages):
        if not isinstance(msg, dict):
            raise ValueError(f"message {k} must be an object with 'role' and 'content'")
        if "role" not in msg and "from" in msg:  # ShareGPT turns under 'messages'
            msg = {"role": LLAVA_ROLES.get(msg["from"], msg["from"]), "content": msg.get("value")}
        role, content = msg.get("role"), msg.get("content")
        if role not in MESSAGE_ROLES:
            raise ValueError(f"message {k}: unknown role {role!r}; use 'system', 'user' or 'assistant'")
        if isinstance(content, str):
            images += [next(pending, None) for _ in range(content.count(IMAGE_PLACEHOLDER))]
            videos += [next(pending_videos, None) for _ in range(content.count(VIDEO_PLACEHOLDER))]
            audios += [next(pending_audios, None) for _ in range(content.count(AUDIO_PLACEHOLDER))]
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            text = []
            for j, part in enumerate(content):
                kind, source = _part(part, k, j)
                if kind == "text":
                    text.append(source)
                    continue
                if kind == "video":
                    text.append(VIDEO_PLACEHOLDER)
                    videos.append(source if source is not None else next(pending_videos, None))
                    continue
                if kind == "audio":
                    text.append(AUDIO_PLACEHOLDER)
                    audios.append(source if source is not None else next(pending_audios, None))
                    continue
                text.append(IMAGE_PLACEHOLDER)
                images.append(source if source is not None else next(pending, None))
            out.append({"role": role, "content": "".join(text)})
        else:
            raise ValueError(f"message {k}: 'content' must be a string or a list of parts "
                             "({'type': 'text', 'text': ...}, {'type': 'image'})")
    # a count mismatch leaves a gap or a rest: _check_conversation reports it (placeholders vs images)
    return (out, [x for x in images if x is not None] + list(pending),
            [x for x in videos if x is not None] + list(pending_videos),
            [x for x in audios if x is not None] + list(pending_audios))


def _part(part: Any, k: int, j: int) -> tuple[str, Any]:
    """("text", its text), ("image", its file or None), ("video", its file, frame list or None) or ("audio", its
    file or None) of one part of HF chat content."""
    where = f"message {k} part {j}"
    if not isinstance(part, dict):
        raise ValueError(f"{where}: expected an object like {{'type': 'text', 'text': ...}}, got {part!r:.60}")
    kind = part.get("type")
    if kind == "text" or (kind is None and "text" in part):
        if not isinstance(part.get("text"), str):
            raise ValueError(f"{where}: a text part needs a string 'text'")
        for tag, kind_name in ((IMAGE_PLACEHOLDER, "image"), (VIDEO_PLACEHOLDER, "video"),
                               (AUDIO_PLACEHOLDER, "audio")):
            if tag in part["text"]:
                raise ValueError(f"{where}: an {tag} tag inside a text part; give the {kind_name} as a {kind_name} "
                                 f"part ({{'type': '{kind_name}'}}) instead")
        return "text", part["text"]
    if kind in ("image", "image_url") or (kind is None and ("image" in part or "image_url" in part)):
        for key in ("image", "path", "url", "image_url"):
            value = part.get(key)
            if isinstance(value, dict) and key == "image_url":  # OpenAI: {"image_url": {"url": ...}}
                value = value.get("url")
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"{where}: '{key}' must be the image's file path, got {value!r:.60}")
            return "image", value
        return "image", None
    if kind == "video" or (kind is None and "video" in part):
        for key in ("video", "path", "url"):
            value = part.get(key)
            if value is None:
                continue
            if not (isinstance(value, str) or (isinstance(value, list) and value and all(
                    isinstance(f, str) for f in value))):
                raise ValueError(f"{where}: '{key}' must be the video's file path or a list of frame image paths, "
                                 f"got {value!r:.60}")
            return "video", value
        return "video", None
    if kind == "input_audio":
        raise ValueError(f"{where}: an inline (base64 input_audio) clip; dhp reads audio files only: save it as a WAV "
                         "or FLAC file and give it as {'type': 'audio', 'audio': PATH}")
    if kind == "audio" or (kind is None and "audio" in part):
        for key in ("audio", "path", "url", "audio_url"):
            value = part.get(key)
            if isinstance(value, dict) and key == "audio_url":
                value = value.get("url")
            if value is None:
                continue
            if not isinstance(value, str):
                raise ValueError(f"{where}: '{key}' must be the audio file's path, got {value!r:.60}")
            return "audio", value
        return "audio", None
    raise ValueError(f"{where}: unknown part type {kind!r}; use 'text', 'image', 'video' or 'audio'")
