"""One training run under torchrun that records what each rank gathered (used by test_prepare.py).

    torchrun --standalone --nproc_per_node=2 tests/ddp_prepared.py CONFIG RUN_DIR OUT_DIR

Each rank writes OUT_DIR/rank-R.json: the example indices of every batch it collated, the file its
source ids are memory-mapped from, and the manifest it loaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from attnkit.config.loader import load_config
from attnkit.config.schema import RunConfig
from attnkit.training.trainer import Trainer

if __name__ == "__main__":
    config, run_dir, out = sys.argv[1:4]
    trainer = Trainer(load_config(RunConfig, config), run_dir, log=lambda msg: None)
    seen: list[list[int]] = []
    collate = trainer.task.collate
    trainer.task.collate = lambda idx, device: (seen.append(list(idx)), collate(idx, device))[1]
    trainer.run()
    task = trainer.task
    record = {"seen": seen, "batches": task.batches(0)[: 2 * len(seen)], "ids_file": str(task.src.ids.filename),
              "manifest": task.manifest}
    Path(out, f"rank-{trainer.workers.rank}.json").write_text(json.dumps(record), encoding="utf-8")
