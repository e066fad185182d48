"""A small, learnable vision-language data set built offline from scikit-learn's handwritten digits.

Why: dhp must train end to end (data -> both modules -> loss going down ->
held-out accuracy) on a laptop, with no download. The 8x8 digits ship inside
the scikit-learn wheel; upscaled to 56..168 px with random placement and noise
they give vision sequences of varied length (some spanning several 112 px
attention windows), multi-image samples and wide collages, with answers made
of digit characters that a few-MB model learns in a few hundred steps.
Train and held-out splits use disjoint digit instances.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image

from dhp.data.tokenizer import DEFAULT_SYSTEM_PROMPT, train_tokenizer
from dhp.storage import dhp_cache

DEMO_VERSION = "2"  # 2: the video clips
MARKER = ".complete"

SINGLE_PROMPTS = ("What digit is this?", "Which digit is shown?", "Read the digit.")
PAIR_PROMPTS = ("What are the two digits?", "Read both digits.")
COLLAGE_PROMPTS = ("Read the digits from left to right.", "What number is written?")
TEXT_PROMPT = "What comes after {d}?"
VIDEO_PROMPT = "<video>\nWhich digits appear, in order?"
VIDEO_SIDE = 56  # px: 2x2 merged tokens per temporal patch
VIDEO_FPS = 2  # each digit is shown for 2 frames (one temporal patch, one second)
KINDS = ("single", "pair", "collage", "text")
KIND_WEIGHTS = (0.8, 0.07, 0.08, 0.05)
EVAL_FRACTION = 0.2  # share of digit instances reserved for the held-out split


# The demo tokenizers are Qwen's kind (the demo sets train the Qwen families): their special tokens, and the chat
# templates shipped with Qwen/Qwen2.5-VL-*-Instruct and Qwen2.5-Omni, written into tokenizer_config.json.
QWEN2_5_VL_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
                             "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>")
OMNI_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                       "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>")
QWEN2_5_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}"
    "<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in "
    "content or 'image_url' in content %}{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}"
    "Picture {{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>{% elif content['type'] "
    "== 'video' or 'video' in content %}{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}"
    "Video {{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>{% elif 'text' in content "
    "%}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}"
)
# Qwen2.5-Omni's layout of the same conversations: its token names, and audio blocks.
QWEN2_5_OMNI_CHAT_TEMPLATE = (
    QWEN2_5_VL_CHAT_TEMPLATE.replace("<|vision_start|>", "<|vision_bos|>").replace("<|vision_end|>", "<|vision_eos|>")
    .replace("<|image_pad|>", "<|IMAGE|>").replace("<|video_pad|>", "<|VIDEO|>")
    .replace("{% elif 'text' in content %}", "{% elif content['type'] == 'audio' or 'audio' in content %}"
             "<|audio_bos|><|AUDIO|><|audio_eos|>{% elif 'text' in content %}")
)


def build_demo_tokenizer(out_dir: str | Path, texts: Sequence[str], vocab_size: int = 384, omni: bool = False) -> Path:
    """A small byte-level BPE trained on ``texts`` with Qwen2.5-VL's special tokens and chat template (``omni``:
    Qwen2.5-Omni's: its names for the vision tokens, the audio tokens). Writes ``tokenizer.json`` and
    ``tokenizer_config.json`` into ``out_dir`` and returns it. Deterministic."""
    if omni:
        return train_tokenizer(out_dir, texts, OMNI_SPECIAL_TOKENS, QWEN2_5_OMNI_CHAT_TEMPLATE, vocab_size)
    return train_tokenizer(out_dir, texts, QWEN2_5_VL_SPECIAL_TOKENS, QWEN2_5_VL_CHAT_TEMPLATE, vocab_size)


@dataclass(frozen=True)
class DemoPaths:
    root: Path
    train: Path
    eval: Path
    images: Path
    tokenizer: Path


def demo_dir() -> Path:
    """Where the demo set is cached: ``$DHP_CACHE/demo`` if DHP_CACHE is set, else ``~/.cache/dhp/demo``."""
    return dhp_cache("demo")


def ensure_demo_dataset() -> Path:
    """The cached demo set, built once (atomically, so concurrent workers agree); returns its folder."""
    return ensure_cached(demo_dir(), DEMO_VERSION, make_demo_dataset)


def ensure_cached(target: Path, version: str, make: Callable[[Path], object]) -> Path:
    """``target``, built by ``make(folder)`` unless a complete build of ``version`` is there; atomic: built in a
    temporary folder and renamed, so concurrent processes (Ray workers) agree on one copy."""
    if (target / MARKER).is_file() and (target / MARKER).read_text().strip() == version:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}-build-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    make(tmp)
    (tmp / MARKER).write_text(version + "\n")
    if target.exists() and not (target / MARKER).is_file():  # a stale or interrupted build
        shutil.rmtree(target, ignore_errors=True)
    try:
        os.rename(tmp, target)
    except OSError:  # another process finished first: use its (identical) copy
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def make_demo_dataset(out_dir: str | Path, seed: int = 0, n_train: int = 8000, n_eval: int = 200) -> DemoPaths:
    """Write ``train.jsonl``, ``eval.jsonl`` (LLaVA format), ``images/*.png`` and ``tokenizer/``; deterministic.

    Also the video demo: ``video_train.jsonl``, ``video_eval.jsonl`` and ``videos/*.mp4`` (n_train / 8 and
    n_eval / 2 clips; ``configs/video_demo.yaml``). The image samples and the tokenizer do not depend on them."""
    from sklearn.datasets import load_digits

    root = Path(out_dir)
    images = root / "images"
    images.mkdir(parents=True, exist_ok=True)
    digits = load_digits()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(digits.target))
    n_held = int(len(order) * EVAL_FRACTION)
    pools = {"eval": order[:n_held], "train": order[n_held:]}
    texts: list[str] = [DEFAULT_SYSTEM_PROMPT, "system", "user", "assistant"]
    files = {}
    for split, n in (("train", max(1, n_train // 8)), ("eval", max(1, n_eval // 2))):
        split_rng = np.random.default_rng([seed, 3 if split == "train" else 4])
        items = [_make_clip(split_rng, digits.images, digits.target, pools[split], root, f"video_{split}_{k:05d}")
                 for k in range(n)]
        (root / f"video_{split}.jsonl").write_text("".join(json.dumps(item) + "\n" for item in items))
    for split, n in (("train", n_train), ("eval", n_eval)):
        split_rng = np.random.default_rng([seed, 1 if split == "train" else 2])
        items = [_make_item(split_rng, digits.images, digits.target, pools[split], images, f"{split}_{k:05d}")
                 for k in range(n)]
        files[split] = root / f"{split}.jsonl"
        files[split].write_text("".join(json.dumps(item) + "\n" for item in items))
        texts += [turn["value"] for item in items for turn in item["conversations"]]
    tok = build_demo_tokenizer(root / "tokenizer", texts)
    return DemoPaths(root=root, train=files["train"], eval=files["eval"], images=images, tokenizer=tok)


def _make_item(rng: np.random.Generator, pix: np.ndarray, labels: np.ndarray, pool: np.ndarray, images: Path,
               name: str) -> dict:
    kind = KINDS[rng.choice(len(KINDS), p=KIND_WEIGHTS)]
    if kind == "text":
        d = int(rng.integers(0, 9))
        return _item(name, [], TEXT_PROMPT.format(d=d), str(d + 1), [])
    if kind == "single":
        idx = int(rng.choice(pool))
        side = int(rng.integers(56, 71))
        save_png(render_digit(rng, pix[idx], side, side), images / f"{name}.png")
        prompt = "<image>\n" + str(rng.choice(SINGLE_PROMPTS))
        return _item(name, [f"images/{name}.png"], prompt, str(labels[idx]), [idx])
    if kind == "pair":
        idx = rng.choice(pool, size=2)
        paths = []
        for j, i in enumerate(idx):
            side = int(rng.integers(56, 141))
            save_png(render_digit(rng, pix[i], side, side), images / f"{name}_{j}.png")
            paths.append(f"images/{name}_{j}.png")
        answer = " ".join(str(labels[i]) for i in idx)
        return _item(name, paths, "<image>\n<image>\n" + str(rng.choice(PAIR_PROMPTS)), answer, idx)
    n = int(rng.integers(2, 4))
    idx = rng.choice(pool, size=n)
    cell = 56  # two or three cells: 112 or 168 px wide, the latter spanning two 112-px attention windows
    collage = np.concatenate([render_digit(rng, pix[i], cell, cell) for i in idx], axis=1)
    save_png(collage, images / f"{name}.png")
    answer = " ".join(str(labels[i]) for i in idx)
    return _item(name, [f"images/{name}.png"], "<image>\n" + str(rng.choice(COLLAGE_PROMPTS)), answer, idx)


def _make_clip(rng: np.random.Generator, pix: np.ndarray, labels: np.ndarray, pool: np.ndarray, root: Path,
               name: str) -> dict:
    """An MP4 clip (mpeg4) of 2-4 digits shown one after another, each for 2 frames, at 2 fps; the answer lists
    them in order. LLaVA form with a ``video`` entry."""
    from dhp.data.video import write_clip

    idx = rng.choice(pool, size=int(rng.integers(2, 5)))
    frames = [render_digit(rng, pix[i], VIDEO_SIDE, VIDEO_SIDE) for i in idx for _ in range(2)]
    write_clip(root / "videos" / f"{name}.mp4", np.stack(frames), fps=VIDEO_FPS)
    answer = " ".join(str(labels[i]) for i in idx)
    return {"id": name, "digits": [int(i) for i in idx], "video": f"videos/{name}.mp4",
            "conversations": [{"from": "human", "value": VIDEO_PROMPT}, {"from": "gpt", "value": answer}]}


def _item(name: str, image_paths: list[str], prompt: str, answer: str, sources: Sequence[int] | np.ndarray) -> dict:
    """A LLaVA record; ``digits`` lists the scikit-learn instances drawn (ignored by the loader, used by tests)."""
    item: dict = {"id": name, "digits": [int(i) for i in sources]}
    if len(image_paths) == 1:
        item["image"] = image_paths[0]
    elif image_paths:
        item["image"] = image_paths
    item["conversations"] = [{"from": "human", "value": prompt}, {"from": "gpt", "value": answer}]
    return item


def render_digit(rng: np.random.Generator, digit: np.ndarray, height: int, width: int) -> np.ndarray:
    """An 8x8 digit (0..16) scaled to 85-100% of ``height``, near the centre of a noisy dark canvas [H, W] uint8."""
    size = min(height, width, int(height * rng.uniform(0.85, 1.0)))
    glyph = Image.fromarray((digit * (255.0 / 16.0)).astype(np.uint8), "L").resize((size, size), Image.BICUBIC)
    canvas = np.full((height, width), float(rng.integers(0, 40)), dtype=np.float32)
    top = (height - size) // 2 + int(rng.integers(-((height - size) // 4), (height - size) // 4 + 1))
    left = (width - size) // 2 + int(rng.integers(-((width - size) // 4), (width - size) // 4 + 1))
    canvas[top:top + size, left:left + size] += np.asarray(glyph, dtype=np.float32) * rng.uniform(0.75, 1.0)
    canvas += rng.normal(0.0, 4.0, size=canvas.shape)
    return np.clip(canvas, 0, 255).astype(np.uint8)


def save_png(arr: np.ndarray, path: Path) -> None:
    Image.fromarray(arr, "L").save(path, optimize=False)
