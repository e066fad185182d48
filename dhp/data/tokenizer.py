"""Tokenizer wrapper: a tokenizer.json, special tokens by spelling, and the ChatML layout of a conversation.

Why: training needs (input_ids, labels) whose layout is exactly what the model
sees at inference: its chat template, then its processor's expansion of each
media tag (``<image>``, ``<video>``, ``<audio>``: the family's processor gives
each item's block of ids, ``dhp.data.processor``). Special-token ids come from the
tokenizer by spelling (``Tokenizer.ids``, with the spellings a family names), so a
real tokenizer and a small demo one (``train_tokenizer``) are interchangeable.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFTokenizer

from dhp.data.batch import IGNORE_INDEX
from dhp.errors import ModelError

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"
MEDIA_TAGS = {IMAGE_PLACEHOLDER: "images", VIDEO_PLACEHOLDER: "videos", AUDIO_PLACEHOLDER: "audio clips"}
_MEDIA = re.compile("(<image>|<video>|<audio>)")
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."  # the system turn ChatML templates write when none is given
ROLES = ("system", "user", "assistant")
CHATML = {"im_start_id": "<|im_start|>", "im_end_id": "<|im_end|>"}  # the layout's own tokens: required

# A byte-level BPE's split (digits one by one, words, punctuation runs, newlines), for demo tokenizers.
SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


class TokenizerError(ModelError):
    """A tokenizer directory dhp cannot use (no tokenizer.json, a special token missing)."""


class TokenizerFileMissing(TokenizerError, FileNotFoundError):
    """The directory has no tokenizer.json."""


class Tokenizer:
    """A ``tokenizers.Tokenizer`` from a directory with ``tokenizer.json``; special ids by spelling (``ids``)."""

    im_start_id: int
    im_end_id: int

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
        for attr, tid in self.ids(CHATML, "dhp writes conversations in the ChatML layout; use a chat model's "
                                          "tokenizer or add the token").items():
            setattr(self, attr, tid)

    def ids(self, names: Mapping[str, str | Sequence[str]], fix: str) -> dict[str, int]:
        """{name: the id of its first spelling in the vocabulary} (a name maps to a spelling, or to several: the
        same token under another name). Raises TokenizerError naming this tokenizer, the missing token and ``fix``."""
        out = {}
        for name, spellings in names.items():
            spellings = (spellings,) if isinstance(spellings, str) else tuple(spellings)
            tid = next((t for t in map(self._tok.token_to_id, spellings) if t is not None), None)
            if tid is None:
                raise TokenizerError(f"tokenizer {self.path}: special token {' or '.join(spellings)} is missing from "
                                     f"the vocabulary; {fix}")
            out[name] = tid
        return out

    def has(self, *spellings: str) -> bool:
        """Whether every one of these tokens is in the vocabulary."""
        return all(self._tok.token_to_id(t) is not None for t in spellings)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding needs at least this many rows)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

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
        blocks: Mapping[str, Sequence[Sequence[int]]] | None = None,
        add_generation_prompt: bool = False,
        labels: bool = True,
    ) -> tuple[list[int], list[int]]:
        """ChatML ids of a conversation, as the chat template + the family's processor produce them, and labels.

        Each ``<image>``/``<video>``/``<audio>`` tag of the text becomes the next of ``blocks[tag]``: the ids the
        family's processor gives that item (``Processor.blocks``: e.g. a start token, one placeholder per token, an
        end token). Labels are -100 except on assistant replies and their ``<|im_end|>``. With
        ``add_generation_prompt`` the ids end with ``<|im_start|>assistant\\n`` (for generation; then the last
        message should not be the assistant's). Without ``labels`` the labels come back empty.
        """
        blocks = blocks or {}
        for tag, what in MEDIA_TAGS.items():
            n_placeholders = sum(m["content"].count(tag) for m in messages)
            given = len(blocks.get(tag, ()))
            if n_placeholders != given:
                raise ValueError(f"{n_placeholders} {tag} placeholders but {given} {what}")
        pending = {tag: iter(blocks.get(tag, ())) for tag in MEDIA_TAGS}
        ids: list[int] = []
        out_labels: list[int] = []
        for seg_text, sup_from in chat_segments(messages, add_generation_prompt):
            seg_ids, seg_labels = self._encode_segment(seg_text, sup_from, pending, labels)
            ids += seg_ids
            out_labels += seg_labels
        return ids, out_labels

    def conversation_ids(self, messages: Sequence[dict[str, str]],
                         blocks: Mapping[str, Sequence[Sequence[int]]] | None = None) -> list[int]:
        """The ids of ``encode_conversation(messages, blocks)`` without its labels (what validation counts: the
        same ids, less the per-token work of the labels)."""
        return self.encode_conversation(messages, blocks, labels=False)[0]

    def _encode_segment(self, text: str, sup_from: int, pending: dict,
                        with_labels: bool = True) -> tuple[list[int], list[int]]:
        """Ids of ``text`` (media tags expanded); a token is supervised if it covers a char at or after
        ``sup_from`` (no labels without ``with_labels``).

        Text pieces between tags are encoded separately: each cut touches a special token, so the ids equal those
        of the whole expanded text. Media blocks are never supervised.
        """
        ids: list[int] = []
        labels: list[int] = []
        pos = 0
        for k, piece in enumerate(_MEDIA.split(text)):
            if k % 2:  # a media tag
                block = list(next(pending[piece]))
                ids += block
                if with_labels:
                    labels += [IGNORE_INDEX] * len(block)
                pos += len(piece)
                continue
            enc = self._tok.encode(piece, add_special_tokens=False)
            ids += enc.ids
            if with_labels:
                ends = (pos + end for _, end in enc.offsets)
                labels += [t if e > sup_from else IGNORE_INDEX for t, e in zip(enc.ids, ends, strict=True)]
            pos += len(piece)
        return ids, labels


def chat_segments(messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> list[tuple[str, int]]:
    """The rendered ChatML text as (text, supervised_from_char) pieces; joined they equal the chat template's.

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
    """The ChatML text (media tags kept) that a ChatML chat template renders."""
    return "".join(text for text, _ in chat_segments(messages, add_generation_prompt))


# ---- demo tokenizers -------------------------------------------------------------------


def train_tokenizer(out_dir: str | Path, texts: Sequence[str], special_tokens: Sequence[str], chat_template: str,
                    vocab_size: int = 384) -> Path:
    """Train a small byte-level BPE (any text round-trips) on ``texts``; ``special_tokens`` last, in order.

    Writes ``tokenizer.json`` and ``tokenizer_config.json`` (with ``chat_template``) into ``out_dir`` and returns
    it. Deterministic. A family's demo set names its special tokens and template (``dhp.data.demo``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = HFTokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
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
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tok.save(str(out / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": CHATML["im_end_id"],
        "pad_token": special_tokens[0],
        "model_max_length": 32768,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
