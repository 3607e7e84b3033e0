"""Progress bars (bytes, rate, ETA) for the long reads and copies of the command line.

The library's own paths report nothing unless asked: a :class:`Progress` is a thread-safe bytes
counter that draws a ``tqdm`` bar on stderr only when it is enabled (the command line enables it
when stderr is a terminal and ``--json`` is not given). Two ways feed it:

* :func:`counting` routes :data:`ckpt.integrity.on_bytes` to it while a block runs: every chunk a
  tier reads and verifies, or writes, is checksummed once, so the bar counts the bytes a ``verify``,
  ``gc`` or ``promote`` has done, with no change to the tiers' read and write loops. While no block
  runs the hook is ``None`` and costs one comparison per chunk.
* :func:`ckpt.export` calls it from the function that fetches and verifies each chunk.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Any, Iterator

from . import integrity

__all__ = ["Progress", "counting", "wanted"]


def wanted(quiet: bool = False) -> bool:
    """Whether to draw bars: not ``quiet``, and stderr is a terminal."""
    if quiet:
        return False
    try:
        return sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed stderr
        return False


def _size() -> tuple[int, int]:
    """Columns and lines of the terminal on stderr (0 when it does not say)."""
    try:
        return tuple(os.get_terminal_size(sys.stderr.fileno()))  # type: ignore[return-value]
    except (AttributeError, ValueError, OSError):
        return 0, 0


class Progress:
    """Counts bytes (from any thread); draws a bar of ``total`` bytes on stderr when ``enabled``.

    ``weight``: how much each reported byte counts (``0.5`` when every byte of the work is reported
    twice, e.g. checked once as it is downloaded and once as it is written). A total that turns out
    too small grows with the count, so the bar never runs past 100 %."""

    def __init__(self, total: float | None, desc: str, enabled: bool, weight: float = 1.0) -> None:
        self.done = 0.0
        self.weight = weight
        self._lock = threading.Lock()
        self._bar: Any = None
        if enabled:
            from tqdm import tqdm

            # a terminal that reports no size (a pty nobody sized) would make tqdm draw nothing at all
            cols, rows = _size()
            self._bar = tqdm(
                total=total,
                desc=desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=sys.stderr,
                leave=False,
                dynamic_ncols=cols > 0 and rows > 0,
                ncols=None if cols > 0 else 80,
                nrows=None if rows > 0 else 24,
                mininterval=0.2,
                smoothing=0.1,
            )

    def __call__(self, nbytes: int) -> None:
        n = nbytes * self.weight
        with self._lock:
            self.done += n
            bar = self._bar
            if bar is not None:
                if bar.total is not None and self.done > bar.total:
                    bar.total = self.done
                bar.update(n)

    def close(self) -> None:
        with self._lock:
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.close()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@contextlib.contextmanager
def counting(progress: Progress) -> Iterator[Progress]:
    """While the block runs, every byte checksummed in this process is reported to ``progress``."""
    previous = integrity.on_bytes
    integrity.on_bytes = progress
    try:
        yield progress
    finally:
        integrity.on_bytes = previous
        progress.close()
