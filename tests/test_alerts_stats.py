"""The rules' rolling windows: exact medians while small, a bounded summary when long."""

import json
import random
import statistics

from trainmon.consumers.alerts.stats import RollingMedian, TwoHalves


def test_a_rolling_median_keeps_the_last_values_and_their_median_and_mad():
    w = RollingMedian(5)
    values = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0]
    for v in values:
        w.push(v)
    last = values[-5:]
    assert w.dump() == last and len(w) == 5
    assert w.median == statistics.median(last)
    assert w.mad() == statistics.median(abs(v - statistics.median(last)) for v in last)


def test_short_halves_are_exact_and_dump_their_values():
    h = TwoHalves(8)
    for v in range(1, 11):
        h.push(float(v))
    assert h.full and h.block == 1
    assert h.dump() == [3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert (h.older_median, h.newer_median) == (4.5, 8.5)


def test_a_long_window_keeps_block_medians_only_and_follows_the_true_medians():
    rng = random.Random(3)
    size = 1000
    h, raw = TwoHalves(size), []
    for step in range(5000):  # a falling loss with noise, then flat
        v = 2.0 + 3.0 * max(0.0, 1 - step / 3000) + rng.gauss(0, 0.05)
        h.push(v)
        raw.append(v)
        kept = len(h.older) + len(h.newer) + len(h.pending)
        assert kept <= 2 * TwoHalves.MAX_BLOCKS + h.block  # whatever the history's length
    assert h.full and h.block == 10
    # (Its halves move by whole blocks: they cover the values up to the last full block.)
    upto = len(raw) - len(h.pending)
    older, newer = raw[upto - size:upto - size // 2], raw[upto - size // 2:upto]
    assert abs(h.older_median - statistics.median(older)) < 0.02
    assert abs(h.newer_median - statistics.median(newer)) < 0.02
    back = TwoHalves(size, json.loads(json.dumps(h.dump())))  # a checkpoint's round trip
    assert (back.older_median, back.newer_median, back.pending.tolist()) == \
        (h.older_median, h.newer_median, h.pending.tolist())
