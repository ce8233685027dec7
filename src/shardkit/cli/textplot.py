"""Plain-text progress bar and curve for the command line (no dependency beyond the standard library)."""

from __future__ import annotations

import sys
from typing import Sequence, TextIO


class ProgressBar:
    """``[#########...........]  12/40 steps``: redrawn in place on a terminal; in a log (not a
    terminal) one line per quarter, so the log shows progress without a carriage-return mess."""

    def __init__(self, total: int, label: str = "steps", width: int = 30, stream: TextIO = None) -> None:
        self.total, self.label, self.width = total, label, width
        self.stream = stream or sys.stderr
        self._tty = self.stream.isatty()
        self._last_quarter = 0

    def update(self, done: int, note: str = "") -> None:
        filled = self.width * done // self.total
        count = f"{done:>{len(str(self.total))}}/{self.total}"
        line = f"[{'#' * filled}{'.' * (self.width - filled)}] {count} {self.label}"
        line += f"  {note}" if note else ""
        if self._tty:
            self.stream.write("\r" + line + ("\n" if done == self.total else ""))
        else:
            quarter = 4 * done // self.total
            if quarter == self._last_quarter:
                return
            self._last_quarter = quarter
            self.stream.write(line + "\n")
        self.stream.flush()


def curve(values: Sequence[float], width: int = 60, height: int = 8) -> str:
    """A text plot of ``values`` (one column per step, or per group of steps when there are more than
    ``width``: the group's mean), with the y range on the left and the step range below."""
    n = len(values)
    groups = min(n, width)
    bounds = [i * n // groups for i in range(groups + 1)]
    columns = [sum(values[a:b]) / (b - a) for a, b in zip(bounds, bounds[1:])]
    low, high = min(columns), max(columns)
    span = (high - low) or 1.0
    levels = [round((height - 1) * (high - v) / span) for v in columns]  # 0 = top row
    label_width = max(len(f"{high:.4f}"), len(f"{low:.4f}"))
    lines = []
    for row in range(height):
        label = f"{high:.4f}" if row == 0 else f"{low:.4f}" if row == height - 1 else ""
        marks = "".join("*" if level == row else " " for level in levels)
        lines.append(f"{label:>{label_width}} |{marks}".rstrip())
    lines.append(f"{'':>{label_width}} +{'-' * groups}")
    steps = f"step 1{'':>{max(groups - 6 - len(str(n)), 1)}}{n}"
    lines.append(f"{'':>{label_width}}  {steps}")
    return "\n".join(lines)
