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
locally and uploaded (``RunFiles``), and URL inputs (data, media, tokenizer, ``model.hf_path``) are read from a
local copy (``local_copy``). Local paths behave as before.
"""

from __future__ import annotations

import os
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


# ---- data.path, data.image_root, model.hf_path ... as URLs: read from a local copy --------------------------

URL_INPUTS = (("data", "path"), ("data", "eval_path"), ("data", "image_root"), ("data", "tokenizer"),
              ("model", "hf_path"))


def cache_root() -> Path:
    """Where URL inputs are copied: ``$DHP_CACHE/urls`` (default ``~/.cache/dhp/urls``)."""
    return Path(os.environ.get("DHP_CACHE") or Path.home() / ".cache" / "dhp") / "urls"


def local_copy(url: str) -> Path:
    """A local copy of the file or directory at ``url``, kept under ``cache_root()`` keyed by the URL; a file is
    fetched again when its size or ETag changed since the copy was made. Raises FileNotFoundError naming the URL."""
    import hashlib
    import json

    src = UrlPath(url)
    src._fresh()
    if not src.fs.exists(src.key):
        raise FileNotFoundError(f"{url}: no such object or prefix")
    root = cache_root() / hashlib.sha256(src.url.encode()).hexdigest()[:16]
    target = root / src.name
    single = src.fs.isfile(src.key)
    listing = {src.key: src.fs.info(src.key)} if single else src.fs.find(src.key, detail=True)
    seen_path = root / ".sources.json"
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
    return target


def localize_inputs(cfg: Any) -> Any:
    """``cfg`` with every URL among its inputs (``URL_INPUTS``) replaced by a local copy (``local_copy``): the
    readers of data, media and checkpoints open local files. The driver makes the copies; on several nodes the
    workers read the same path, so it must be shared (``DHP_CACHE`` on a shared filesystem)."""
    for section, key in URL_INPUTS:
        sec = getattr(cfg, section)
        value = getattr(sec, key)
        if value is not None and is_url(str(value)):
            try:
                setattr(sec, key, str(local_copy(str(value))))
            except (FileNotFoundError, OSError) as e:
                raise ConfigError(f"{section}.{key}: cannot fetch {value} ({type(e).__name__}: {e}); check the URL "
                                  "and the storage's credentials and endpoint (AWS_ENDPOINT_URL for S3-compatible "
                                  "servers)") from None
        elif isinstance(value, str) and value.startswith("file://"):
            setattr(sec, key, value[len("file://"):])
    return cfg


def check_writable(out: AnyPath) -> None:
    """A URL ``output.dir`` must take an object (a probe, put and removed) before anything starts: a missing
    bucket, wrong credentials or endpoint are a ConfigError naming the URL and what to check."""
    if not isinstance(out, UrlPath):
        return
    probe = out / f"{PROBE_DIR}-{uuid.uuid4().hex}"
    try:
        probe.write_text("probe")
        probe.unlink(missing_ok=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"output.dir={out}: cannot write there ({type(e).__name__}: {e}); check that the bucket "
                          "exists and that the credentials and endpoint (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, "
                          "AWS_ENDPOINT_URL for S3) let this machine write to it") from None


__all__ = ["PROBE_DIR", "AnyPath", "RunFiles", "UrlPath", "cache_root", "check_shared_dir", "check_shared_output",
           "check_writable", "dcp_reader", "dcp_writer", "download_dir", "files_under", "is_url", "local_copy",
           "localize_inputs", "location", "rmtree", "size_of"]
