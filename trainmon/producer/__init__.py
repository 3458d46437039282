"""The in-process producer a training job imports.

Module-level calls use one producer per process, configured from the environment:

    import trainmon.producer as tm
    tm.log_step(step, epoch=..., step_tokens=..., duration_ms=..., loss=..., norm=..., lr=...)
"""

from __future__ import annotations

import threading
from typing import Any

from .config import ProducerConfig
from .logger import Producer

_default: Producer | None = None
_default_lock = threading.Lock()


def get_producer() -> Producer:
    global _default
    if _default is None:
        with _default_lock:
            if _default is None:
                _default = Producer()
    return _default


def log_step(step: int, **fields: Any) -> bool:
    return get_producer().log_step(step, **fields)


def log_eval(step: int, **fields: Any) -> bool:
    return get_producer().log_eval(step, **fields)


def log_moe_stats(step: int, **fields: Any) -> bool:
    return get_producer().log_moe_stats(step, **fields)


def log_gpu_state(step: int, **fields: Any) -> bool:
    return get_producer().log_gpu_state(step, **fields)


def log_allocator(step: int, stats: list[dict], **fields: Any) -> bool:
    return get_producer().log_allocator(step, stats, **fields)


def log_dataset(split: str, **fields: Any) -> bool:
    return get_producer().log_dataset(split, **fields)


def log_gpu_model(**fields: Any) -> bool:
    return get_producer().log_gpu_model(**fields)


def run_start(config: dict | None = None, **fields: Any) -> bool:
    return get_producer().run_start(config, **fields)


def run_end(status: str = "success", **fields: Any) -> bool:
    return get_producer().run_end(status, **fields)


def flush(timeout: float = 10.0) -> bool:
    return get_producer().flush(timeout)


__all__ = ["Producer", "ProducerConfig", "get_producer", "log_step", "log_eval", "log_moe_stats",
           "log_gpu_state", "log_allocator", "log_dataset", "log_gpu_model", "run_start",
           "run_end", "flush"]
