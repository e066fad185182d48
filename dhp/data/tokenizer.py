"""Tokenizer wrapper, the Qwen2.5-VL chat layout (ChatML + vision blocks) and the offline demo tokenizer.

Why: training needs (input_ids, labels) whose layout is exactly what Qwen2.5-VL
sees at inference (its chat template followed by the processor's expansion of
``<|image_pad|>``), and special-token ids must come from the tokenizer by name,
so a real Qwen tokenizer and the small demo one are interchangeable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from dhp.data.batch import IGNORE_INDEX
from dhp.errors import ModelError

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
_MEDIA = re.compile("(<image>|<video>|<audio>)")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
ROLES = ("system", "user", "assistant")

# attribute -> the token's spellings: Qwen2.5-VL's first, then Qwen2.5-Omni's (same ids, other names)
SPECIAL_TOKENS = {
    "pad_id": ("<|endoftext|>",),
    "im_start_id": ("<|im_start|>",),
    "im_end_id": ("<|im_end|>",),
    "vision_start_id": ("<|vision_start|>", "<|vision_bos|>"),
    "vision_end_id": ("<|vision_end|>", "<|vision_eos|>"),
    "vision_pad_id": ("<|vision_pad|>",),
    "image_pad_id": ("<|image_pad|>", "<|IMAGE|>"),
    "video_pad_id": ("<|video_pad|>", "<|VIDEO|>"),
}
# Qwen2.5-Omni's audio tokens: optional (a Qwen2.5-VL tokenizer has none)
AUDIO_TOKENS = {
    "audio_pad_id": "<|AUDIO|>",
    "audio_start_id": "<|audio_bos|>",
    "audio_end_id": "<|audio_eos|>",
}
OMNI_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>",
                       "<|vision_bos|>", "<|vision_eos|>", "<|vision_pad|>", "<|IMAGE|>", "<|VIDEO|>")

# Qwen2's pre-tokenizer split (digits one by one, words, punctuation runs, newlines).
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# The chat template shipped with Qwen/Qwen2.5-VL-*-Instruct (written into the demo tokenizer_config.json).
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


class TokenizerError(ModelError):
    """A tokenizer directory dhp cannot use (no tokenizer.json, not a Qwen2 tokenizer)."""


class TokenizerFileMissing(TokenizerError, FileNotFoundError):
    """The directory has no tokenizer.json."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` from a directory with ``tokenizer.json``, plus Qwen's special ids by name."""

    im_start_id: int
    im_end_id: int
    vision_start_id: int
    vision_end_id: int
    vision_pad_id: int
    image_pad_id: int
    video_pad_id: int
    pad_id: int
    audio_pad_id: int | None
    audio_start_id: int | None
    audio_end_id: int | None

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        file = self.path / "tokenizer.json"
        if not file.is_file():
            raise TokenizerFileMissing(f"tokenizer directory {self.path} has no tokenizer.json; set data.tokenizer to "
                                       "a directory with the model's tokenizer.json (a Hugging Face checkpoint "
                                       "directory holds one)")
        self._tok = HFTokenizer.from_file(str(file))
        self._tok.no_padding()
        self._tok.no_truncation()
        for attr, spellings in SPECIAL_TOKENS.items():
            tid = next((t for t in map(self._tok.token_to_id, spellings) if t is not None), None)
            if tid is None:
                raise TokenizerError(
                    f"tokenizer {self.path}: special token {' or '.join(spellings)} is missing from the vocabulary; "
                    "use a Qwen2.5-VL or Qwen2.5-Omni tokenizer or add the token"
                )
            setattr(self, attr, tid)
        for attr, token in AUDIO_TOKENS.items():
            setattr(self, attr, self._tok.token_to_id(token))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding needs at least this many rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def special_token_ids(self) -> dict[str, int]:
        """The model config's token ids (``Qwen2_5_VLConfig.with_tokens(**tok.special_token_ids())``)."""
        return {
            "image_token_id": self.image_pad_id,
            "video_token_id": self.video_pad_id,
            "vision_start_token_id": self.vision_start_id,
            "vision_end_token_id": self.vision_end_id,
        }

    @property
    def has_audio(self) -> bool:
        return None not in (self.audio_pad_id, self.audio_start_id, self.audio_end_id)

    def audio_token_ids(self) -> dict[str, int]:
        """The audio token ids of a model config (Qwen2.5-Omni's names); raises TokenizerError without them."""
        if not self.has_audio:
            raise TokenizerError(f"tokenizer {self.path} has no audio tokens ({', '.join(AUDIO_TOKENS.values())}); "
                                 "use a Qwen2.5-Omni tokenizer")
        return {"audio_token_id": self.audio_pad_id, "audio_start_token_id": self.audio_start_id,
                "audio_end_token_id": self.audio_end_id}

    def special_ids(self) -> list[int]:
        """Ids of every added special token (placeholders among them), in id order."""
        return sorted(i for i, tok in self._tok.get_added_tokens_decoder().items() if tok.special)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special tokens written in the text become their single ids."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    # ---- chat layout ------------------------------------------------------------------
    def encode_conversation(
        self,
        messages: Sequence[dict[str, str]],
        image_token_counts: Sequence[int],
        add_generation_prompt: bool = False,
        video_token_counts: Sequence[int] = (),
        audio_token_counts: Sequence[int] = (),
    ) -> tuple[list[int], list[int]]:
        """ChatML ids of a conversation, as Qwen2.5-VL's template + processor produce them, and their labels.

        Each ``<image>`` in the text becomes ``<|vision_start|>`` + ``<|image_pad|>`` x N + ``<|vision_end|>``
        with N = ``image_token_counts[k]`` for the k-th image; each ``<video>`` likewise with ``<|video_pad|>``
        and ``video_token_counts``; each ``<audio>`` becomes ``<|audio_bos|>`` + ``<|AUDIO|>`` x N +
        ``<|audio_eos|>`` (Qwen2.5-Omni) with ``audio_token_counts``. Labels are -100 except on assistant
        replies and their ``<|im_end|>``. With
        ``add_generation_prompt`` the ids end with ``<|im_start|>assistant\\n`` (for generation; then the last
        message should not be the assistant's).
        """
        for tag, counts, what in ((IMAGE_PLACEHOLDER, image_token_counts, "images"),
                                  (VIDEO_PLACEHOLDER, video_token_counts, "videos"),
                                  (AUDIO_PLACEHOLDER, audio_token_counts, "audio clips")):
            n_placeholders = sum(m["content"].count(tag) for m in messages)
            if n_placeholders != len(counts):
                raise ValueError(f"{n_placeholders} {tag} placeholders but {len(counts)} {what}")
        if audio_token_counts and not self.has_audio:
            self.audio_token_ids()  # raises: this tokenizer cannot write audio blocks
        counts = {IMAGE_PLACEHOLDER: iter(image_token_counts), VIDEO_PLACEHOLDER: iter(video_token_counts),
                  AUDIO_PLACEHOLDER: iter(audio_token_counts)}
        ids: list[int] = []
        labels: list[int] = []
        for seg_text, sup_from in chat_segments(messages, add_generation_prompt):
            seg_ids, seg_labels = self._encode_segment(seg_text, sup_from, counts)
            ids += seg_ids
            labels += seg_labels
        return ids, labels

    def _encode_segment(self, text: str, sup_from: int, counts: dict) -> tuple[list[int], list[int]]:
        """Ids of ``text`` (``<image>``, ``<video>`` expanded); a token is supervised if it covers a char at or
        after ``sup_from``.

        Text pieces between placeholders are encoded separately: each cut touches a vision special token, so the
        ids equal those of the whole expanded text. Vision blocks are never supervised.
        """
        ids: list[int] = []
        labels: list[int] = []
        pos = 0
        for k, piece in enumerate(_MEDIA.split(text)):
            if k % 2:  # a placeholder
                block = self._media_block(piece, next(counts[piece]))
                ids += block
                labels += [IGNORE_INDEX] * len(block)
                pos += len(piece)
                continue
            enc = self._tok.encode(piece, add_special_tokens=False)
            ids += enc.ids
            ends = (pos + end for _, end in enc.offsets)
            labels += [t if e > sup_from else IGNORE_INDEX for t, e in zip(enc.ids, ends, strict=True)]
            pos += len(piece)
        return ids, labels


    def _media_block(self, tag: str, n: int) -> list[int]:
        """The ids a placeholder tag expands to: start token, ``n`` pad tokens, end token."""
        if tag == AUDIO_PLACEHOLDER:
            return [self.audio_start_id] + [self.audio_pad_id] * n + [self.audio_end_id]
        pad = self.image_pad_id if tag == IMAGE_PLACEHOLDER else self.video_pad_id
        return [self.vision_start_id] + [pad] * n + [self.vision_end_id]


