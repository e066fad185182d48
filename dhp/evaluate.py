"""Held-out evaluation: token-mean loss, and exact match of greedily decoded answers.

The answer of a sample is its last assistant reply (the last run of supervised
labels); the prompt is everything before it. Greedy decoding recomputes the
whole sequence at each new token: simple, and cheap at the demo's sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dhp.data.batch import Sample, shifted_targets
from dhp.data.tokenizer import Tokenizer
from dhp.models.qwen2_5_vl import Qwen2_5_VL


def last_reply_span(labels: torch.Tensor) -> tuple[int, int]:
    """[start, end) of the last contiguous run of supervised labels."""
    sup = (labels != -100).nonzero().flatten().tolist()
    if not sup:
        raise ValueError("sample has no supervised tokens")
    end = sup[-1] + 1
    start = end - 1
    while start - 1 >= 0 and labels[start - 1] != -100:
        start -= 1
    return start, end


@torch.no_grad()
def greedy_answer(model: Qwen2_5_VL, sample: Sample, stop_id: int, max_new_tokens: int) -> list[int]:
    start, _ = last_reply_span(sample.labels)
    ids = sample.input_ids[:start].tolist()
    embeds = model.visual(sample.pixel_values, sample.image_grid_thw) if sample.num_patches else None
    grid = sample.image_grid_thw if sample.num_patches else None
    out: list[int] = []
    for _ in range(max_new_tokens):
        x = torch.tensor([ids])
        logits = model.language(x, model.position_ids(x, grid), embeds)
        nxt = int(logits[0, -1].argmax())
        if nxt == stop_id:
            break
        out.append(nxt)
        ids.append(nxt)
    return out


@torch.no_grad()
def evaluate(model: Qwen2_5_VL, dataset, tok: Tokenizer, max_samples: int, max_new_tokens: int) -> dict:
    model.eval()
    n = min(len(dataset), max_samples)
    correct, loss_sum, n_tok = 0, 0.0, 0
    examples = []
    for i in range(n):
        s = dataset[i]
        start, end = last_reply_span(s.labels)
        reference = tok.decode(s.input_ids[start:end].tolist()).strip()
        answer = tok.decode(greedy_answer(model, s, tok.im_end_id, max_new_tokens)).strip()
        correct += answer == reference
        if len(examples) < 5:
            examples.append({"sample": s.index, "reference": reference, "answer": answer})
        x = s.input_ids[None]
        embeds = model.visual(s.pixel_values, s.image_grid_thw) if s.num_patches else None
        logits = model.language(x, s.position_ids[:, None], embeds)
        targets = shifted_targets(s.labels)
        loss_sum += float(F.cross_entropy(logits[0], targets, ignore_index=-100, reduction="sum"))
        n_tok += int((targets != -100).sum())
    model.train()
    return {"samples": n, "accuracy": correct / max(n, 1), "loss": loss_sum / max(n_tok, 1), "examples": examples}
