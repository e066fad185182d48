"""The syntax of a mixed ``data.path``: sources separated by commas, each a path or a glob, with ``:WEIGHT`` or not.

A leaf (it imports only ``dhp.errors``): the config checks a mixed ``data.path`` when it loads
(``dhp.config.check_files_exist``), below the data layer that reads the sources (``dhp.data.mix``).
"""

from __future__ import annotations

import glob
import re
from pathlib import Path

from dhp.errors import DataError

_WEIGHT = re.compile(r"^(?P<path>.+):(?P<weight>[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)$")
_GLOB = re.compile(r"[*?\[]")


def parse_sources(value: str) -> list[tuple[str, float | None]]:
    """``"a.jsonl:0.3,b/*.parquet:0.7"`` -> [(pattern, weight or None)]. Raises DataError for a bad list."""
    out = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            raise DataError(f"data.path={value!r}: an empty source between commas; give 'PATH[:WEIGHT],PATH[:WEIGHT]'")
        m = _WEIGHT.match(entry)
        out.append((m["path"], float(m["weight"])) if m else (entry, None))
    weighted = [w is not None for _, w in out]
    if any(weighted) and not all(weighted):
        raise DataError(f"data.path={value!r}: some sources have a weight and some not; give every source one "
                        "(PATH:WEIGHT) or none (the sources concatenated)")
    if any(w is not None and w <= 0 for _, w in out):
        raise DataError(f"data.path={value!r}: a weight must be > 0")
    return out


def is_mix(value: str | Path | None) -> bool:
    """Whether ``data.path`` names several sources, a glob or a weight (else: one file, as always)."""
    if value is None:
        return False
    text = str(value)
    return "," in text or bool(_GLOB.search(text)) or bool(_WEIGHT.match(text) and not Path(text).exists())


def expand(pattern: str) -> list[Path]:
    """The files of one source: the path itself, or the sorted matches of a glob. Raises DataError for none."""
    if not _GLOB.search(pattern):
        return [Path(pattern).expanduser()]
    files = sorted(Path(p) for p in glob.glob(str(Path(pattern).expanduser())))
    if not files:
        raise DataError(f"data.path: the glob {pattern} matches no file; fix the pattern")
    return files


def check_sources(value: str) -> None:
    """Every source of a mixed ``data.path`` exists (DataError naming the missing one)."""
    for pattern, _ in parse_sources(value):
        for f in expand(pattern):
            if not f.exists():
                raise DataError(f"data.path: {f} does not exist (a source of {value!r}); fix the path")
