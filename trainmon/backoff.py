"""One backoff policy for everything that waits before trying again: the producer's
resends to Kafka, the consumer runtime's retries of a sink, the supervisor's restarts.

Exponential: the first wait is ``first_s``, each next one twice the last, up to
``max_s``; ``jitter_s`` adds a random part (so that many clients that failed together
do not all come back at the same moment). ``reset`` after a success.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class Backoff:
    first_s: float
    max_s: float
    jitter_s: float = 0.0
    current_s: float = field(init=False)

    def __post_init__(self) -> None:
        self.current_s = self.first_s

    @property
    def fresh(self) -> bool:
        """No failure since the start or the last reset."""
        return self.current_s == self.first_s

    def next(self) -> float:
        """The wait now; the next one grows."""
        wait = self.current_s
        self.current_s = min(self.current_s * 2, self.max_s)
        return wait + (random.uniform(0, self.jitter_s) if self.jitter_s else 0.0)

    def reset(self) -> None:
        self.current_s = self.first_s

    def wait_before(self, attempt: int) -> float:
        """The wait before try ``attempt + 1`` (1: after the first failure), without
        state: for retry loops that count attempts themselves (tenacity's ``wait``)."""
        wait = min(self.first_s * 2 ** max(0, attempt - 1), self.max_s)
        return wait + (random.uniform(0, self.jitter_s) if self.jitter_s else 0.0)
