"""A run's ``metrics.jsonl`` read back: one JSON object per line, the row of a finished step each.

The driver writes each row with one write and a flush, but a run killed in that write (SIGKILL, a full disk)
leaves its last line cut short. That line holds no finished step's row: it is left out, so that the run resumes
and ``dhp report`` draws it. A damaged line anywhere else is an error naming the file, the line and the fix.
A leaf: imports nothing of dhp but its errors.
"""

from __future__ import annotations

import json

from dhp.errors import UsageError


def metric_rows(text: str, where: object) -> list[tuple[str, dict]]:
    """``(line, row)`` of every row of ``text`` (the contents of metrics.jsonl ``where``), blank lines and a cut
    last line left out."""
    lines = [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    out = []
    for k, (n, line) in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            row = None
        if isinstance(row, dict) and "step" in row:
            out.append((line, row))
        elif k == len(lines) - 1 and not text.endswith("\n"):  # cut short by a killed run: not a finished step
            continue
        else:
            raise UsageError(f"{where}: line {n} is not a step's row ({line[:60]!r}); remove that line (the rows are "
                             "one JSON object per step) or start the run over (output.overwrite=true)")
    return out


__all__ = ["metric_rows"]
