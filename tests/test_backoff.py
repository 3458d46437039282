"""The one backoff policy (trainmon/backoff.py): what every retry loop waits."""

from trainmon.backoff import Backoff


def test_waits_double_up_to_the_cap_and_start_over_after_a_reset():
    backoff = Backoff(first_s=0.5, max_s=5.0)
    assert backoff.fresh
    assert [backoff.next() for _ in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert not backoff.fresh
    backoff.reset()
    assert backoff.fresh and backoff.next() == 0.5


def test_a_counted_attempt_waits_as_the_stateful_sequence_does():
    stateful = Backoff(first_s=0.05, max_s=1.0)
    assert [Backoff(0.05, 1.0).wait_before(n) for n in range(1, 8)] == [stateful.next() for _ in range(7)]


def test_jitter_adds_at_most_its_bound():
    backoff = Backoff(first_s=1.0, max_s=30.0, jitter_s=1.0)
    waits = [backoff.wait_before(3) for _ in range(200)]
    assert all(4.0 <= w <= 5.0 for w in waits) and len(set(waits)) > 1
