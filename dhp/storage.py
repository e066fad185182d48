"""Where a run's files live on a cluster: output.dir must be one directory that every node sees.

Every group's ranks write their own DCP shards into ``output.dir`` and the driver
writes ``trainer.json`` and ``COMPLETE`` beside them. On a cluster whose nodes do
not share that path (each node's local disk), every node would write its shards
to its own disk and the checkpoint would be silently unusable. So before the
first step each node that can host a worker writes a probe file into
``output.dir`` and the driver must see every one of them; a node whose probe the
driver cannot see stops the run with the fix. A single-node Ray has nothing to
check.

``output.dir`` may instead be an object-store URL (``s3://bucket/run``), one store for every node: ``UrlPath``
gives the driver's checkpoint code the few ``Path`` operations it uses over fsspec (``Path("s3://b/x")`` would
collapse the ``//``), DCP writes and reads through its fsspec writer/reader, the run's small files are staged
locally and uploaded (``RunFiles``), and the URL inputs read whole at the start (the data file, the tokenizer,
``model.hf_path``) are read from a local copy (``local_copy``). Local paths behave as before.

Media (images, video files and frames, audio clips) are not copied: ``data.image_root`` (and a media path in a
record) may be a URL, and each medium is opened where it is decoded, by the loader thread or worker that needs it
(``open_media``): a header read fetches the object's first block by range request, a decode fetches the object in
one request, every request bounded by ``data.media_timeout_s``. Only the data file is copied by the driver.
"""

from __future__ import annotations

import errno
import io
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dhp.errors import ConfigError

PROBE_DIR = ".dhp_node_probe"

# (node id -> probe file path, token): on each node, write token at that node's path
ProbeWriter = Callable[[dict[str, str], str], None]


