"""Where a command's progress messages go: one line on standard error, above any progress bar, or nowhere.

Commands hand one of these to the code that reports as it goes (preparing data, training), as its
``log``; a distributed run gives :func:`silent` to every process but the first.
"""

from __future__ import annotations

import sys

from tqdm import tqdm


def to_stderr(message: str) -> None:
    """``message`` as one line on standard error (``tqdm.write``: a progress bar on screen is redrawn below it)."""
    tqdm.write(message, file=sys.stderr)


def silent(message: str) -> None:
    """Drop ``message`` (the processes of a distributed run that do not report)."""
