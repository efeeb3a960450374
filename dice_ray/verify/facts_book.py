"""The reference facts a Verifier has learnt, and which job measures a reference's facts now.

Every candidate of a task is checked against the same reference on the same trial-0 inputs, so its
determinism check and float64 run (:mod:`dice_ray.verify.trials.reference_facts`) answer the same for all of
them: the first job measures them and later jobs get them.  In RL the candidates of a task come as
a group (G at once), so most of a group's jobs reach their ``reference`` stage while the first is
still measuring; each measured again before this book (the benchmark's first round: 4-8 of 392 jobs
had the facts).  Here one job at a time measures a reference; the others wait for its facts (a
few to tens of ms, holding no GPU access) and get them with their stage's go.  The measuring
worker sends the facts as soon as it has them (its ``run`` stage announcement, before the candidate's
model is built), so a group waits for the reference, not for its first candidate.
"""

from __future__ import annotations

import threading
import time
from typing import Any

__all__ = ["FactsBook"]


class FactsBook:
    """Reference (sha256 of its source) -> its facts dict, with one measuring job a reference (thread-safe).

    Args:
        capacity: most references kept; the oldest is dropped first (~200 bytes each).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._cond = threading.Condition()
        self._facts: dict[str, dict[str, Any]] = {}
        self._measuring: dict[str, object] = {}  # reference -> the token of the job measuring it
        self.used = 0  # claims answered with facts

    def __len__(self) -> int:
        with self._cond:
            return len(self._facts)

    def __contains__(self, key: object) -> bool:
        with self._cond:
            return key in self._facts

    def claim(self, key: str, token: object, timeout_s: float) -> dict[str, Any] | None:
        """A job (``token``) reached its reference stage: the reference's facts when known; else None,
        and the job measures them, unless another job is measuring them: then wait (at most
        ``timeout_s`` seconds) until that job kept them (return them) or ended without (look again).
        After the timeout the job measures too (None)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                facts = self._facts.get(key)
                if facts is not None:
                    self.used += 1
                    return facts
                holder = self._measuring.get(key)
                if holder is None or holder is token:
                    self._measuring[key] = token
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._cond.wait(left)

    def keep(self, key: str, facts: dict[str, Any]) -> None:
        """A job measured ``facts`` for reference ``key``: keep them (the first kept stays) and wake its waiters."""
        with self._cond:
            if key not in self._facts and len(self._facts) >= self.capacity:
                self._facts.pop(next(iter(self._facts)))
            self._facts.setdefault(key, facts)
            self._cond.notify_all()

    def done(self, key: str, token: object) -> None:
        """Job ``token`` ended (whether or not it kept facts): if it was measuring ``key``, another job may now."""
        with self._cond:
            if self._measuring.get(key) is token:
                del self._measuring[key]
                self._cond.notify_all()
