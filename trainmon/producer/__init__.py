"""The in-process producer a training job imports.

Module-level calls use one producer per process, configured from the environment:

    import trainmon.producer as tm
    tm.log_step(step, epoch=..., step_tokens=..., duration_ms=..., loss=..., norm=..., lr=...)
    tm.run_end("failed", reason="CUDA out of memory")
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


# Arguments pass through untouched (``*args``), so that a call Python itself would refuse
# (a missing or doubled argument) reaches the producer, which never raises for it in the
# default mode: see Producer.log_step and friends for the arguments.
def log_step(*args: Any, **fields: Any) -> bool:
    """``log_step(step, loss=..., epoch=, step_tokens=, duration_ms=, norm=, lr=, **megatron)``"""
    return get_producer().log_step(*args, **fields)


def log_eval(*args: Any, **fields: Any) -> bool:
    """``log_eval(step, loss=..., epoch=, eval_tokens=, duration_ms=)``"""
    return get_producer().log_eval(*args, **fields)


def log_moe_stats(*args: Any, **fields: Any) -> bool:
    return get_producer().log_moe_stats(*args, **fields)


def log_gpu_state(*args: Any, **fields: Any) -> bool:
    return get_producer().log_gpu_state(*args, **fields)


def log_gpu_health(*args: Any, **fields: Any) -> bool:
    return get_producer().log_gpu_health(*args, **fields)


def log_checkpoint(*args: Any, **fields: Any) -> bool:
    """``log_checkpoint(step, path=, bytes=, duration_ms=, free_bytes=, total_bytes=)``: a
    finished save. With TRAINMON_CHECKPOINT_DIR set, free space is sampled too."""
    return get_producer().log_checkpoint(*args, **fields)


def log_disk(*args: Any, **fields: Any) -> bool:
    return get_producer().log_disk(*args, **fields)


def log_event(*args: Any, **fields: Any) -> bool:
    """``log_event(level, source, text, count=1)``: a warning or error worth keeping."""
    return get_producer().log_event(*args, **fields)


def log_allocator(*args: Any, **fields: Any) -> bool:
    return get_producer().log_allocator(*args, **fields)


def log_dataset(*args: Any, **fields: Any) -> bool:
    return get_producer().log_dataset(*args, **fields)


def log_gpu_model(**fields: Any) -> bool:
    return get_producer().log_gpu_model(**fields)


def run_start(*args: Any, **fields: Any) -> bool:
    """``run_start(config=None, name=, project=, hostnames=, versions=)``"""
    return get_producer().run_start(*args, **fields)


def run_end(*args: Any, **fields: Any) -> bool:
    """``run_end(status="success", reason=None)``: reason says why it ended."""
    return get_producer().run_end(*args, **fields)


def flush(timeout: float = 10.0) -> bool:
    return get_producer().flush(timeout)


__all__ = ["Producer", "ProducerConfig", "get_producer", "log_step", "log_eval", "log_moe_stats",
           "log_gpu_state", "log_gpu_health", "log_checkpoint", "log_disk", "log_event",
           "log_allocator", "log_dataset", "log_gpu_model", "run_start", "run_end", "flush"]
