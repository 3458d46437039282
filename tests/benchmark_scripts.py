"""A benchmark script (benchmarks/NAME.py) imported by a test under its own file name,
with benchmarks/ kept off sys.path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """Under its own name: processes a benchmark spawns import it by that name, and its
    dataclasses look their module up in sys.modules while it loads."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
