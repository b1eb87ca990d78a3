"""Progress bars (tqdm) for long work, drawn only when a person watches: on a terminal, never in logs or tests.

    with progress(total=n, desc="loading blocks 0:10", unit="block") as bar:
        ...; bar.update(1)

Off (a no-op bar) when the stream, stderr by default, is not a TTY, so that CI logs, log files and captured
output stay clean.
"""

from __future__ import annotations

import sys
from typing import IO

from tqdm import tqdm


def progress_enabled(stream: IO | None = None) -> bool:
    """Whether bars are drawn on `stream` (default: stderr): only if it is a terminal."""
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def progress(*, total: float | None, desc: str, unit: str = "it", stream: IO | None = None, **options) -> tqdm:
    """A tqdm bar on `stream` (default: stderr), disabled (updates do nothing) unless that stream is a TTY.

    Args:
        total: how many units the work has (None: unknown, the bar counts).
        desc: what the work is, shown left of the bar.
        unit: the unit of `total` and of `update()`.
        options: passed to tqdm (unit_scale, leave, ...).
    """
    stream = sys.stderr if stream is None else stream
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        file=stream,
        disable=not progress_enabled(stream),
        dynamic_ncols=True,
        **options,
    )
