"""Rolling windows the rules compare a new value against (mean, median and MAD, max, two halves).

Each keeps its values in a bounded deque so its state is a plain list in a checkpoint.
"""

from __future__ import annotations

import bisect
import math
from collections import deque


class RollingMean:
    __slots__ = ("values", "total", "_pushes")

    def __init__(self, size: int, values=()):
        self.values: deque[float] = deque(maxlen=size)
        self.total = 0.0
        self._pushes = 0
        for v in values:
            self.push(v)

    def __len__(self) -> int:
        return len(self.values)

    def push(self, value: float) -> None:
        if len(self.values) == self.values.maxlen:
            self.total -= self.values[0]
        self.values.append(value)
        self.total += value
        self._pushes += 1
        if self._pushes % 10_000 == 0:  # running sums drift; re-add now and then
            self.total = sum(self.values)

    @property
    def mean(self) -> float:
        return self.total / len(self.values) if self.values else 0.0

    def dump(self) -> list[float]:
        return list(self.values)


class RollingMedian:
    """Median of the last ``size`` values: a deque for order, a sorted list for rank."""

    __slots__ = ("values", "_sorted")

    def __init__(self, size: int, values=()):
        self.values: deque[float] = deque(maxlen=size)
        self._sorted: list[float] = []
        for v in values:
            self.push(v)

    def __len__(self) -> int:
        return len(self.values)

    def push(self, value: float) -> None:
        if len(self.values) == self.values.maxlen:
            oldest = self.values[0]
            del self._sorted[bisect.bisect_left(self._sorted, oldest)]
        self.values.append(value)
        bisect.insort(self._sorted, value)

    @property
    def median(self) -> float:
        s = self._sorted
        n = len(s)
        if not n:
            return 0.0
        mid = n // 2
        return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2.0

    def mad(self) -> float:
        """Median absolute deviation from the median (0.0 for fewer than two values)."""
        s = self._sorted
        if len(s) < 2:
            return 0.0
        med = self.median
        deviations = sorted(abs(v - med) for v in s)
        n = len(deviations)
        mid = n // 2
        return deviations[mid] if n % 2 else (deviations[mid - 1] + deviations[mid]) / 2.0

    def robust_z(self, value: float) -> float:
        """Iglewicz and Hoaglin's modified z-score of ``value`` against the window:
        0.6745 (value - median) / MAD; inf when the window has no spread (MAD 0) and the
        value differs from its median. 3.5 is their usual outlier limit."""
        diff = value - self.median
        mad = self.mad()
        if mad > 0:
            return 0.6745 * diff / mad
        return 0.0 if diff == 0 else math.copysign(math.inf, diff)

    def dump(self) -> list[float]:
        return list(self.values)


class RollingMax:
    __slots__ = ("values",)

    def __init__(self, size: int, values=()):
        self.values: deque[float] = deque(values, maxlen=size)

    def push(self, value: float) -> None:
        self.values.append(value)

    @property
    def max(self) -> float:
        return max(self.values) if self.values else 0.0

    def dump(self) -> list[float]:
        return list(self.values)


class TwoHalves:
    """The last ``size`` values split into an older and a newer half with the median of
    each, so a trend (flat or rising) shows as newer median >= older median, and one
    spike does not move it."""

    __slots__ = ("half", "older", "newer")

    def __init__(self, size: int, values=()):
        self.half = max(1, size // 2)
        self.older = RollingMedian(self.half)
        self.newer = RollingMedian(self.half)
        for v in values:
            self.push(v)

    @property
    def full(self) -> bool:
        return len(self.older) == self.half

    def push(self, value: float) -> None:
        if len(self.newer) == self.half:
            self.older.push(self.newer.values[0])
        self.newer.push(value)

    @property
    def older_median(self) -> float:
        return self.older.median

    @property
    def newer_median(self) -> float:
        return self.newer.median

    def dump(self) -> list[float]:
        return [*self.older.values, *self.newer.values]
