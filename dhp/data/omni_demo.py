"""The audio demo: dial tones and digit pictures, generated offline, for Qwen2.5-Omni's thinker.

Why: dhp must show a model with two encoders learning end to end on a laptop, with no download.
Telephone keypad (DTMF) tones are the audio counterpart of the handwritten digits: each key is a
pair of sine tones, and a clip is a few keys with noise, gaps and varied durations at the
telephone rate of 8 kHz (the loader resamples it to 16 kHz). Samples ask

* "Which digits were dialed?" (audio only, 1-3 keys at a keypad's cadence; the answer lists them in order),
* "What digit is this?" (one digit picture, as in the image demo),
* "Do the dialed digits match the picture?" (a clip and a collage of digits: yes or no),
* "What comes after 3?" (text only),

so the vision, audio and text groups each get their own mix of work. Train and held-out splits use
disjoint digit pictures and their own random clips.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from dhp.data.demo import DemoPaths, build_demo_tokenizer, demo_dir, ensure_cached, render_digit, save_png
from dhp.data.tokenizer import DEFAULT_SYSTEM_PROMPT

OMNI_DEMO_VERSION = "7"  # 2: clips of 1-3 keys; 3, 4: the mix; 5: keypad cadence, mostly single keys
DIAL_PROMPT = "<audio>\nWhich digits were dialed?"
IMAGE_PROMPT = "<image>\nWhat digit is this?"
MATCH_PROMPT = "<audio><image>\nDo the dialed digits match the picture?"
TEXT_PROMPT = "What comes after {d}?"
KINDS = ("dial", "image", "match", "text")
KIND_WEIGHTS = (0.78, 0.12, 0.07, 0.03)
PHONE_RATE = 8000  # Hz: the clips' own rate (resampled to 16 kHz by the loader)
KEYS_PER_CLIP = (1, 2, 3)
# Single keys teach the tones, then longer clips their order. Measured on this 2-core machine: with 90 % single
# keys a tiny model reads every held-out clip after 250 steps (2-key clips included); with half or fewer it stays
# at chance for 300 steps and more (it learns how many keys a clip holds, never which).
KEYS_WEIGHTS = (0.9, 0.08, 0.02)
MATCH_KEYS_WEIGHTS = (0.8, 0.2, 0.0)
SLOT_SECONDS = 0.25  # an auto-dialer's cadence: one key per 0.25 s slot ...
TONE_SECONDS = (0.15, 0.21)  # ... a tone of 150-210 ms in it, the rest silent
EVAL_FRACTION = 0.2


def omni_demo_dir() -> Path:
    """``$DHP_CACHE/omni_demo`` (or ``~/.cache/dhp/omni_demo``), beside the image demo."""
    return demo_dir().parent / "omni_demo"


def ensure_omni_demo_dataset() -> Path:
    """The cached audio demo set, built once (atomically, so concurrent workers agree); returns its folder."""
    return ensure_cached(omni_demo_dir(), OMNI_DEMO_VERSION, make_omni_demo_dataset)


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
        save_png(render_digit(rng, pix[idx], side, side), root / "images" / f"{name}.png")
        return _messages(name, IMAGE_PROMPT, str(labels[idx]), images=[f"images/{name}.png"])
    weights = KEYS_WEIGHTS if kind == "dial" else MATCH_KEYS_WEIGHTS
    keys = "".join(str(d) for d in rng.integers(0, 10, size=int(rng.choice(KEYS_PER_CLIP, p=weights))))
    audio = _write_dial(rng, keys, root / "audio", name)
    if kind == "dial":
        return _messages(name, DIAL_PROMPT, " ".join(keys), audios=[audio])
    match = bool(rng.integers(0, 2))
    shown = keys if match else _other_keys(rng, keys)
    cells = [render_digit(rng, pix[_instance(rng, labels, pool, int(d))], 56, 56) for d in shown]
    save_png(np.concatenate(cells, axis=1), root / "images" / f"{name}.png")
    return _messages(name, MATCH_PROMPT, "yes" if match else "no", images=[f"images/{name}.png"], audios=[audio])


def _write_dial(rng: np.random.Generator, keys: str, folder: Path, name: str) -> str:
    """A dial-tone clip of ``keys``, as WAV (3 in 4) or FLAC; returns its path relative to the data folder."""
    from dhp.data.dtmf import dial, write_wav

    ext = "flac" if rng.random() < 0.25 else "wav"
    wave = dial(keys, rng, sample_rate=PHONE_RATE, slot_seconds=SLOT_SECONDS, tone_seconds=TONE_SECONDS)
    write_wav(folder / f"{name}.{ext}", wave, PHONE_RATE, fmt=ext.upper())
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
