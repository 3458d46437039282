"""Rolling windows the rules compare a new value against: a median (and MAD), and two
halves of a long window.

Their memory is what bounds the engine's: at 16,384 ranks it holds some ten windows per
rank. Values sit in typed arrays (8 bytes each, no float object per value), and the long
window of a trend (``TwoHalves``, 1,000 losses by default) keeps at most ``MAX_BLOCKS``
block medians per half instead of every value, so a rank costs the same after a million
steps as after a thousand. A window is a plain list (or dict of lists) in a checkpoint.
"""

from __future__ import annotations

import bisect
import math
from array import array


class RollingMedian:
    """Median of the last ``size`` values: the values in arrival order, and sorted."""

    __slots__ = ("size", "values", "_sorted")

    def __init__(self, size: int, values=()):
        self.size = size
        self.values = array("d")
        self._sorted = array("d")
        for v in values:
            self.push(v)

    def __len__(self) -> int:
        return len(self.values)

    def push(self, value: float) -> None:
        values = self.values
        if len(values) == self.size:
            del self._sorted[bisect.bisect_left(self._sorted, values[0])]
            del values[0]  # (a memmove of at most a few KB)
        values.append(value)
        bisect.insort(self._sorted, value)

    @property
    def median(self) -> float:
        return _median(self._sorted)

    def mad(self) -> float:
        """Median absolute deviation from the median (0.0 for fewer than two values)."""
        s = self._sorted
        if len(s) < 2:
            return 0.0
        med = _median(s)
        return _median(sorted(abs(v - med) for v in s))

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
        return self.values.tolist()


def _median(s) -> float:
    """The median of sorted values (0.0 for none)."""
    n = len(s)
    if not n:
        return 0.0
    mid = n // 2
    return s[mid] if n % 2 else (s[mid - 1] + s[mid]) / 2.0


class TwoHalves:
    """The last ``size`` values split into an older and a newer half with the median of
    each, so a trend (flat or rising) shows as newer median >= older median, and one
    spike does not move it.

    A half of more than ``MAX_BLOCKS`` values is kept as the medians of blocks of
    ``block`` consecutive values (the medians of the halves are then medians of block
    medians): a window of 1,000 losses costs 100 numbers, not 1,000. The halves move on
    by whole blocks; values of a block still filling wait in ``pending``. Up to
    ``MAX_BLOCKS`` values a half, the block is one value and the medians are exact."""

    MAX_BLOCKS = 50
    __slots__ = ("half", "block", "older", "newer", "pending")

    def __init__(self, size: int, values=()):
        self.half = max(1, size // 2)
        self.block = -(-self.half // self.MAX_BLOCKS)  # ceil
        blocks = self.half // self.block
        self.older = RollingMedian(blocks)
        self.newer = RollingMedian(blocks)
        self.pending = array("d")
        if isinstance(values, dict):  # a checkpoint's: block medians, as dumped
            for v in values.get("older", ()):
                self.older.push(v)
            for v in values.get("newer", ()):
                self.newer.push(v)
            self.pending.extend(values.get("pending", ()))
            return
        for v in values:
            self.push(v)

    @property
    def full(self) -> bool:
        return len(self.older) == self.older.size

    def push(self, value: float) -> None:
        if self.block > 1:
            self.pending.append(value)
            if len(self.pending) < self.block:
                return
            value = _median(sorted(self.pending))
            del self.pending[:]
        newer = self.newer
        if len(newer) == newer.size:
            self.older.push(newer.values[0])
        newer.push(value)

    @property
    def older_median(self) -> float:
        return self.older.median

    @property
    def newer_median(self) -> float:
        return self.newer.median

    def dump(self) -> list[float] | dict[str, list[float]]:
        if self.block == 1:  # the values themselves
            return [*self.older.values, *self.newer.values]
        return {"older": self.older.dump(), "newer": self.newer.dump(), "pending": self.pending.tolist()}
