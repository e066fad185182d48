"""``rope_index`` equals transformers' ``get_rope_index`` of Qwen2.5-VL (single, multi-image, text-only, batch > 1)."""

from __future__ import annotations

import pytest
import torch

from dhp.models.qwen2_5_vl.mrope import rope_index
from tests.hf_reference import tiny_cfg

CFG = tiny_cfg()
IMG, VS, VE = CFG.image_token_id, CFG.vision_start_token_id, CFG.vision_end_token_id


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**CFG.to_hf_dict())).eval()


def _row(parts: list, grids: list[tuple[int, int, int]]) -> list[int]:
    """parts: ints are text lengths, 'I' an image (its grid taken in order from grids)."""
    out: list[int] = []
    grids = iter(grids)
    for p in parts:
        if p == "I":
            t, h, w = next(grids)
            out += [VS] + [IMG] * (t * h * w // 4) + [VE]
        else:
            out += [(7 * len(out) + k) % 200 + 1 for k in range(p)]
    return out


def _reference(model, input_ids: torch.Tensor, grid: torch.Tensor | None) -> torch.Tensor:
    mm = (input_ids == IMG).int()
    pos, _ = model.model.get_rope_index(input_ids, mm, image_grid_thw=grid)
    return pos


CASES = {
    "single image": ([[5, "I", 7]], [(1, 4, 6)]),
    "multi image, different sizes": ([[3, "I", 2, "I", 4, "I", 1]], [(1, 8, 4), (1, 2, 2), (1, 6, 10)]),
    "text only": ([[12]], []),
    "image first and last": ([["I", 3, "I"]], [(1, 4, 4), (1, 2, 8)]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_single_row_matches_transformers(hf_model, name: str) -> None:
    rows, grids = CASES[name]
    ids = torch.tensor([_row(rows[0], grids)])
    grid = torch.tensor(grids, dtype=torch.long) if grids else None
    ours = rope_index(ids, grid, IMG, VS, spatial_merge_size=2)
    assert torch.equal(ours, _reference(hf_model, ids, grid))
    if grid is None:
        assert torch.equal(ours, torch.arange(ids.shape[1]).expand(3, 1, -1))
    assert ours.shape == (3, 1, ids.shape[1])


def test_batch_of_rows_matches_transformers(hf_model) -> None:
    row_parts = [[5, "I", 7, "I", 3], [2, "I", 30], [4, "I", 1, "I", 2]]
    row_grids = [[(1, 4, 6), (1, 2, 4)], [(1, 10, 2)], [(1, 6, 6), (1, 4, 12)]]
    rows = [_row(p, g) for p, g in zip(row_parts, row_grids, strict=True)]
    length = max(len(r) for r in rows)
    rows = [r + [1] * (length - len(r)) for r in rows]  # pad with text so rows have equal length
    ids = torch.tensor(rows)
    grid = torch.tensor([g for gs in row_grids for g in gs], dtype=torch.long)
    ours = rope_index(ids, grid, IMG, VS)
    ref = _reference(hf_model, ids, grid)
    assert torch.equal(ours, ref)
    # grid (1, 4, 6) = 2x3 merged tokens at position p: last one (p, p+1, p+2); the text after it resumes at p+3
    p = rows[0].index(IMG)
    assert ours[:, 0, p].tolist() == [p] * 3
    assert ours[:, 0, p + 5].tolist() == [p, p + 1, p + 2]
    assert ours[:, 0, p + 6].tolist() == [p + 3] * 3