def chat_segments(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> list[tuple[str, int]]:
    """The rendered ChatML text as (text, supervised_from_char) pieces; joined they equal Qwen's template output.

    Each piece is one message (``<|im_start|>role\\n...<|im_end|>``) or the newline after it; every cut sits
    next to a special token, so encoding piece by piece gives the ids of the whole text. An assistant piece is
    supervised from its reply on (reply + ``<|im_end|>``); other pieces not at all (``supervised_from = len``).
    """
    if not messages:
        raise ValueError("empty conversation")
    segs: list[tuple[str, int]] = []
    for k, msg in enumerate(messages):
        role, content = msg.get("role"), msg.get("content")
        if role not in ROLES:
            raise ValueError(f"message {k}: unknown role {role!r}; expected one of {', '.join(ROLES)}")
        if not isinstance(content, str):
            raise ValueError(f"message {k}: content must be a string, got {type(content).__name__}")
        if k == 0 and role != "system":
            segs += _unsupervised(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>", "\n")
        header = f"<|im_start|>{role}\n"
        if role == "assistant":
            segs += [(f"{header}{content}<|im_end|>", len(header)), *_unsupervised("\n")]
        else:
            segs += _unsupervised(f"{header}{content}<|im_end|>", "\n")
    if add_generation_prompt:
        segs += _unsupervised("<|im_start|>assistant\n")
    return segs


def _unsupervised(*texts: str) -> list[tuple[str, int]]:
    return [(t, len(t)) for t in texts]


def render_chat(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """The ChatML text (``<image>`` placeholders kept) that Qwen2.5-VL's template renders."""
    return "".join(text for text, _ in chat_segments(messages, add_generation_prompt))


# ---- the demo tokenizer ----------------------------------------------------------------


def build_demo_tokenizer(out_dir: str | Path, texts: Sequence[str], vocab_size: int = 384, omni: bool = False) -> Path:
    """Train a small byte-level BPE (Qwen's pre-tokenizer, any text round-trips) on ``texts``; Qwen's specials last.

    ``omni``: Qwen2.5-Omni's special tokens (its names for the vision tokens, and the audio tokens) and chat template.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``out_dir`` and returns it. Deterministic.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    clean = [_MEDIA.sub(" ", t) for t in texts]
    tok.train_from_iterator(sorted(set(clean)), trainer=trainer)
    specials = OMNI_SPECIAL_TOKENS if omni else [names[0] for names in SPECIAL_TOKENS.values()]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.save(str(out / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": 32768,
        "chat_template": QWEN2_5_OMNI_CHAT_TEMPLATE if omni else QWEN2_5_VL_CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
