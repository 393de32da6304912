"""Progress of a long loop: a tqdm bar on a terminal, plain periodic lines otherwise.

A bar redrawn with ``\\r`` turns a log file (CI, ``nohup``, a pipe) into hundreds of joined
updates; when stderr is not a terminal :class:`LineProgress` prints one ordinary line every
``every_seconds`` instead (and one at the end).
"""

from __future__ import annotations

import sys
import time
from typing import IO, Protocol

from tqdm import tqdm


class Progress(Protocol):
    def update(self, n: int = 1) -> None: ...
    def set_postfix(self, refresh: bool = False, **values: str) -> None: ...
    def close(self) -> None: ...


class LineProgress:
    """``what 1200/12000 (10%) loss 3.210 lr 1.0e-03, 2.5 min`` every ``every_seconds``."""

    def __init__(self, total: int, initial: int = 0, *, unit: str = "it", every_seconds: float = 30.0,
                 file: IO[str] | None = None) -> None:
        self.total, self.n, self.unit = total, initial, unit
        self.every = every_seconds
        self.file = file or sys.stderr
        self.values: dict[str, str] = {}
        self.start = self.last = time.perf_counter()
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        if time.perf_counter() - self.last >= self.every:
            self._line()

    def set_postfix(self, refresh: bool = False, **values: str) -> None:
        self.values = values

    def close(self) -> None:
        if not self.closed:
            self._line()
            self.closed = True

    def _line(self) -> None:
        self.last = time.perf_counter()
        share = f" ({100 * self.n / self.total:.0f}%)" if self.total else ""
        extra = "".join(f" {k} {v}" for k, v in self.values.items())
        minutes = (self.last - self.start) / 60
        print(f"{self.unit} {self.n}/{self.total}{share}{extra}, {minutes:.1f} min", file=self.file, flush=True)


def progress(total: int, initial: int = 0, *, unit: str = "it", enabled: bool = True,
             every_seconds: float = 30.0) -> Progress:
    """A tqdm bar when stderr is a terminal, else :class:`LineProgress`; ``enabled=False`` shows nothing."""
    if enabled and not sys.stderr.isatty():
        return LineProgress(total, initial, unit=unit, every_seconds=every_seconds)
    return tqdm(total=total, initial=initial, disable=not enabled, unit=unit, dynamic_ncols=True, file=sys.stderr)
