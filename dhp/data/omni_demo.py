"""The audio demo: dial tones and digit pictures, generated offline, for Qwen2.5-Omni's thinker.

Why: dhp must show a model with two encoders learning end to end on a laptop, with no download.
Telephone keypad (DTMF) tones are the audio counterpart of the handwritten digits: each key is a
pair of sine tones, and a clip is a few keys with noise, gaps and varied durations at the
telephone rate of 8 kHz (the loader resamples it to 16 kHz). Samples ask

* "Which digits were dialed?" (audio only, 1-3 keys; the answer lists them in order),
* "What digit is this?" (one digit picture, as in the image demo),
* "Do the dialed digits match the picture?" (a clip and a collage of digits: yes or no),
* "What comes after 3?" (text only),

so the vision, audio and text groups each get their own mix of work. Train and held-out splits use
disjoint digit pictures and their own random clips.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
from PIL import Image

from dhp.data.demo import DemoPaths, demo_dir, render_digit
from dhp.data.tokenizer import DEFAULT_SYSTEM_PROMPT, build_demo_tokenizer

OMNI_DEMO_VERSION = "3"  # 2: clips of 1-3 keys; 3: more dialing
MARKER = ".complete"
DIAL_PROMPT = "<audio>\nWhich digits were dialed?"
IMAGE_PROMPT = "<image>\nWhat digit is this?"
MATCH_PROMPT = "<audio><image>\nDo the dialed digits match the picture?"
TEXT_PROMPT = "What comes after {d}?"
KINDS = ("dial", "image", "match", "text")
KIND_WEIGHTS = (0.55, 0.2, 0.2, 0.05)
PHONE_RATE = 8000  # Hz: the clips' own rate (resampled to 16 kHz by the loader)
KEYS_PER_CLIP = (1, 2, 3)
KEYS_WEIGHTS = (0.45, 0.35, 0.2)  # single keys teach the tones, longer clips their order
EVAL_FRACTION = 0.2


def omni_demo_dir() -> Path:
    """``$DHP_CACHE/omni_demo`` (or ``~/.cache/dhp/omni_demo``), beside the image demo."""
    return demo_dir().parent / "omni_demo"


def ensure_omni_demo_dataset() -> Path:
    """The cached audio demo set, built once (atomically, so concurrent workers agree); returns its folder."""
    target = omni_demo_dir()
    if (target / MARKER).is_file() and (target / MARKER).read_text().strip() == OMNI_DEMO_VERSION:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".omni-demo-build-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    make_omni_demo_dataset(tmp)
    (tmp / MARKER).write_text(OMNI_DEMO_VERSION + "\n")
    if target.exists() and not (target / MARKER).is_file():
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process finished first: use its (identical) copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def make_omni_demo_dataset(out_dir: str | Path, seed: int = 0, n_train: int = 3000, n_eval: int = 200) -> DemoPaths:
    """Write ``train.jsonl`` and ``eval.jsonl`` (chat ``messages`` with ``audios``/``images``), ``audio/`` (WAV
    and FLAC at 8 kHz), ``images/`` and an Omni-style ``tokenizer/``; deterministic given ``seed``."""
    from sklearn.datasets import load_digits

    root = Path(out_dir)
    for sub in ("audio", "images"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    order = np.random.default_rng(seed).permutation(len(digits.target))
    n_held = int(len(order) * EVAL_FRACTION)
    pools = {"eval": order[:n_held], "train": order[n_held:]}
    texts = [DEFAULT_SYSTEM_PROMPT, "system", "user", "assistant", "yes", "no"]
    files = {}
    for split, n in (("train", n_train), ("eval", n_eval)):
        rng = np.random.default_rng([seed, 11 if split == "train" else 12])
        items = [_make_item(rng, digits.images, digits.target, pools[split], root, f"{split}_{k:05d}")
                 for k in range(n)]
        files[split] = root / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(item) + "\n" for item in items))
        texts += [m["content"] for item in items for m in item["messages"]]
    tok = build_demo_tokenizer(root / "tokenizer", texts, omni=True)
    return DemoPaths(root=root, train=files["train"], eval=files["eval"], images=root / "images", tokenizer=tok)


def _make_item(rng: np.random.Generator, pix: np.ndarray, labels: np.ndarray, pool: np.ndarray, root: Path,
               name: str) -> dict:
    kind = KINDS[rng.choice(len(KINDS), p=KIND_WEIGHTS)]
    if kind == "text":
        d = int(rng.integers(0, 9))
        return _messages(name, TEXT_PROMPT.format(d=d), str(d + 1))
    if kind == "image":
        idx = int(rng.choice(pool))
        side = int(rng.integers(56, 71))
        _save_png(render_digit(rng, pix[idx], side, side), root / "images" / f"{name}.png")
        return _messages(name, IMAGE_PROMPT, str(labels[idx]), images=[f"images/{name}.png"])
    keys = "".join(str(d) for d in rng.integers(0, 10, size=int(rng.choice(KEYS_PER_CLIP, p=KEYS_WEIGHTS))))
    audio = _write_dial(rng, keys, root / "audio", name)
    if kind == "dial":
        return _messages(name, DIAL_PROMPT, " ".join(keys), audios=[audio])
    match = bool(rng.integers(0, 2))
    shown = keys if match else _other_keys(rng, keys)
    cells = [render_digit(rng, pix[_instance(rng, labels, pool, int(d))], 56, 56) for d in shown]
    _save_png(np.concatenate(cells, axis=1), root / "images" / f"{name}.png")
    return _messages(name, MATCH_PROMPT, "yes" if match else "no", images=[f"images/{name}.png"], audios=[audio])


def _write_dial(rng: np.random.Generator, keys: str, folder: Path, name: str) -> str:
    """A dial-tone clip of ``keys``, as WAV (3 in 4) or FLAC; returns its path relative to the data folder."""
    from dhp.data.dtmf import dial, write_wav

    ext = "flac" if rng.random() < 0.25 else "wav"
    write_wav(folder / f"{name}.{ext}", dial(keys, rng, sample_rate=PHONE_RATE), PHONE_RATE, fmt=ext.upper())
    return f"audio/{name}.{ext}"


def _other_keys(rng: np.random.Generator, keys: str) -> str:
    """Keys of the same length that differ from ``keys`` in one or more places."""
    out = list(keys)
    for k in rng.choice(len(keys), size=int(rng.integers(1, len(keys) + 1)), replace=False):
        out[k] = str((int(out[k]) + int(rng.integers(1, 10))) % 10)
    return "".join(out)


def _instance(rng: np.random.Generator, labels: np.ndarray, pool: np.ndarray, digit: int) -> int:
    """A random picture of ``digit`` from ``pool``."""
    return int(rng.choice(pool[labels[pool] == digit]))


def _messages(name: str, prompt: str, answer: str, images: list[str] | None = None,
              audios: list[str] | None = None) -> dict:
    item: dict = {"id": name, "messages": [{"role": "user", "content": prompt},
                                           {"role": "assistant", "content": answer}]}
    if images:
        item["images"] = images
    if audios:
        item["audios"] = audios
    return item


def _save_png(arr: np.ndarray, path: Path) -> None:
    Image.fromarray(arr, "L").save(path, optimize=False)
