"""Held-out evaluation: token-mean loss, and exact match of greedily decoded answers.

The answer of a sample is its last assistant reply (the last run of supervised
labels); the prompt is everything before it. Greedy decoding recomputes the
whole sequence at each new token: simple, and cheap at the demo's sizes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from dhp.data.batch import IGNORE_INDEX, Sample, shifted_targets
from dhp.data.tokenizer import Tokenizer
from dhp.progress import Progress


class EvalModel(Protocol):
    """What a family's whole model (``Family.full_model``) offers evaluation."""

    def encode_media(self, sample: Sample) -> Any: ...  # every encoder's embeddings of the sample
    def sample_logits(self, input_ids: torch.Tensor, sample: Sample, media: Any) -> torch.Tensor: ...  # [1, L, V]
    def eval(self) -> Any: ...
    def train(self, mode: bool = True) -> Any: ...


def last_reply_span(labels: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the last contiguous run of supervised labels."""
    sup = (labels != IGNORE_INDEX).nonzero().flatten().tolist()
    if not sup:
        raise ValueError("sample has no supervised tokens")
    end = sup[-1] + 1
    start = end - 1
    while start - 1 >= 0 and labels[start - 1] != IGNORE_INDEX:
        start -= 1
    return start, end


@torch.no_grad()
def greedy_answer(model: EvalModel, sample: Sample, stop_id: int, max_new_tokens: int) -> list[int]:
    start, _ = last_reply_span(sample.labels)
    ids = sample.input_ids[:start].tolist()
    media = model.encode_media(sample)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model.sample_logits(torch.tensor([ids]), sample, media)
        nxt = int(logits[0, -1].argmax())
        if nxt == stop_id:
            break
        out.append(nxt)
        ids.append(nxt)
    return out


@torch.no_grad()
def evaluate(model: EvalModel, dataset, tok: Tokenizer, max_samples: int, max_new_tokens: int,
             progress: bool = True) -> dict:
    """Exact match and token-mean loss on the first ``max_samples`` samples; with ``progress``, a bar on a
    terminal (stderr) or a line at every tenth of the samples."""
    model.eval()
    n = min(len(dataset), max_samples)
    correct, loss_sum, n_tok = 0, 0.0, 0
    examples = []
    bar = Progress(n, "evaluating held-out samples", after_s=0.0 if progress else float("inf"))
    for i in range(n):
        s = dataset[i]
        start, end = last_reply_span(s.labels)
        reference = tok.decode(s.input_ids[start:end].tolist()).strip()
        answer = tok.decode(greedy_answer(model, s, tok.im_end_id, max_new_tokens)).strip()
        correct += answer == reference
        if len(examples) < 5:
            examples.append({"sample": s.index, "reference": reference, "answer": answer})
        logits = model.sample_logits(s.input_ids[None], s, model.encode_media(s))
        targets = shifted_targets(s.labels)
        loss_sum += float(F.cross_entropy(logits[0], targets, ignore_index=IGNORE_INDEX, reduction="sum"))
        n_tok += int((targets != IGNORE_INDEX).sum())
        bar.update()
    bar.close()
    model.train()
    return {"samples": n, "accuracy": correct / max(n, 1), "loss": loss_sum / max(n_tok, 1), "examples": examples}
