"""Several ``attnkit train`` command lines in one torchrun launch (used by test_distributed.py).

    torchrun --standalone --nproc_per_node=2 tests/ddp_runs.py '[["train", "a.yaml", "--run-dir", "r"], ...]'

Each process imports torch and attnkit once and runs the command lines one after the other
through :func:`attnkit.cli.main`, in one process group: starting processes is the slow part.
"""

from __future__ import annotations

import json
import sys

from attnkit.cli import main

if __name__ == "__main__":
    for argv in json.loads(sys.argv[1]):
        code = main(argv)
        if code:
            sys.exit(code)
