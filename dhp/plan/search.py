"""The largest size that fits a budget: doubling, then bisection, over a probe of any kind.

One search for two callers: ``dhp bench --max-vision-tokens`` probes real runs (each probe a measured training
step), the planner (``planner.largest_fitting``) probes its own predictions; the same search makes the two
answers comparable, size for size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Growth:
    """One search: the largest size that fit, the first that did not (None: none / the cap fit), the probes."""

    largest: int | None
    first_failed: int | None
    probes: list[tuple[int, int]] = field(default_factory=list)  # (size, peak bytes)


def grow(probe: Callable[[int], int], budget: int, start: int, stop: int, step: int) -> Growth:
    """Double from ``start`` (the last probe capped at ``stop``) while the peak stays within ``budget``,
    then bisect between the last fit and the first failure until they are ``step`` apart. Every size is a
    multiple of ``step`` when ``start`` and ``stop`` are; memory is taken as growing with the size (the
    probes are recorded, so a reader can check)."""
    out = Growth(None, None)

    def fits(n: int) -> bool:
        peak = probe(n)
        out.probes.append((n, peak))
        return peak <= budget

    n = start
    while True:
        if not fits(n):
            out.first_failed = n
            break
        out.largest = n
        if n >= stop:
            return out
        n = min(2 * n, stop)
    while out.largest is not None and out.first_failed - out.largest > step:
        mid = out.largest + step * max(1, (out.first_failed - out.largest) // step // 2)
        if fits(mid):
            out.largest = mid
        else:
            out.first_failed = mid
    return out