def check_shared_dir(out: str | Path, node_ids: Sequence[str], write: ProbeWriter,
                     describe: Callable[[str], str] = str) -> None:
    """Each node writes a probe into ``out`` (through ``write``), the driver reads them all back.

    Raises ConfigError naming the node(s) whose probe this process cannot see, and the fix. The probes are
    removed afterwards."""
    root = Path(out).absolute() / PROBE_DIR
    root.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    try:
        expected = {n: root / f"{n}-{token}" for n in node_ids}
        write({n: str(p) for n, p in expected.items()}, token)
        unseen = [n for n, path in expected.items() if not _holds(path, token)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if unseen:
        nodes = ", ".join(describe(n) for n in unseen)
        raise ConfigError(
            f"output.dir={out}: the Ray nodes do not share it: a probe file written there by node(s) {nodes} is "
            f"not visible to the driver, so each node would keep its own part of every checkpoint. Set output.dir "
            "to a directory every node mounts at the same path (NFS, a cluster filesystem)")


def _holds(path: Path, token: str) -> bool:
    try:
        return path.read_text() == token
    except OSError:
        return False


def _write_probe(path: str, token: str) -> str:
    """Runs on one node: writes ``token`` to ``path`` (its folder made if that node lacks it)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(token)
    return path


def _probe_in_actor(_actor: Any, path: str, token: str) -> str:
    return _write_probe(path, token)


def check_shared_output(out: str | Path, actor_of_node: dict[str, Any], timeout_s: float = 120.0) -> None:
    """``check_shared_dir`` over the nodes that host the run's workers, each probe written by one of the run's
    own actors on that node (Ray's ``__ray_call__``: no new process), all at once; nothing to check on a
    single node. A node that dies meanwhile is left out (its workers are gone too: recovery deals with them)."""
    import ray
    from ray.exceptions import RayError

    if len(actor_of_node) < 2 or is_url(out):  # an object store is one store for every node
        return
    ips = {n["NodeID"]: n.get("NodeManagerAddress", "?") for n in ray.nodes()}

    def write(paths: dict[str, str], token: str) -> None:
        refs = {n: actor_of_node[n].__ray_call__.remote(_probe_in_actor, p, token) for n, p in paths.items()}
        for node_id, ref in refs.items():
            try:
                ray.get(ref, timeout=timeout_s)
            except RayError as e:
                if any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()):
                    raise ConfigError(f"output.dir={out}: node {node_id[:8]} ({ips.get(node_id, '?')}) could not "
                                      f"write a probe file there ({type(e).__name__}: {e})") from None

    check_shared_dir(out, list(actor_of_node), write, lambda n: f"{n[:8]} ({ips.get(n, '?')})")




# ---- output.dir as a URL (s3://, gs://, ...): the driver's paths through fsspec -------------------------------


def is_url(path: str | os.PathLike | UrlPath) -> bool:
    """An fsspec URL other than a local file (``s3://b/x``, ``gs://b/x``, ``memory://x``); ``file://`` and plain
    paths are local."""
    if isinstance(path, UrlPath):
        return True
    text = os.fspath(path) if not isinstance(path, str) else path
    return "://" in text and not text.startswith("file://")


def location(path: str | os.PathLike | UrlPath) -> Path | UrlPath:
    """``path`` as the driver handles it: a ``Path`` for a local path (``file://`` stripped), a ``UrlPath`` for
    an object-store URL (``Path("s3://b/x")`` would collapse the ``//``)."""
    if isinstance(path, (Path, UrlPath)):
        return path
    text = os.fspath(path)
    if text.startswith("file://"):
        return Path(text[len("file://"):])
    return UrlPath(text) if is_url(text) else Path(text)


class UrlPath:
    """The part of ``pathlib.Path`` the driver uses (join, name, exists, read/write, glob, unlink), over fsspec.

    Credentials and the endpoint come from the environment, as the storage's own client reads them (S3:
    ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL`` for an S3-compatible server). Object
    stores have no directories: ``mkdir`` does nothing and a "directory" exists once a file is under it. Listings
    are read fresh every time (other processes, the workers, write under the same prefix)."""

    def __init__(self, url: str) -> None:
        import fsspec

        self.url = url.rstrip("/")
        self.protocol = self.url.split("://", 1)[0]
        self.fs = fsspec.filesystem(self.protocol)
        self.key = self.fs._strip_protocol(self.url)

    def __str__(self) -> str:
        return self.url

    def __repr__(self) -> str:
        return f"UrlPath({self.url!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, UrlPath) and other.url == self.url

    def __hash__(self) -> int:
        return hash(self.url)

    def __lt__(self, other: UrlPath) -> bool:
        return self.url < other.url

    def __truediv__(self, part: str) -> UrlPath:
        return UrlPath(f"{self.url}/{str(part).strip('/')}")

    @property
    def name(self) -> str:
        return self.url.rsplit("/", 1)[-1]

    @property
    def parent(self) -> UrlPath:
        return UrlPath(self.url.rsplit("/", 1)[0])

    def _fresh(self) -> None:
        self.fs.invalidate_cache()

    def exists(self) -> bool:
        self._fresh()
        return self.fs.exists(self.key)

    def is_file(self) -> bool:
        self._fresh()
        return self.fs.isfile(self.key)

    def is_dir(self) -> bool:
        self._fresh()
        return self.fs.isdir(self.key)

    def size(self) -> int:
        return int(self.fs.size(self.key))

    def read_text(self) -> str:
        try:
            return self.fs.cat_file(self.key).decode()
        except FileNotFoundError as e:
            raise FileNotFoundError(f"{self.url}: no such object") from e

    def read_bytes(self) -> bytes:
        return self.fs.cat_file(self.key)

    def write_text(self, text: str) -> int:
        self.fs.pipe_file(self.key, text.encode())
        return len(text)

    def write_bytes(self, data: bytes) -> int:
        self.fs.pipe_file(self.key, data)
        return len(data)

    def open(self, mode: str = "r") -> Any:
        return self.fs.open(self.key, mode)

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        self.fs.makedirs(self.key, exist_ok=True)

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def glob(self, pattern: str) -> list[UrlPath]:
        self._fresh()
        return [self._of(k) for k in self.fs.glob(f"{self.key}/{pattern}")]

    def files(self) -> dict[str, int]:
        """{path relative to this one: size} of every file under it."""
        self._fresh()
        found = self.fs.find(self.key, detail=True)
        return {k[len(self.key) + 1:]: int(v["size"]) for k, v in found.items() if v.get("type") != "directory"}

    def _of(self, key: str) -> UrlPath:
        return UrlPath(self.fs.unstrip_protocol(key))


AnyPath = Path | UrlPath


def rmtree(path: AnyPath) -> None:
    """Remove ``path`` and everything under it (nothing there: nothing to do)."""
    if isinstance(path, UrlPath):
        if path.exists():
            path.fs.rm(path.key, recursive=True)
        return
    shutil.rmtree(path, ignore_errors=True)


def files_under(path: AnyPath) -> dict[str, int]:
    """{relative path: size} of every file under ``path``, sorted."""
    if isinstance(path, UrlPath):
        return dict(sorted(path.files().items()))
    return {str(p.relative_to(path)): p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file()}


def size_of(path: AnyPath) -> int:
    return path.size() if isinstance(path, UrlPath) else path.stat().st_size


def dcp_writer(path: str | AnyPath) -> Any:
    """DCP's storage writer for ``path``: its fsspec writer for a URL, its file writer for a local path."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    return FsspecWriter(str(path)) if is_url(path) else FileSystemWriter(str(location(path)))


def dcp_reader(path: str | AnyPath) -> Any:
    """DCP's storage reader for ``path`` (fsspec for a URL)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

    return FsspecReader(str(path)) if is_url(path) else FileSystemReader(str(location(path)))


class RunFiles:
    """Where the driver writes a run's own files (config.yaml, workers.json, metrics.jsonl, trace.json,
    tensorboard/, summary.json): ``output.dir`` itself when it is local; for a URL a local staging directory,
    uploaded by ``sync`` (at every start, every checkpoint and the end), since an object can be neither appended
    to nor rewritten in place. ``pull`` brings a resumed run's metrics.jsonl back before it is truncated."""

    def __init__(self, out: AnyPath) -> None:
        self.out = out
        self.remote = out if isinstance(out, UrlPath) else None
        self.local = Path(tempfile.mkdtemp(prefix="dhp-run-")) if self.remote is not None else out

    def pull(self, *names: str) -> None:
        if self.remote is None:
            return
        for name in names:
            if (self.remote / name).is_file():
                self.remote.fs.get_file((self.remote / name).key, str(self.local / name))

    def sync(self) -> None:
        """Upload every staged file (nothing to do for a local output.dir)."""
        if self.remote is None:
            return
        for f in sorted(self.local.rglob("*")):
            if f.is_file() and not f.name.endswith(".tmp"):
                self.remote.fs.put_file(str(f), (self.remote / str(f.relative_to(self.local))).key)

    def close(self) -> None:
        if self.remote is not None:
            shutil.rmtree(self.local, ignore_errors=True)


def download_dir(url: UrlPath, local: Path) -> Path:
    """Every file under ``url`` into the local directory ``local`` (made if missing); returns ``local``."""
    for rel in files_under(url):
        target = local / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        url.fs.get_file((url / rel).key, str(target))
    return local


# ---- data.path, data.tokenizer, model.hf_path ... as URLs: read from a local copy -------------------------------

URL_INPUTS = (("data", "path"), ("data", "eval_path"), ("data", "tokenizer"), ("model", "hf_path"))  # copied
DATA_FILES = ("path", "eval_path")  # data keys that may name several sources (dhp.data_path)


def dhp_cache(name: str) -> Path:
    """A folder of dhp's cache: ``$DHP_CACHE/<name>`` (default ``~/.cache/dhp/<name>``): the demo set, the data
    indexes, copies of URL inputs, this machine's calibrated profiles."""
    return Path(os.environ.get("DHP_CACHE") or Path.home() / ".cache" / "dhp") / name


def cache_root() -> Path:
    """Where URL inputs are copied: ``$DHP_CACHE/urls`` (default ``~/.cache/dhp/urls``)."""
    return dhp_cache("urls")


def _hashed(url: str) -> Path:
    import hashlib

    return cache_root() / hashlib.sha256(url.encode()).hexdigest()[:16]


def local_copy(url: str, target: Path | None = None) -> Path:
    """A local copy of the file or directory at ``url``, kept under ``cache_root()`` keyed by the URL (or at
    ``target``); a file is fetched again when its size or ETag changed since the copy was made. The URL is kept
    beside the copy (``copied_from``). Raises FileNotFoundError naming the URL."""
    import json

    src = UrlPath(url)
    src._fresh()
    if not src.fs.exists(src.key):
        raise FileNotFoundError(f"{url}: no such object or prefix")
    target = target or _hashed(src.url) / src.name
    single = src.fs.isfile(src.key)
    listing = {src.key: src.fs.info(src.key)} if single else src.fs.find(src.key, detail=True)
    seen_path = target.parent / f".{target.name}.sources.json"
    seen = json.loads(seen_path.read_text()) if seen_path.is_file() else {}
    now = {}
    for key, info in listing.items():
        if info.get("type") == "directory":
            continue
        rel = "" if single else key[len(src.key) + 1:]
        ident = f"{info.get('size')}:{info.get('ETag') or info.get('mtime') or ''}"
        dest = target if single else target / rel
        if seen.get(rel) != ident or not dest.is_file():
            dest.parent.mkdir(parents=True, exist_ok=True)
            src.fs.get_file(key, str(dest))
        now[rel] = ident
    seen_path.parent.mkdir(parents=True, exist_ok=True)
    seen_path.write_text(json.dumps(now))
    (target.parent / f".{target.name}.url").write_text(src.url)
    return target


def copied_from(path: str | os.PathLike) -> UrlPath | None:
    """The URL the local copy ``path`` was made from (``local_copy``), or None: not such a copy."""
    p = Path(path)
    try:
        return UrlPath((p.parent / f".{p.name}.url").read_text())
    except OSError:
        return None


_MAGIC = ("*", "?", "[")


def _copy_glob(pattern: str) -> Path:
    """The objects a URL glob (``s3://b/shards/*.parquet``) matches, copied under one cache folder in the same
    layout; returns the same glob over that folder."""
    cut = min(pattern.index(c) for c in _MAGIC if c in pattern)
    prefix = pattern[:cut].rsplit("/", 1)[0]
    src = UrlPath(prefix)
    src._fresh()
    keys = sorted(src.fs.glob(src.fs._strip_protocol(pattern)))
    if not keys:
        raise FileNotFoundError(f"{pattern}: the glob matches no object")
    root = _hashed(pattern)
    for key in keys:
        local_copy(src.fs.unstrip_protocol(key), root / key[len(src.key) + 1:])
    return root / pattern[len(prefix) + 1:]


def _localize_sources(value: str) -> str:
    """A mixed ``data.path`` (``dhp.data_path``) with each URL source (a file or a glob) replaced by its copy."""
    from dhp.data_path import parse_sources

    out = []
    for pattern, weight in parse_sources(value):
        if is_url(pattern):
            pattern = str(_copy_glob(pattern) if any(c in pattern for c in _MAGIC) else local_copy(pattern))
        elif pattern.startswith("file://"):
            pattern = pattern[len("file://"):]
        out.append(pattern if weight is None else f"{pattern}:{weight:g}")
    return ",".join(out)


def _fetch_error(where: str, value: Any, e: Exception) -> ConfigError:
    return ConfigError(f"{where}: cannot fetch {value} ({type(e).__name__}: {e}); check the URL and the storage's "
                       "credentials and endpoint (AWS_ENDPOINT_URL for S3-compatible servers)")


def localize_inputs(cfg: Any) -> Any:
    """``cfg`` with every URL among its inputs read whole (``URL_INPUTS``; each URL source of a mixed ``data.path``)
    replaced by a local copy (``local_copy``): the readers of data files, tokenizers and checkpoints open local
    files. The driver makes the copies; on several nodes the workers read the same path, so it must be shared
    (``DHP_CACHE`` on a shared filesystem). Media stay where they are: a URL ``data.image_root`` is checked (it must
    hold objects) and kept, each medium fetched by the process that decodes it (``open_media``)."""
    from dhp.data_path import is_mix

    for section, key in URL_INPUTS:
        sec = getattr(cfg, section)
        value = getattr(sec, key)
        if value is None:
            continue
        try:
            if section == "data" and key in DATA_FILES and is_mix(str(value)) and is_url(str(value)):
                setattr(sec, key, _localize_sources(str(value)))
            elif is_url(str(value)):
                setattr(sec, key, str(local_copy(str(value))))
        except (FileNotFoundError, OSError) as e:
            raise _fetch_error(f"{section}.{key}", value, e) from None
        if isinstance(value, str) and value.startswith("file://"):
            setattr(sec, key, value[len("file://"):])
    root = cfg.data.image_root
    if isinstance(root, str) and root.startswith("file://"):
        cfg.data.image_root = root[len("file://"):]
    elif root is not None and is_url(str(root)):
        _check_media_root(str(root))
    return cfg


def _check_media_root(url: str) -> None:
    """A URL ``data.image_root`` names a prefix that holds objects (one listing, no media read)."""
    try:
        found = UrlPath(url).is_dir()
    except (OSError, ValueError, ImportError) as e:
        raise _fetch_error("data.image_root", url, e) from None
    if not found:
        raise ConfigError(f"data.image_root={url}: no object under that prefix; set it to the folder (URL) the "
                          "samples' media paths are relative to, or unset it (the data file's folder)")


# ---- media as URLs: opened by the process that decodes them ----------------------------------------------------

MEDIA_TIMEOUT_S = 60.0  # data.media_timeout_s: the longest one request for a medium may take
HEADER_BLOCK = 64 * 1024  # a header read's first request (most images' headers are in it)
MAX_BLOCK = 8 * 1024 * 1024  # the largest range a header read asks for at once


def media_ref(path: str, root: AnyPath) -> AnyPath:
    """A sample's media path: a URL as itself, a relative path under ``root`` (a folder or a URL prefix), an
    absolute local path as it is. Raises ValueError for a URL whose protocol fsspec does not know or cannot
    load (its package missing), naming the URL and the fix."""
    if path.startswith("file://"):
        return Path(path[len("file://"):])
    if is_url(path):
        _check_protocol(path)
        return UrlPath(path)
    local = Path(path).expanduser()
    if isinstance(root, UrlPath) and not local.is_absolute():
        return UrlPath(f"{root.url}/{posixpath.normpath(path)}")
    return local if isinstance(root, UrlPath) else root / local


def _check_protocol(url: str) -> None:
    import fsspec

    protocol = url.split("://", 1)[0]
    try:
        fsspec.get_filesystem_class(protocol)
    except ValueError:
        raise ValueError(f"{url:.80}: fsspec knows no '{protocol}://' storage; give a local path or a URL of an "
                         "object store fsspec reads (s3://, gs://, az://, https://)") from None
    except ImportError as e:
        raise ValueError(f"{url:.80}: reading '{protocol}://' needs a package that is not installed ({e})") from None


def media_root(image_root: str | None, data_file: str | os.PathLike) -> AnyPath:
    """The folder (or URL prefix) a data file's relative media paths are relative to: ``data.image_root`` when set,
    else the data file's folder, which for a local copy of a URL data file is the folder it was copied from."""
    if image_root:
        return location(image_root)
    source = copied_from(data_file)
    return source.parent if source is not None else Path(data_file).parent


def is_remote(source: Any) -> bool:
    return isinstance(source, UrlPath)


class MediaFile(io.RawIOBase):
    """A medium in an object store as a read-only, seekable file for PIL, PyAV and soundfile: ``whole`` fetches the
    object in one request (a decode), else ranges by request as they are read (a header): ``HEADER_BLOCK`` bytes
    first, each further miss twice the last (at most ``MAX_BLOCK``), so a header costs one small request and a reader
    that goes on through the file (PyAV counting a clip's packets) a few large ones. Every request is bounded by
    ``timeout_s`` (fsspec's async filesystems: S3, GCS, Azure, HTTP); a slow one raises ``TimeoutError`` naming the
    URL. The first request is made when the file is opened (``open_media``), so a missing object raises
    ``FileNotFoundError`` there. ``str`` is the URL (messages name it)."""

    def __init__(self, ref: UrlPath, whole: bool, timeout_s: float) -> None:
        super().__init__()
        self.ref, self.timeout_s, self.pos = ref, timeout_s, 0
        self.size: int | None = None
        self.ranges: list[tuple[int, bytes]] = []  # (offset, bytes) fetched so far
        self.ask = HEADER_BLOCK  # the size of the next range request
        self.failed: OSError | None = None  # a request that failed for another reason than a missing object
        if whole:
            data = self._call(ref.fs.cat_file, ref.key, start=0)  # (one ranged GET: no request for the size first)
            self.ranges, self.size = [(0, data)], len(data)
        else:
            self._at(0)

    def __str__(self) -> str:
        return self.ref.url

    @property
    def name(self) -> str:
        return self.ref.url

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return _bounded(self.ref, self.timeout_s, fn, *args, **kwargs)
        except FileNotFoundError:
            raise
        except OSError as e:  # (a timeout, a refused connection, missing credentials: not the medium's fault)
            self.failed = e
            raise

    def _at(self, pos: int) -> memoryview:
        """The bytes from ``pos`` on that one fetched range holds (fetched now if none does); empty at the end."""
        for start, data in self.ranges:
            if start <= pos < start + len(data):
                return memoryview(data)[pos - start:]
        if pos and self.size is None:  # (a range that starts past the end is an error on some stores)
            self._size()
        if self.size is not None and pos >= self.size:
            return memoryview(b"")
        data = self._call(self.ref.fs.cat_file, self.ref.key, start=pos, end=pos + self.ask)
        if len(data) < self.ask:  # (it reached the end: the object's size is known now)
            self.size = pos + len(data)
        self.ask = min(2 * self.ask, MAX_BLOCK)
        self.ranges.append((pos, data))
        return memoryview(data)

    def _size(self) -> int:
        if self.size is None:
            self.size = int(self._call(self.ref.fs.info, self.ref.key)["size"])
        return self.size

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos}.get(whence)
        self.pos = max(0, offset + (self._size() if base is None else base))
        return self.pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        n = 0
        while n < len(view):
            chunk = self._at(self.pos)[:len(view) - n]
            if not len(chunk):
                break
            view[n:n + len(chunk)] = chunk
            n += len(chunk)
            self.pos += len(chunk)
        return n

    def readall(self) -> bytes:
        out = bytearray()
        while chunk := self.read(MAX_BLOCK):
            out += chunk
        return bytes(out)


def _bounded(ref: UrlPath, timeout_s: float, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, one request of ``ref``'s filesystem, within ``timeout_s`` (an async filesystem's
    own deadline); its errors as OSErrors naming the URL (FileNotFoundError, TimeoutError, PermissionError...)."""
    from fsspec.asyn import AsyncFileSystem

    if isinstance(ref.fs, AsyncFileSystem):
        kwargs["timeout"] = timeout_s
    try:
        return fn(*args, **kwargs)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no such object", ref.url) from None
    except TimeoutError:
        raise TimeoutError(f"{ref.url}: not read within {timeout_s:g} s (data.media_timeout_s); check the network "
                           "and the storage's endpoint") from None
    except OSError as e:  # (a client's OSError subclasses take other arguments: only the kind that tells the fix kept)
        raise (PermissionError if isinstance(e, PermissionError) else OSError)(f"{ref.url}: {e}") from None
    except Exception as e:  # noqa: BLE001 - a store's client raises its own types (botocore, aiohttp)
        raise OSError(f"{ref.url}: {type(e).__name__}: {e}") from None


def open_media(source: AnyPath, whole: bool = True, timeout_s: float = MEDIA_TIMEOUT_S) -> Any:
    """What a processor reads of one medium: a local path as it is; an object-store one as a ``MediaFile`` (its
    first request made now: ``whole`` fetches it all, else its first block)."""
    return MediaFile(source, whole, timeout_s) if isinstance(source, UrlPath) else source


def media_exists(source: AnyPath, timeout_s: float = MEDIA_TIMEOUT_S) -> bool:
    """Whether a medium's file (or object) exists; for a URL one request (bounded by ``timeout_s``)."""
    if not isinstance(source, UrlPath):
        return source.is_file()
    try:
        return bool(_bounded(source, timeout_s, source.fs.isfile, source.key))
    except FileNotFoundError:
        return False


def check_writable(out: AnyPath, name: str = "output.dir=") -> None:
    """``output.dir`` (or the folder a command writes, ``name`` as its message calls it: ``"OUT "``, ``"--out "``)
    must take what is written there before anything starts. A URL: an object (a probe, put and removed); a missing
    bucket, wrong credentials or endpoint are a ConfigError naming the URL and what to check. A local path: a
    directory or none yet, under a directory that takes a new folder (a probe, made and removed in the nearest
    existing one: nothing is left, the folder itself is made by what writes there)."""
    if not isinstance(out, UrlPath):
        _check_local_writable(Path(out), name)
        return
    probe = out / f"{PROBE_DIR}-{uuid.uuid4().hex}"
    try:
        probe.write_text("probe")
        probe.unlink(missing_ok=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{name}{out}: cannot write there ({type(e).__name__}: {e}); check that the bucket "
                          "exists and that the credentials and endpoint (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                          "AWS_ENDPOINT_URL for S3) let this machine write to it") from None


def _check_local_writable(out: Path, name: str = "output.dir=") -> None:
    existing = next(p for p in (out, *out.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{name}{out}: {existing} is a file, not a directory; choose another directory")
    probe = existing / f"{PROBE_DIR}-{uuid.uuid4().hex}"
    try:
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise ConfigError(f"{name}{out}: cannot write in {existing} ({type(e).__name__}: {e}); choose a "
                          "directory this user can write to") from None


__all__ = ["MEDIA_TIMEOUT_S", "PROBE_DIR", "AnyPath", "MediaFile", "RunFiles", "UrlPath", "cache_root",
           "check_shared_dir", "check_shared_output", "check_writable", "copied_from", "dcp_reader", "dcp_writer",
           "dhp_cache", "download_dir", "files_under", "is_remote", "is_url", "local_copy", "localize_inputs",
           "location", "media_exists", "media_ref", "media_root", "open_media", "rmtree", "size_of"]
