"""One job at a time measures a reference's facts; the others wait for them (dice_ray.verify.facts_book),
and the worker's stage announcements carry them both ways (WorkerProcess.run's on_stage)."""

from __future__ import annotations

import threading
import time

from _verify_sources import HONEST, RELU_REF
from dice_ray.config import VerifyConfig
from dice_ray.verify.facts_book import FactsBook

FACTS = {"outputs": [], "note": ""}


def _claim_in_thread(book: FactsBook, key: str, token: object, timeout_s: float = 30.0) -> tuple[threading.Thread, list]:
    got: list = []
    t = threading.Thread(target=lambda: got.append(book.claim(key, token, timeout_s)))
    t.start()
    return t, got


def test_the_first_claim_measures_and_the_others_wait_for_its_facts():
    book = FactsBook(capacity=10)
    first = object()
    assert book.claim("ref", first, 1.0) is None  # nothing known: this job measures
    assert book.claim("ref", first, 1.0) is None  # the same job announcing again still measures
    waiters = [_claim_in_thread(book, "ref", object()) for _ in range(3)]
    time.sleep(0.2)
    assert all(t.is_alive() for t, _ in waiters)  # waiting for the measuring job, not measuring too
    book.keep("ref", FACTS)
    for t, got in waiters:
        t.join(5)
        assert got == [FACTS]
    book.done("ref", first)
    assert book.claim("ref", object(), 1.0) == FACTS and book.used == 4 and len(book) == 1
    assert book.claim("other", object(), 1.0) is None  # another reference is measured apart


def test_a_measuring_job_that_ends_without_facts_hands_the_measuring_on():
    """A reference that failed its check (or a job killed in its reference stage) keeps nothing: one
    waiter measures next, the rest keep waiting for it."""
    book = FactsBook(capacity=10)
    first = object()
    assert book.claim("ref", first, 1.0) is None
    a, b = object(), object()
    (ta, got_a), (tb, got_b) = _claim_in_thread(book, "ref", a), _claim_in_thread(book, "ref", b)
    time.sleep(0.1)
    book.done("ref", object())  # a job that was not measuring: changes nothing
    time.sleep(0.1)
    assert ta.is_alive() and tb.is_alive()
    book.done("ref", first)
    deadline = time.monotonic() + 5
    while ta.is_alive() == tb.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    (winner, got), (loser_t, loser_got) = ((a, got_a), (tb, got_b)) if not ta.is_alive() else ((b, got_b), (ta, got_a))
    assert got == [None] and loser_t.is_alive()  # exactly one measures next
    book.keep("ref", FACTS)
    book.done("ref", winner)
    loser_t.join(5)
    assert loser_got == [FACTS] and book.used == 1


def test_a_waiter_measures_itself_after_its_timeout_and_the_oldest_facts_go_first():
    book = FactsBook(capacity=2)
    assert book.claim("slow", object(), 1.0) is None
    t0 = time.monotonic()
    assert book.claim("slow", object(), 0.2) is None  # the measuring job is stuck: measure too
    assert time.monotonic() - t0 >= 0.2  # it waited its own timeout first
    for key in ("a", "b", "c"):
        book.keep(key, {"outputs": [], "note": key})
    book.keep("b", {"outputs": [], "note": "later"})  # the first kept stays
    assert len(book) == 2 and book.claim("b", object(), 0.0)["note"] == "b"
    assert book.claim("a", object(), 0.0) is None  # dropped: the oldest


def test_the_hook_sees_each_stage_and_its_wait_counts_against_no_limit():
    """WorkerProcess.run calls on_stage at each announcement before the gate is taken; what it returns
    goes with the go, and time it blocks is not the stage's (a job of a reference being measured
    waits there)."""
    from dice_ray.verify.sandbox.runner import GpuGate, WorkerProcess

    cfg = VerifyConfig(mode="compile_only", workers=1)
    gate = GpuGate()
    worker = WorkerProcess({**cfg.model_dump(), "mode": "compile_only", "device": None}, gate=gate)
    seen: list[tuple[str, bool]] = []

    def on_stage(msg: dict) -> dict | None:
        seen.append((msg["stage"], gate._readers == 0 and not gate._writer))
        if msg["stage"] == "reference":
            time.sleep(1.5)  # longer than the stage's limit below
            return {"reference_facts": FACTS}
        return None

    try:
        worker.wait_ready(120)
        job = {"task_id": "t", "candidate_src": HONEST, "reference_src": RELU_REF,
               "kernel_refs": {"kernels": ["relu_kernel"]}}
        out = worker.run(job, {"load": 60.0, "reference": 1.0, "run": 60.0}, on_stage)
        assert out.kind == "result" and out.result["verdict"] == "ok", out
        assert [s for s, _ in seen] == ["load", "reference", "run"]
        assert seen[1][1]  # after load, before the reference stage's shared access: nothing held
        assert out.stage_s["on_stage"] >= 1.5 and out.stage_s["reference"] < 1.0
    finally:
        worker.close()
