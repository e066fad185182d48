"""Supervised fine-tuning data (JSON list or JSONL, one sample each), checked before the first step.

Accepted sample forms (README, "Data forms"): LLaVA (``conversations`` of
``from``/``value`` turns with ``<image>`` tags, ``image``/``images``);
chat ``messages`` of ``role``/``content`` with ``<image>`` tags and ``images``
(LLaMA-Factory's ShareGPT style); and the HF chat-content form, where
``content`` is a list of ``{"type": "text", "text": ...}`` and
``{"type": "image"}`` parts (transformers' chat templates, TRL), an image part
taking the next entry of ``images`` or naming its own file (``image``,
``path``, ``url``, ``image_url``). Images are local files; relative paths are
relative to ``data.image_root`` (default: the data file's folder).

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
"""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dhp.config import DataConfig
from dhp.data.batch import Sample
from dhp.data.processor import TAGS, Processor
from dhp.data.tokenizer import AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, Tokenizer
from dhp.errors import DataError
from dhp.models.spec import SampleInfo
from dhp.progress import Progress

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
    images: list[Path]
    problem: str | None = None  # a structural problem found while parsing
    videos: list[Path | list[Path]] = field(default_factory=list)  # a file, or a list of frame images
    audios: list[Path] = field(default_factory=list)
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


class SFTDataset:
    """LLaVA-style SFT samples -> ``Sample`` (ids, labels, positions, media by the family's processor); indexes
    only good samples."""

    def __init__(self, cfg: DataConfig, tokenizer: Tokenizer, path: str | Path | None = None,
                 validated: ValidationResult | None = None, *, processor: Processor) -> None:
        """``processor``: the model family's (``Family.processor``): what media become. ``validated``: the outcome
        of validating this same file (``self.validation``), e.g. from the driver, so that workers opening the data
        set do not read every media header again."""
        path = path if path is not None else cfg.path
        if path is None:
            raise DataError("data.path: set it to a training data file (a JSON list or JSONL file, README: data "
                            "forms)")
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.processor = processor
        self.file = Path(path)
        self.image_root = Path(cfg.image_root) if cfg.image_root else self.file.parent
        self._records = _read_records(self.file, self.image_root)
        self._check_kinds()
        self._lengths: dict[int, int] = {}  # record index -> exact token count
        self._facts: dict[int, dict[str, tuple]] = {}  # record index -> {kind: probe facts, per item}
        self._token_counts: dict[int, dict[int, int]] = {}
        self.skipped: list[DataIssue] = []
        if validated is not None:
            if validated.num_records != len(self._records):
                raise DataError(f"{self.file} changed since it was validated: {len(self._records)} records, "
                                f"{validated.num_records} before")
            self._lengths, self._facts = dict(validated.lengths), dict(validated.facts)
            self._token_counts = dict(validated.token_counts)
            issues = list(validated.issues)
        else:
            issues = self.validate()
        bad = {issue.index for issue in issues}
        if issues and cfg.on_error == "raise":
            raise DataError(_summary(self.file, issues, self.image_root, cfg, len(self._records)), issues)
        self.skipped = issues
        self._good = [r.index for r in self._records if r.index not in bad]
        if not self._good:
            if not self._records:
                raise DataError(f"data file {self.file} holds no samples (it is empty); give a JSON list or JSONL "
                                "file with one sample per line (README: data forms)")
            raise DataError(_summary(self.file, issues, self.image_root, cfg, len(self._records), skipping=True),
                            issues)

    def _check_kinds(self) -> None:
        """Every kind of media in the file is one the processor reads (else its tags would be plain text)."""
        for kind in TAGS:
            if self.processor.kind(kind) is not None:
                continue
            carrying = [r.index for r in self._records if r.media[kind]]
            if carrying:
                raise UnreadMedia(f"{self.file}: {len(carrying)} sample(s) carry {kind} (the first: sample "
                                  f"{carrying[0]}) but the {self.processor.family} processor reads no {kind}; use a "
                                  f"model family with a {kind} encoder, or drop the {kind}", self.file, kind, carrying)

    @property
    def validation(self) -> ValidationResult:
        """What validation found: hand it to another process opening the same file."""
        return ValidationResult(len(self._records), dict(self._lengths), list(self.skipped), dict(self._facts),
                                dict(self._token_counts))

    # ---- indexing ---------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._good)

    @property
    def num_skipped(self) -> int:
        return len({issue.index for issue in self.skipped})

    def source_index(self, i: int) -> int:
        """Position in the data file of dataset sample ``i``."""
        return self._good[i]

    def lengths(self) -> list[int]:
        """Exact token count of every sample (from media headers, no decoding)."""
        return [self._lengths[k] for k in self._good]

    def info(self, i: int) -> SampleInfo:
        """What the planner needs of sample ``i`` (token count, special-token counts, and the processor's shape
        facts: e.g. vision grids, audio frames), no decoding."""
        k = self._good[i]
        return SampleInfo(i, self._lengths[k], token_counts=self._token_counts.get(k, {}),
                          **self.processor.info(self._facts.get(k, {})))

    def __getitem__(self, i: int) -> Sample:
        return self.get(i)

    def get(self, i: int, pixels: bool = True) -> Sample:
        """Sample ``i``; ``pixels=False`` decodes no media (the text side needs only their shapes, known from
        validation)."""
        if not 0 <= i < len(self._good):
            raise IndexError(f"{self.file}: sample {i} out of range (dataset has {len(self._good)} samples)")
        rec = self._records[self._good[i]]
        facts = self._facts.get(rec.index, {})
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
                    out[kind].append(media.decode(source, fact))
                except (OSError, ValueError) as e:
                    raise DataError(f"{self.file} sample {rec.index}: {kind} {_name(source)} cannot be processed "
                                    f"({e}); fix or remove the file, or drop the sample") from e
        return out

    # ---- pre-flight check -------------------------------------------------------------
    def validate(self) -> list[DataIssue]:
        """Every problem of every sample in the file (empty: all good); also records exact token counts."""
        issues: list[DataIssue] = []
        with Progress(len(self._records), f"validating {self.file}", after_s=PROGRESS_AFTER_S) as progress:
            for rec in self._records:
                for message in self._check(rec):
                    issues.append(DataIssue(str(self.file), rec.index, message))
                progress.update()
        return issues

    def _check(self, rec: _Record) -> list[str]:
        if rec.problem:
            return [rec.problem]
        problems = _check_conversation(rec)
        facts: dict[str, tuple] = {}
        for kind, items in rec.media.items():
            found = []
            for source in items:
                fact, problem = self._probe(kind, source)
                if problem:
                    problems.append(problem)
                found.append(fact)
            if found:
                facts[kind] = tuple(found)
        if problems:
            return problems
        ids, _ = self.tokenizer.encode_conversation(rec.messages, self.processor.blocks(facts))
        self._lengths[rec.index] = len(ids)
        self._facts[rec.index] = facts
        special = set(self.tokenizer.special_ids())
        self._token_counts[rec.index] = {t: n for t, n in Counter(ids).items() if t in special}
        if len(ids) > self.cfg.max_length:
            hints = "".join(f"{self.processor.kind(k).shrink_hint()}, " for k in facts)
            return [f"{len(ids)} {LONGER_THAN}={self.cfg.max_length} (samples are never "
                    f"truncated); raise data.max_length, {hints}or shorten the sample"]
        return []

    def _probe(self, kind: str, source: Path | list[Path]) -> tuple[Any, str | None]:
        """The processor's fact of one media item from its header, or a problem naming the file and the fix."""
        files = source if isinstance(source, list) else [source]
        frame = "frame " if isinstance(source, list) else ""
        for f in files:
            if not f.is_file():
                return None, (f"{kind} {frame}file {f} does not exist; fix the path (relative to {self.image_root}) "
                              "or add it")
        try:
            return self.processor.kind(kind).probe(source), None
        except (OSError, ValueError) as e:
            return None, str(e) if str(files[0]) in str(e) else f"{kind} {_name(source)}: {e}"


