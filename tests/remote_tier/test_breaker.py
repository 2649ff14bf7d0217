"""Circuit breaker state machine, driven by a fake clock."""

from __future__ import annotations

import pytest

from remote_tier.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _breaker(clock: Clock) -> CircuitBreaker:
    return CircuitBreaker(failures=3, cooldown_s=1.0, max_cooldown_s=5.0, clock=clock)


def test_opens_after_consecutive_failures_only() -> None:
    clock = Clock()
    b = _breaker(clock)
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the count
    b.record_failure()
    b.record_failure()
    assert b.state == "closed" and b.allow()
    b.record_failure()
    assert b.state == "open" and not b.allow()
    assert b.num_opened == 1


def test_half_open_admits_one_probe_and_success_closes() -> None:
    clock = Clock()
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now = 0.999
    assert not b.allow()
    clock.now = 1.0
    assert b.state == "half_open"
    assert b.allow()  # the probe
    assert not b.allow()  # everyone else waits for its verdict
    b.record_success()
    assert b.state == "closed" and b.allow()
    assert b.cooldown_s == 1.0


def test_failed_probes_back_off_exponentially_up_to_the_cap() -> None:
    clock = Clock()
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    opened_at, expected = 0.0, [2.0, 4.0, 5.0, 5.0]
    cooldown = 1.0
    for nxt in expected:
        clock.now = opened_at + cooldown
        assert b.allow()
        b.record_failure()
        assert b.state == "open"
        opened_at, cooldown = clock.now, nxt
        assert b.cooldown_s == nxt
        clock.now = opened_at + nxt - 0.01
        assert not b.allow()
    clock.now = opened_at + cooldown
    assert b.allow()
    b.record_success()
    assert b.cooldown_s == 1.0 and b.state == "closed"


def test_abandoned_probe_lets_the_next_call_probe() -> None:
    clock = Clock()
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    clock.now = 1.0
    assert b.allow()
    b.abandon()
    assert b.allow()


def test_late_failure_while_open_changes_nothing() -> None:
    clock = Clock()
    b = _breaker(clock)
    for _ in range(3):
        b.record_failure()
    b.record_failure()
    clock.now = 1.0
    assert b.state == "half_open"


def test_validation() -> None:
    with pytest.raises(ValueError, match="failures"):
        CircuitBreaker(failures=0, cooldown_s=1.0, max_cooldown_s=1.0)
    with pytest.raises(ValueError, match="cooldown"):
        CircuitBreaker(failures=1, cooldown_s=2.0, max_cooldown_s=1.0)
