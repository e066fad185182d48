"""Train a few steps under a layout and compare it with the single-process reference (distributed tests).

A test harness, not part of the ``dhp`` package: ``run_steps`` trains through the real backend chosen by the
overrides (``runtime.backend=local`` is the reference), ``assert_matches_reference`` holds a layout to it:
the same per-step losses and token counts, and the same weights on every rank of every group, where every
module has moved (so equal weights mean something).
"""

from __future__ import annotations

import pytest

from dhp.backends import make_backend
from dhp.config import load_config
from dhp.inputs import prepare

STEPS = 3


def run_steps(overrides: list[str], steps: int = STEPS):
    """(per-step stats, each group's per-rank state dicts after the steps, the same before them)."""
    run = prepare(load_config(None, overrides))
    backend = make_backend(run.inputs, run.dataset, run.spec)
    try:
        initial = backend.rank_state_dicts()
        stats = [backend.run_step(run.planner.plan(s)) for s in range(steps)]
        return stats, backend.rank_state_dicts(), initial
    finally:
        backend.shutdown()


def assert_matches_reference(stats, state, reference, rel: float = 1e-5, atol: float = 1e-5) -> None:
    """Losses within ``rel``; every rank's weights within ``atol`` of the reference's; every module moved."""
    ref_stats, ref_state, initial = reference
    assert [s.loss for s in stats] == pytest.approx([s.loss for s in ref_stats], rel=rel)
    assert [s.supervised_tokens for s in stats] == [s.supervised_tokens for s in ref_stats]
    for module, ranks in state.items():
        want, start = ref_state[module][0], initial[module][0]
        moved = max((want[k] - start[k]).abs().max().item() for k in want)
        assert moved > 1e-4, module  # every module trained, so equal weights mean something
        for rank, got in enumerate(ranks):  # every replica / rank of every group
            assert got.keys() == want.keys()
            worst = max((got[k] - want[k]).abs().max().item() for k in want)
            assert worst < atol, (module, rank, worst)