def _summary(file: Path, issues: list[DataIssue], image_root: Path, cfg: DataConfig, num_records: int,
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


def _name(clip: Path | list[Path]) -> str:
    return f"of {len(clip)} frames from {clip[0]}" if isinstance(clip, list) and clip else str(clip)


# ---- reading ----------------------------------------------------------------------------


def _read_records(file: Path, image_root: Path) -> list[_Record]:
    if not file.is_file():
        raise DataError(f"data file {file} does not exist; set data.path to a LLaVA JSON or JSONL file")
    try:
        text = file.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{file}: not UTF-8 text ({e}); data.path must be a JSON or JSONL file") from None
    if text.lstrip().startswith("["):
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as e:
            raise DataError(f"{file}: not valid JSON ({e}); fix the file") from None
        items: list[tuple[Any, str | None]] = [(x, None) for x in raw]
    else:
        items = [_parse_line(line) for line in text.splitlines() if line.strip()]
        if len(items) > 1 and items[0][1] is not None:  # maybe one JSON object over several lines
            try:
                whole = json.loads(text)
            except json.JSONDecodeError:
                whole = None
            if whole is not None:
                raise DataError(f"{file}: one JSON {type(whole).__name__} over several lines; give a JSON list of "
                                "samples ([{...}, {...}]) or JSONL (one sample per line)")
    return [_record(k, item, err, image_root) for k, (item, err) in enumerate(items)]


def _parse_line(line: str) -> tuple[Any, str | None]:
    try:
        return json.loads(line), None
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e}); fix the line"


def _record(index: int, item: Any, error: str | None, image_root: Path) -> _Record:
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


def _path_list(item: dict[str, Any], kind: str) -> list[str]:
    """``item[kind]`` or ``item[kind + "s"]``: one path or a list of paths."""
    key = kind if kind in item else kind + "s"
    value = item.get(key)
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return list(value)
    raise ValueError(f"'{key}' must be a path or a list of paths, got {value!r:.60}")


_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _local_image(path: str, image_root: Path, what: str = "image") -> Path:
    """A sample's image (or video) path as a local file: relative paths are relative to ``image_root``; no URLs."""
    if path.startswith("file://"):
        path = path[len("file://"):]
    elif _URL.match(path):
        raise ValueError(f"{what} {path!r:.80} is a URL; dhp reads local {what} files only: download the {what}s "
                         "and give their paths (relative to data.image_root)")
    elif path.startswith("data:"):
        raise ValueError(f"an inline (data: URI) {what}; dhp reads {what} files only: save it as a file and give "
                         "its path")
    return image_root / Path(path).expanduser()


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
