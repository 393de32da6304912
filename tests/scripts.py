"""The benchmark and experiment scripts, imported as modules by their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_script(path: str, name: str) -> ModuleType:
    """The script at ``path`` (from the repository root) imported as the module ``name``, its folder on
    ``sys.path`` first (a script imports its siblings)."""
    script = ROOT / path
    sys.path.insert(0, str(script.parent))
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
