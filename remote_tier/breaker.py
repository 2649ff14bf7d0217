"""A circuit breaker: after repeated failures, fail fast instead of waiting on a dead server.

States: ``closed`` (calls pass; consecutive failures are counted), ``open`` (calls are refused
until the cooldown ends), ``half_open`` (exactly one probe call passes; its success closes
the breaker, its failure reopens it with the cooldown doubled, capped). The clock is
injected so tests step time instead of sleeping.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Literal

log = logging.getLogger(__name__)

BreakerState = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    """Failure bookkeeping for one server; no I/O, no locks (single event loop)."""

    def __init__(
        self,
        *,
        failures: int,
        cooldown_s: float,
        max_cooldown_s: float,
        clock: Callable[[], float] = time.monotonic,
        name: str = "redis",
    ) -> None:
        if failures < 1 or not 0 < cooldown_s <= max_cooldown_s:
            raise ValueError(
                f"need failures >= 1 and 0 < cooldown_s <= max_cooldown_s, got "
                f"{failures}, {cooldown_s}, {max_cooldown_s}"
            )
        self.name = name
        self._threshold = failures
        self._base_cooldown = cooldown_s
        self._max_cooldown = max_cooldown_s
        self._clock = clock
        self._state: BreakerState = "closed"
        self._num_failures = 0
        self._cooldown = cooldown_s
        self._open_until = 0.0
        self.num_opened = 0

    @property
    def state(self) -> BreakerState:
        """The state now (an open breaker whose cooldown ended reads as ``half_open``)."""
        if self._state == "open" and self._clock() >= self._open_until:
            return "half_open"
        return self._state

    @property
    def cooldown_s(self) -> float:
        """The cooldown the next opening will use."""
        return self._cooldown

    def allow(self) -> bool:
        """Whether a call may go to the server now. In ``half_open``, the first caller gets the
        probe and must report ``record_success``/``record_failure``; others are refused."""
        if self._state == "closed":
            return True
        if self._state == "open" and self._clock() >= self._open_until:
            self._state = "half_open"
            return True
        return False

    def record_success(self) -> None:
        """A call reached the server: close, forget failures, reset the cooldown."""
        if self._state != "closed":
            log.info("%s: reachable again; circuit closed", self.name)
        self._state = "closed"
        self._num_failures = 0
        self._cooldown = self._base_cooldown

    def record_failure(self) -> None:
        """A call failed for want of the server (connection, timeout)."""
        if self._state == "half_open":
            self._cooldown = min(self._cooldown * 2, self._max_cooldown)
            self._open()
            return
        if self._state == "open":
            return  # a call admitted before opening finished late; nothing new learned
        self._num_failures += 1
        if self._num_failures >= self._threshold:
            self._open()

    def abandon(self) -> None:
        """An admitted call ended with no verdict (cancelled): let the next call probe."""
        if self._state == "half_open":
            self._state = "open"
            self._open_until = self._clock()

    def _open(self) -> None:
        log.warning("%s: unreachable; circuit open for %.3g s", self.name, self._cooldown)
        self._state = "open"
        self._open_until = self._clock() + self._cooldown
        self._num_failures = 0
        self.num_opened += 1
