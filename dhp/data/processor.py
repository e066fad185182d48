"""What a model family gives the data side: how each kind of media becomes model inputs and tokens.

Why an interface here: ``SFTDataset`` reads the data forms, validates samples and
reports problems the same way for every family, but what an image *is* to a model
(its resize rule, its patches, how many placeholder tokens it fills, the position
ids of the sequence) is the family's. A family's processor (``Family.processor``)
is a ``Processor`` holding one ``Media`` per kind of media it reads; the data set
calls them in three steps:

1. ``Media.probe(source)``: the item's shape fact from its header or metadata only
   (an image's patch grid, a clip's frame plan, an audio clip's frame count), or a
   ``MediaError`` whose message names the file and the fix. Validation and batch
   planning need nothing else, so token counts are exact before any decoding;
2. ``Media.num_tokens(fact)``: the placeholder tokens the item fills, and
   ``Processor.blocks``: the token ids each ``<image>``/``<video>``/``<audio>`` tag
   of the text becomes (``Placeholder``: start ids, the pad id n times, end ids);
3. ``Media.decode(source, fact)`` and ``Media.collate``: the model inputs of a
   sample (its ``Sample`` fields, e.g. ``pixel_values``), then
   ``Processor.position_ids`` of the whole sequence.

A processor is sent to workers inside the dataset spec, so it holds plain values
(ids, sizes, the data config) and pickles.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Source = Path | list[Path]  # one media file, or (a video) a list of frame images

TAGS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}  # dhp's data forms: the tag of each kind


class MediaError(ValueError):
    """A media item that cannot be used; the message says what is wrong and how to fix it (naming the file)."""


@dataclass(frozen=True)
class Placeholder:
    """What one media tag becomes in the token sequence: ``start`` ids, the ``pad`` id once per token, ``end`` ids."""

    pad: int
    start: tuple[int, ...] = ()
    end: tuple[int, ...] = ()

    def block(self, n: int) -> list[int]:
        return [*self.start, *[self.pad] * n, *self.end]


class Media:
    """One kind of media a family reads (images, videos, audio clips): probe, count, decode, collate.

    ``kind`` is the data-form name (``<kind>`` tags, ``kind``/``kinds`` entries); ``noun`` how messages call an
    item; ``placeholder`` the tokens a tag becomes. Facts (``probe``'s result) must pickle: the driver hands
    them to the workers with the validation result."""

    kind: str = ""
    noun: str = ""
    placeholder: Placeholder

    def probe(self, source: Source) -> Any:
        """The item's shape fact from its header or metadata, no decoding. Raises ``MediaError`` (or OSError)."""
        raise NotImplementedError(f"{type(self).__name__} defines no probe()")

    def probe_header(self, source: Source) -> Any:
        """``probe``'s fact read from the header alone, for ``data.validate=headers`` (default: ``probe``, for kinds
        whose probe reads only headers already). A damaged body is then found by ``decode``."""
        return self.probe(source)

    def num_tokens(self, fact: Any) -> int:
        """Placeholder tokens the item fills in the sequence."""
        raise NotImplementedError(f"{type(self).__name__} defines no num_tokens()")

    def decode(self, source: Source, fact: Any) -> Any:
        """The item's model inputs (what ``collate`` concatenates). Raises ``MediaError`` (or OSError)."""
        raise NotImplementedError(f"{type(self).__name__} defines no decode()")

    def collate(self, facts: Sequence[Any], decoded: Sequence[Any] | None) -> dict[str, torch.Tensor]:
        """A sample's ``Sample`` fields of this kind from its items (``decoded`` None: loaded without media; the
        fields are then shaped from the facts alone, with empty data tensors). No items: the empty fields."""
        raise NotImplementedError(f"{type(self).__name__} defines no collate()")

    def info(self, facts: Sequence[Any]) -> dict[str, tuple]:
        """The ``SampleInfo`` fields of a sample's items (what the family's costs read); default none."""
        return {}

    def shrink_hint(self) -> str:
        """The settings that make an item of this kind shorter, for the message on a too long sample."""
        return f"shorten the {self.noun}s"


class Processor:
    """A family's data side: its ``Media`` kinds and the position ids of a sequence. Subclass it per family."""

    family: str = ""  # the family's name, for messages
    media: tuple[Media, ...] = ()

    def kind(self, kind: str) -> Media | None:
        """The ``Media`` reading ``kind``, or None: this family reads no such media."""
        return next((m for m in self.media if m.kind == kind), None)

    def blocks(self, facts: Mapping[str, Sequence[Any]]) -> dict[str, list[list[int]]]:
        """{tag: the token ids of each item in order} for ``Tokenizer.encode_conversation``."""
        out = {}
        for kind, items in facts.items():
            media = self.kind(kind)
            if media is None:
                if items:
                    raise MediaError(f"the {self.family} processor reads no {kind}")
                continue
            out[TAGS[kind]] = [media.placeholder.block(media.num_tokens(f)) for f in items]
        return out

    def empty_media(self) -> dict[str, torch.Tensor]:
        """The media fields of a sample without media (text only)."""
        return self.collate({}, None)

    def collate(self, facts: Mapping[str, Sequence[Any]], decoded: Mapping[str, Sequence[Any]] | None
                ) -> dict[str, torch.Tensor]:
        """Every kind's ``Sample`` fields of a sample (kinds without items: their empty fields)."""
        out: dict[str, torch.Tensor] = {}
        for media in self.media:
            out |= media.collate(facts.get(media.kind, ()), None if decoded is None else decoded.get(media.kind, ()))
        return out

    def info(self, facts: Mapping[str, Sequence[Any]]) -> dict[str, tuple]:
        """The ``SampleInfo`` fields of a sample: each kind's, a field two kinds share concatenated in kind order."""
        out: dict[str, tuple] = {}
        for media in self.media:
            for name, value in media.info(facts.get(media.kind, ())).items():
                out[name] = out.get(name, ()) + tuple(value)
        return out

    def position_ids(self, sample: Any) -> torch.Tensor:
        """Position ids of a sample's sequence [axes, L]. Default: one axis counting up (plain RoPE)."""
        return torch.arange(sample.num_tokens, dtype=torch.long)[None]
